"""The training corpus that ships with tachyon: 24 works of Shakespeare, about 3 MB of ASCII text.

The text lives in ``tachyon/data/assets/shakespeare.txt.gz`` (origin, licence and how it was
cleaned: ``assets/SOURCE.md`` beside it) and is read through ``importlib.resources``, so it works
from a source checkout, an installed wheel or a zip, and nothing is downloaded at run time.

Train/validation split: deterministic and without overlap. Every work is cut at the first
paragraph break (a blank line) at or after ``(1 - validation_fraction)`` of its length; the head
goes to "train", the tail to "validation". Cutting every work, rather than holding out whole
works, keeps the two splits the same mix of verse, prose, plays and sonnets.
"""

from __future__ import annotations

import functools
import gzip
from importlib import resources

CORPUS_RESOURCE = ("assets", "shakespeare.txt.gz")
"""Path of the corpus file inside the ``tachyon.data`` package."""

WORK_SEPARATOR = "\f\n"
"""Separates works inside the corpus file (a form-feed line; it never occurs in the text)."""

DOCUMENT_JOINER = "\n\n"
"""What :func:`load_corpus` puts between works when it returns them as one string."""

SPLITS = ("all", "train", "validation")
DEFAULT_VALIDATION_FRACTION = 0.05


@functools.lru_cache(maxsize=1)
def _read_works() -> tuple[str, ...]:
    data = resources.files("tachyon.data").joinpath(*CORPUS_RESOURCE).read_bytes()
    text = gzip.decompress(data).decode("utf-8")
    return tuple(text.split(WORK_SEPARATOR))


def _check_split(split: str, validation_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float)):
        raise ValueError(f"validation_fraction must be a number in (0, 0.5], got {validation_fraction!r}")
    if not 0.0 < validation_fraction <= 0.5:
        raise ValueError(f"validation_fraction must be in (0, 0.5], got {validation_fraction}")


def split_document(text: str, validation_fraction: float = DEFAULT_VALIDATION_FRACTION) -> tuple[str, str]:
    """Cut one document into (train, validation) at a paragraph break near its end.

    The cut is the first blank line at or after ``int(len(text) * (1 - validation_fraction))``;
    failing that, the first line break there; failing that, that character index. The two parts
    concatenate back to ``text`` up to the blank line removed at the cut (``train + "\\n\\n" +
    validation == text`` whenever a paragraph break was found).
    """
    _check_split("all", validation_fraction)
    start = int(len(text) * (1.0 - validation_fraction))
    cut = text.find("\n\n", start)
    if cut >= 0:
        return text[:cut], text[cut + 2:]
    cut = text.find("\n", start)
    if cut >= 0:
        return text[:cut], text[cut + 1:]
    return text[:start], text[start:]


def load_works(split: str = "all", validation_fraction: float = DEFAULT_VALIDATION_FRACTION) -> list[str]:
    """The corpus as a list of documents (one per work, 24 in all), each a ``str``.

    Args:
        split: "all" (whole works), "train" (each work's head) or "validation" (each work's tail).
        validation_fraction: share of every work that goes to "validation", in (0, 0.5].
    """
    _check_split(split, validation_fraction)
    works = _read_works()
    if split == "all":
        return list(works)
    index = 0 if split == "train" else 1
    return [split_document(work, validation_fraction)[index] for work in works]


def load_corpus(split: str = "all", validation_fraction: float = DEFAULT_VALIDATION_FRACTION) -> str:
    """The corpus (or one split of it) as one string, works joined by a blank line.

    About 3.0 M characters for "all", ~95 % of that for "train" and ~5 % for "validation" at the
    default fraction. Deterministic: the same arguments give the same string on every machine.
    """
    return DOCUMENT_JOINER.join(load_works(split, validation_fraction))
