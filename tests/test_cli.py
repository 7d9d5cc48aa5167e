"""The tachyon command: --version, info, demo, as a console script and python -m tachyon."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tachyon
from tachyon.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tachyon {tachyon.__version__}"


def test_info_lists_versions_and_every_capability_with_a_reason(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"tachyon {tachyon.__version__}" in out
    for name in ("torch", "triton", "pydantic", "transformers"):
        assert any(line.startswith(f"  {name} ") and "tested:" in line for line in out.splitlines()), name
    capabilities = out.split("capabilities:")[1].splitlines()
    for name in ("cuda", "triton", "bf16", "fp8"):
        line = next(line for line in capabilities if line.startswith(f"  {name} "))
        assert len(line.split(maxsplit=2)) == 3, f"no detail for {name}: {line!r}"


def test_info_warns_for_a_version_outside_the_tested_range(capsys, monkeypatch):
    from tachyon import versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: "4.57.1" if name == "transformers" else real(name))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("  transformers "))
    assert "4.57.1" in row and "WARNING: outside the tested range" in row
    oldest, newest = versions.tested_ranges()["transformers"]
    assert f"WARNING: transformers 4.57.1 is outside the range tachyon was tested with ({oldest} - {newest})" in out


def test_python_dash_m_runs_the_same_command():
    out = subprocess.run([sys.executable, "-m", "tachyon", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"tachyon {tachyon.__version__}"


def test_demo_trains_and_reports_its_checks(capsys):
    assert main(["demo", "--steps", "30"]) == 0
    out = capsys.readouterr().out
    assert "checked:" in out
    assert "LayerNorm vs torch.nn.LayerNorm" in out
    assert "loss" in out


def test_unknown_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_capabilities_report_reasons():
    caps = tachyon.capabilities()
    assert set(caps) == {"cuda", "triton", "bf16", "fp8"}
    for name, cap in caps.items():
        assert cap.detail, f"{name} has no detail"
