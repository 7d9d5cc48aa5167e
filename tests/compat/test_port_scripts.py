"""DeepSpeedExamples-style training scripts (tests/compat/port_scripts/) run unchanged but for
their import lines on 2 gloo ranks, and their loss goes down. Each script's docstring lists the
DeepSpeed features it exercises:

- cifar_ds.py: add_config_arguments, init_distributed, initialize with training_data, the engine's
  local_rank / bfloat16_enabled / fp16_enabled / was_step_applied / get_global_grad_norm,
  deepspeed.accelerator, param.grad read after backward, gradient_clipping, WarmupLR, eval mode;
- bert_ds.py: a BERT-style masked-token loop with bf16, ZeRO-1, gradient accumulation,
  WarmupDecayLR, save_checkpoint(client_state=) every few steps and a resumed second run,
  deepspeed.utils.RepeatingLoader / log_dist, model attributes through the engine;
- pipeline_ds.py: deepspeed.pipe.PipelineModule over 2 stages, train_batch() from the engine's
  data loader, deepspeed.runtime.utils.set_random_seed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.compat import _port_ranks
from tests.utils import run_distributed

SCRIPTS = sorted(p.name for p in _port_ranks.SCRIPTS.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_differ_from_deepspeed_code_only_in_import_lines(script):
    """Every line naming tachyon is an import of tachyon.compat.deepspeed standing for `import deepspeed`."""
    for number, line in enumerate((_port_ranks.SCRIPTS / script).read_text().splitlines(), 1):
        if "tachyon" in line:
            assert re.fullmatch(r"(import tachyon\.compat\.deepspeed as deepspeed|"
                                r"from tachyon\.compat\.deepspeed(\.[a-z_.]+)? import [A-Za-z_, ]+)", line), \
                f"{script}:{number}: {line}"


def _losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"loss: ([0-9.]+)", text)]


@pytest.mark.distributed
def test_deepspeed_examples_style_scripts_train_on_two_ranks(tmp_path):
    out = run_distributed(_port_ranks.rank_main, 2, str(tmp_path), tuple(SCRIPTS), timeout=240)
    printed = out[0]
    assert all(not text.strip() for text in out[1].values()), "only rank 0 prints"

    cifar = _losses(printed["cifar_ds.py"])
    assert len(cifar) == 4 and cifar[-1] < 0.8 * cifar[0], printed["cifar_ds.py"]
    accuracy = float(re.search(r"accuracy: ([0-9.]+)", printed["cifar_ds.py"]).group(1))
    assert accuracy > 0.3, printed["cifar_ds.py"]  # 10 classes: chance is 0.1

    bert = printed["bert_ds.py"]
    steps = [int(s) for s in re.findall(r"global_steps (\d+)", bert)]
    bert_losses = _losses(bert)
    first_run = bert_losses[:len(bert_losses) - 4]
    assert first_run[-1] < 0.8 * first_run[0], bert
    assert "first run ended at step 24" in bert
    # the resumed run starts after the checkpoint of step 24 (12 optimizer steps), not from 0
    assert steps[:12] == list(range(1, 13)) and steps[12:] == [13, 14, 15, 16], bert
    samples = [int(s) for s in re.findall(r"samples (\d+)", bert)]
    assert samples[11] == 12 * 16 and samples[-1] == 16 * 16, bert  # 4 x 2 micro-batches x 2 ranks per step
    assert sorted(p.name for p in (tmp_path / "bert_checkpoints").iterdir() if p.is_dir())

    pipe = _losses(printed["pipeline_ds.py"])
    assert len(pipe) == 2 and pipe[1] < 0.8 * pipe[0], printed["pipeline_ds.py"]
