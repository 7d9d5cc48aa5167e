"""The tested-versions table agrees with constraints.txt (its newest end) and pyproject.toml's lower
bounds (its oldest end), and the version check compares releases correctly."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tachyon import versions

ROOT = Path(__file__).resolve().parent.parent


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[_normalize(name)] = version
    return pins


def _lower_bounds() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += extra
    bounds = {}
    for spec in specs:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(?:>=\s*([0-9.]+))?", spec)
        assert match, f"pyproject.toml: {spec!r} is neither a bare name nor name>=version"
        if match.group(2):
            bounds[_normalize(match.group(1))] = match.group(2)
    return bounds


def test_newest_tested_is_the_pin_in_constraints():
    pins = _constraints()
    for name, (_, newest) in versions.tested_ranges().items():
        assert pins.get(_normalize(name)) == newest, f"{name}: tested_versions.json says {newest}, " \
                                                     f"constraints.txt pins {pins.get(_normalize(name))}"


def test_every_direct_dependency_is_pinned_and_in_the_table():
    pins, table = _constraints(), {_normalize(n) for n in versions.tested_ranges()}
    for name in _lower_bounds():
        assert name in pins, f"{name} has a lower bound in pyproject.toml but no pin in constraints.txt"
        assert name in table, f"{name} has a lower bound in pyproject.toml but no row in tested_versions.json"


def test_oldest_tested_is_the_pyproject_lower_bound():
    bounds = _lower_bounds()
    for name, (oldest, _) in versions.tested_ranges().items():
        bound = bounds.get(_normalize(name))
        if name == "torch":  # allowed below the tested version for the GPU machines (pyproject says why)
            assert bound is not None and versions.parse_version(bound) <= versions.parse_version(oldest)
        elif bound is not None:
            assert versions.parse_version(bound) == versions.parse_version(oldest)[:len(versions.parse_version(bound))], \
                f"{name}: pyproject.toml's lower bound {bound} is not the oldest tested version {oldest}"


@pytest.mark.parametrize("text, expected", [
    ("2.13.0+cpu", (2, 13, 0)), ("5.24.0", (5, 24, 0)), ("2.0", (2, 0)), ("5.0.0rc1", (5, 0, 0)),
    ("2026.9.0", (2026, 9, 0)), ("1.2.3.post1", (1, 2, 3)), ("abc", ()),
])
def test_parse_version(text, expected):
    assert versions.parse_version(text) == expected


def test_in_range_compares_releases_not_strings():
    row = versions.VersionRow("x", "5.10.0", "5.3.0", "5.24.0")
    assert row.in_range  # "5.10.0" < "5.3.0" as strings, but not as releases
    assert not versions.VersionRow("x", "5.2.9", "5.3.0", "5.24.0").in_range
    assert not versions.VersionRow("x", "5.25.0", "5.3.0", "5.24.0").in_range
    assert versions.VersionRow("x", "2.13.0+cpu", "2.13.0", "2.13.0").in_range
    assert versions.VersionRow("x", "2.0.3", "2.0", "2.14.4").in_range
    assert versions.VersionRow("x", None, "1", "2").in_range and "not installed" in versions.VersionRow("x", None, "1", "2").line()
