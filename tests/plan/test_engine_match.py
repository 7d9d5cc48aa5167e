"""The plan against tachyon's own engine on CPU: model states byte for byte (engine.memory_breakdown),
activations against what the engine's forward saves for backward (within 1%; the issue asks 10%).

Model states are measured at the two points a step holds the most: between micro-steps (after a
non-boundary backward) and after the boundary backward, and the larger is compared with the
plan (the engine's formula is "after the boundary backward, the most of the step").
"""

from __future__ import annotations

import pytest
import torch

from tachyon.hardware import get_gpu
from tachyon.plan import Layout, estimate
from tachyon.plan.model import ModelSpec
from tests.utils import run_distributed

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, MICRO, GAS = 262, 64, 2, 4, 32, 2, 2
SPEC = ModelSpec(family="gpt", layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ, vocab=VOCAB)
STATE_KEYS = ("parameters", "gradients", "master_weights", "optimizer_states", "model_states")


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    return ids, torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)


def measure(stage: int, dtype: str) -> dict:
    """Train 2 steps of GAS micro-batches; the memory breakdown at the largest point of step 2, and
    the bytes the engine's forward saved for backward."""
    import torch.distributed as dist

    import tachyon
    from tachyon.nn.transformer_kernel.memory import saved_tensor_bytes
    from tachyon.train.models import GPT

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = GPT(VOCAB, HIDDEN, LAYERS, HEADS, max_seq_len=SEQ)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    engine, *_ = tachyon.initialize(model=model, config=config)
    peak, saved = {k: 0 for k in STATE_KEYS}, 0
    for step in range(2):
        for micro in range(GAS):
            ids, labels = _batch(step * GAS + micro, rank)
            params = list(model.parameters())
            loss, nbytes = saved_tensor_bytes(lambda: engine(ids, None, labels), exclude=params)
            saved = max(saved, nbytes)
            engine.backward(loss)
            if step == 1:
                memory = engine.memory_breakdown()
                if memory["model_states"] > peak["model_states"]:
                    peak = {k: memory[k] for k in STATE_KEYS}
            engine.step()
    return {"states": peak, "saved": saved, "world": world}


def _planned(stage: int, dtype: str, world: int):
    return estimate(SPEC, Layout(dp=world, zero=stage, dtype=dtype, micro_batch=MICRO, grad_accum=GAS),
                    get_gpu("h100"))


def _check(result: dict, stage: int, dtype: str) -> None:
    plan = _planned(stage, dtype, result["world"])
    memory = plan.binding_stage.memory
    for key in STATE_KEYS:
        assert result["states"][key] == memory[key], (
            f"stage {stage} {dtype} x{result['world']}: {key} measured {result['states'][key]}, planned {memory[key]}")
    planned = memory["activations"]
    assert abs(result["saved"] - planned) / result["saved"] < 0.01, (result["saved"], planned)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_plan_equals_the_engine_in_one_process(stage, dtype, one_thread):
    _check(measure(stage, dtype), stage, dtype)


def _rank(cases):
    return {case: measure(*case) for case in cases}


@pytest.mark.distributed
@pytest.mark.slow  # ~30 s: 2 spawned ranks, 3 engines each
def test_plan_equals_the_engine_on_two_ranks():
    cases = [(1, "bf16"), (2, "bf16"), (1, "fp16")]
    results = run_distributed(_rank, 2, cases, timeout=240)
    for rank_result in results:
        for (stage, dtype), result in rank_result.items():
            assert result["world"] == 2
            _check(result, stage, dtype)
