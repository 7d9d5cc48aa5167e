"""docs/engine.md's config and engine reference tables are what tools/engine_reference.py
generates from the code: a key, default or engine attribute added or changed without
regenerating the page fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("engine_reference", ROOT / "tools" / "engine_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_doc_reference_tables_are_current():
    tool = _tool()
    current = tool.DOC.read_text(encoding="utf-8")
    assert tool.render(current) == current, "docs/engine.md is out of date: run python tools/engine_reference.py"


def test_reference_covers_every_config_key_and_engine_name():
    from tachyon.config import ACCEPTED_IGNORED_KEYS, UNSUPPORTED_KEYS, TachyonConfig
    from tachyon.engine.compat_missing import NOT_PROVIDED

    text = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    for key in TachyonConfig.model_fields:
        assert f"`{key}`" in text, key
    for path in [*UNSUPPORTED_KEYS, *ACCEPTED_IGNORED_KEYS]:
        assert f"`{path}`" in text, path
    for name in NOT_PROVIDED:
        assert f"`{name}`" in text, name
    for name in ("local_rank", "global_samples", "was_step_applied()", "no_sync()", "fp16_enabled()"):
        assert f"`{name}`" in text, name


def test_the_check_fails_on_a_stale_page():
    tool = _tool()
    stale = tool.DOC.read_text(encoding="utf-8").replace("| `steps_per_print` | int | 10 |", "| `steps_per_print` | int | 11 |")
    assert tool.render(stale) != stale
