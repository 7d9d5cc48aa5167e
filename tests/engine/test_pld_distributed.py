"""Progressive layer drop composed with ZeRO-1 and ZeRO-2, bf16 and gradient accumulation on 2
gloo ranks: each rank draws its own layer decisions (different seeds); a layer that ran in no
micro-batch of a step on any rank keeps its bf16 weights, fp32 masters and Adam moments exactly
(each rank checks its own partition), and every layer that ran somewhere moves."""

from __future__ import annotations

import pytest
import torch

from tests.utils import run_distributed

pytestmark = pytest.mark.distributed

STEPS, GAS = 5, 2


def train_and_check(stage: int) -> dict:
    import torch.distributed as dist

    import tachyon
    from tests.engine.test_pld import HIDDEN, MICRO, SEQ, Stack, param_state

    rank = dist.get_rank()
    model = Stack(depth=3, dtype=torch.bfloat16)
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "progressive_layer_drop": {"enabled": True, "theta": 0.1, "gamma": 3.0},
    }
    engine, *_ = tachyon.initialize(model=model, config=config)
    torch.manual_seed(100 + rank)  # each rank draws its own layer decisions
    dropped_everywhere = kept_somewhere = 0
    for step in range(STEPS):
        before = [[param_state(engine, p) for p in layer.parameters()] for layer in model.layers]
        weights = [[p.detach().clone() for p in layer.parameters()] for layer in model.layers]
        start = len(model.forwards)
        for micro in range(GAS):
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(MICRO, SEQ, HIDDEN, generator=gen).to(torch.bfloat16)
            y = torch.randn(MICRO, SEQ, generator=gen)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        ran = torch.tensor([any(f[i] for f in model.forwards[start:]) for i in range(3)], dtype=torch.uint8)
        dist.all_reduce(ran, op=dist.ReduceOp.MAX)
        for index, layer in enumerate(model.layers):
            after = [param_state(engine, p) for p in layer.parameters()]
            same_state = all(torch.equal(b[k], a[k]) for b, a in zip(before[index], after) for k in a if k in b)
            same_weights = all(torch.equal(w, p) for w, p in zip(weights[index], layer.parameters()))
            if ran[index]:
                kept_somewhere += 1
                assert not same_weights, f"rank {rank} step {step}: layer {index + 1} ran but did not move"
            elif step > 0:  # moments are nonzero from step 1 on
                dropped_everywhere += 1
                assert same_state and same_weights, (
                    f"rank {rank} step {step}: layer {index + 1} ran nowhere but its weights or moments changed")
    engine.destroy()
    return {"dropped": dropped_everywhere, "kept": kept_somewhere}


def run_both_stages() -> list[dict]:
    return [train_and_check(1), train_and_check(2)]


def test_pld_with_zero_1_and_2_bf16_and_gradient_accumulation_on_two_ranks():
    results = run_distributed(run_both_stages, 2, timeout=240)
    for stage, (r0, r1) in zip((1, 2), zip(*results)):
        assert r0 == r1, f"stage {stage}: the ranks saw different steps: {r0} vs {r1}"
        assert r0["dropped"] >= 1 and r0["kept"] >= 3, f"stage {stage}: not enough of both cases: {r0}"


def tensor_parallel_seeds() -> dict:
    """tp=2: first each rank seeded differently (refused at initialize, model untouched), then
    both alike (initialize accepts; two PLD steps run, drawing the same decisions on both ranks)."""
    import torch.distributed as dist

    import tachyon
    from tachyon.config import ConfigError
    from tests.engine.test_pld import HIDDEN, MICRO, SEQ, Stack

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "tensor_parallel": {"tp_size": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "progressive_layer_drop": {"enabled": True, "theta": 0.1, "gamma": 3.0}}
    model = Stack(depth=3)
    torch.manual_seed(10 + rank)
    try:
        tachyon.initialize(model=model, config=config)
        refused = ""
    except ConfigError as error:
        refused = str(error)
    untouched = getattr(model, "_tachyon_tp", None) is None
    torch.manual_seed(10)
    engine, *_ = tachyon.initialize(model=model, config=config)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(MICRO, SEQ, HIDDEN, generator=gen), torch.randn(MICRO, SEQ, generator=gen)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.destroy()
    return {"refused": refused, "untouched": untouched, "forwards": model.forwards}


def test_pld_with_tensor_parallelism_refuses_ranks_seeded_apart():
    results = run_distributed(tensor_parallel_seeds, 2, timeout=240)
    for rank, r in enumerate(results):
        assert "torch's default generator on this rank" in r["refused"] and "Seed them alike" in r["refused"], r
        assert f"tensor-parallel rank(s) [{1 - rank}]" in r["refused"], r["refused"]
        assert r["untouched"], "refused after the model was made tensor parallel"
    assert results[0]["forwards"] == results[1]["forwards"], "seeded alike, the ranks drew the same layers"
