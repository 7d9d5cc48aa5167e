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


# ---------------------------------------------------------------------- tachyon plan
def _plan_json(capsys, *argv):
    import json

    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_plan_json_reproduces_the_zero_paper_table(capsys, stage, gb):
    code, plan = _plan_json(capsys, "--params", "7.5B", "--gpus", "64", "--zero", str(stage), "--dtype", "fp16",
                            "--micro-batch", "1", "--global-batch", "256")  # 4 micro-batches per step
    assert plan["layout"]["grad_accum"] == 4
    assert round(plan["memory"]["per_gpu"]["model_states"] / 1e9, 1) == gb
    assert code == (1 if stage == 0 else 0) and plan["memory"]["fits"] == (stage > 0)  # 120 GB > one 80 GB GPU


def test_plan_zero_3_with_offload_keeps_only_the_16_bit_shard_per_gpu(capsys):
    """7.5B parameters, 64 GPUs, fp16, Adam: the device keeps its fp16 shard (2 Psi / N), the host
    the masters, the fp32 gradient accumulator and Adam's moments (16 Psi / N)."""
    code, plan = _plan_json(capsys, "--params", "7.5B", "--gpus", "64", "--zero", "3", "--offload", "--dtype", "fp16",
                            "--micro-batch", "1", "--global-batch", "64")
    assert code == 0 and plan["layout"]["zero"] == 3 and plan["layout"]["offload"] is True
    from tachyon.plan.estimate import padded

    per_gpu, psi = plan["memory"]["per_gpu"], padded(7_500_000_000, 64)  # a multiple of 64 * 8 elements
    assert per_gpu["offloaded"] == 16 * psi / 64 + 4  # + Adam's float32 step
    assert per_gpu["total"] == 2 * psi / 64
    assert main(["plan", "--params", "7.5B", "--gpus", "64", "--zero", "0", "--offload"]) == 2
    assert "needs ZeRO stage 1, 2 or 3" in capsys.readouterr().err


def test_plan_one_layout_table(capsys):
    code = main(["plan", "--model", "llama-7b", "--gpus", "8", "--tp", "2", "--pp", "1", "--zero", "1",
                 "--micro-batch", "1", "--global-batch", "64", "--checkpointing", "full"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("memory per GPU", "fp32 master weights", "activations", "communication per step", "dp ", "tp ",
                 "MFU", "fits"):
        assert text in out, text


def test_plan_ranks_the_layouts_left_open(capsys):
    code, result = _plan_json(capsys, "--model", "gpt2", "--gpus", "16", "--global-batch", "64", "--top", "5")
    assert code == 0 and result["fit"] > 0 and len(result["layouts"]) == 5
    speeds = [row["tokens_per_s"] for row in result["layouts"]]
    assert speeds == sorted(speeds, reverse=True) and all(row["fits"] for row in result["layouts"])
    assert result["best"]["layout"] == {k: result["layouts"][0][k] for k in result["best"]["layout"]}
    main(["plan", "--model", "gpt2", "--gpus", "16", "--global-batch", "64"])
    assert "layouts considered" in capsys.readouterr().out


def test_plan_refuses_impossible_inputs_with_exit_status_2(capsys):
    for argv, message in [
        (["--model", "gpt2", "--gpus", "8", "--tp", "8"], "tp = 8 must divide the 12 attention heads"),
        (["--model", "gpt2", "--gpus", "16", "--pp", "16"], "pp = 16 pipeline stages but the model has 12 layers"),
        (["--layers", "2", "--hidden", "64", "--gpus", "1"], "missing: --heads, --seq, --vocab"),
        (["--model", "gpt2", "--gpus", "8", "--gpu", "b100"], "unknown GPU 'b100'"),
        (["--model", "gpt2", "--gpus", "8", "--gpu", "a100", "--dtype", "fp8"], "lacks"),
    ]:
        assert main(["plan", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["plan", "--model", "gpt2", "--gpus", "7.5"])


def test_plan_says_when_nothing_fits_with_exit_status_1(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpus", "2", "--global-batch", "2"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_plan_reads_an_hf_config(tmp_path, capsys):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256,
                                "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 688,
                                "vocab_size": 32000, "max_position_embeddings": 2048}))
    code, plan = _plan_json(capsys, "--model", str(path), "--gpus", "1", "--zero", "0", "--tp", "1", "--pp", "1",
                            "--micro-batch", "1", "--checkpointing", "none")
    assert code == 0 and plan["model"]["family"] == "llama" and plan["model"]["kv_heads"] == 2
