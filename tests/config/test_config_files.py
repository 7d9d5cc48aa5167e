"""Config files as DeepSpeed reads them: JSON always; Hjson through the hjson package when it is
installed (DeepSpeed's reader, with its duplicate-key check), else through tachyon's own reader;
text that is neither is refused naming the file, line and column."""

from __future__ import annotations

import json
import sys
import types

import pytest

from tachyon.config import ConfigError, load_config

HJSON_TEXT = "# a DeepSpeed config\n{\n  train_batch_size: 8\n  bf16: {enabled: true}\n}\n"


def _fake_hjson(calls: list, result=None, error: Exception | None = None) -> types.ModuleType:
    module = types.ModuleType("hjson")

    def loads(text, **kwargs):
        calls.append((text, kwargs))
        if error is not None:
            raise error
        return result

    module.loads = loads
    return module


def test_json_files_never_touch_the_hjson_package(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "hjson", _fake_hjson(calls))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabled": True}}))
    config = load_config(path, world_size=2)
    assert config.train_micro_batch_size_per_gpu == 4 and config.fp16.enabled
    assert calls == []


def test_without_the_hjson_package_tachyon_reads_hjson_and_refuses_what_is_neither(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hjson", None)  # `import hjson` raises ImportError
    path = tmp_path / "ds.hjson"
    path.write_text(HJSON_TEXT)
    config = load_config(path)
    assert config.train_batch_size == 8 and config.bf16.enabled
    path.write_text('{\n  "train_batch_size": 8,\n  ]\n}\n')
    with pytest.raises(ConfigError, match=r"ds\.hjson:3:3: invalid JSON \(and invalid Hjson, which DeepSpeed also "
                                          r"reads; read by tachyon's Hjson reader\)"):
        load_config(path)


def test_an_installed_hjson_package_reads_non_json_files_as_deepspeed_does(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "hjson", _fake_hjson(calls, result={"train_batch_size": 6}))
    path = tmp_path / "ds.hjson"
    path.write_text(HJSON_TEXT)
    assert load_config(path, world_size=3).train_micro_batch_size_per_gpu == 2
    (text, kwargs), = calls
    assert text == HJSON_TEXT
    hook = kwargs["object_pairs_hook"]  # DeepSpeed's duplicate-key check goes with it
    assert hook([("a", 1)]) == {"a": 1}
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        hook([("a", 1), ("a", 2)])


def test_the_hjson_package_errors_become_config_errors(tmp_path, monkeypatch):
    error = ValueError("Expecting value")
    error.lineno, error.colno, error.msg = 4, 2, "Expecting value"
    monkeypatch.setitem(sys.modules, "hjson", _fake_hjson([], error=error))
    path = tmp_path / "ds.hjson"
    path.write_text("{ not json")
    with pytest.raises(ConfigError, match=r"ds\.hjson:4:2: invalid JSON \(and invalid Hjson, which DeepSpeed also "
                                          r"reads; read by the hjson package\): Expecting value"):
        load_config(path)
