"""The dependency versions tachyon has been tested with, and a check of what is installed.

``tested_versions.json`` (next to this file) holds, for each dependency, the oldest and the
newest version the default test suite passed with: the newest are the pins in the repository's
``constraints.txt`` (what ``make test`` and ``make train`` install), the oldest the lower bounds in
``pyproject.toml``. ``make upgrade-check`` moves the newest end (see the README).

    for row in tachyon.versions.report():      # what `tachyon info` prints
        print(row.line())
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata, resources

# The import name differs from the distribution name for these.
_DISTRIBUTION = {"pydantic-core": "pydantic_core", "huggingface-hub": "huggingface_hub"}


def tested_ranges() -> dict[str, tuple[str, str]]:
    """{distribution name: (oldest, newest)} the test suite passed with."""
    text = resources.files("tachyon").joinpath("tested_versions.json").read_text(encoding="utf-8")
    return {name: (r["oldest"], r["newest"]) for name, r in json.loads(text)["tested"].items()}


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: "2.13.0+cpu" -> (2, 13, 0), "5.0.0rc1" -> (5, 0, 0)."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def _padded(v: tuple[int, ...], n: int = 4) -> tuple[int, ...]:
    return v + (0,) * (n - len(v))


@dataclass(frozen=True)
class VersionRow:
    name: str
    installed: str | None  # None: not installed
    oldest: str
    newest: str

    @property
    def in_range(self) -> bool:
        if self.installed is None:
            return True
        v = _padded(parse_version(self.installed))
        return _padded(parse_version(self.oldest)) <= v <= _padded(parse_version(self.newest))

    def line(self) -> str:
        tested = self.oldest if self.oldest == self.newest else f"{self.oldest} - {self.newest}"
        if self.installed is None:
            return f"{self.name:<16} not installed (tested: {tested})"
        warn = "" if self.in_range else "   WARNING: outside the tested range"
        return f"{self.name:<16} {self.installed:<12} (tested: {tested}){warn}"


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(_DISTRIBUTION.get(name, name))
    except metadata.PackageNotFoundError:
        return None


def report(names: list[str] | None = None) -> list[VersionRow]:
    """One row per dependency (all of tested_versions.json by default)."""
    ranges = tested_ranges()
    return [VersionRow(n, installed_version(n), *ranges[n]) for n in (names or list(ranges))]


def warnings(names: list[str] | None = None) -> list[str]:
    """A sentence for each installed dependency outside its tested range."""
    return [f"{r.name} {r.installed} is outside the range tachyon was tested with ({r.oldest} - {r.newest})"
            for r in report(names) if not r.in_range]


__all__ = ["VersionRow", "installed_version", "parse_version", "report", "tested_ranges", "warnings"]
