"""Features compose: ZeRO-2 + BF16 + gradient accumulation + activation checkpointing + FP8 with the
FP8 weight cache, all at once, on 2 gloo ranks against the same training in one process.

The model is two tachyon.nn.TransformerLayer (bf16 parameters) and a head; each layer runs under
tachyon.checkpointing.checkpoint inside fp8_autocast(fp8_group=engine.data_parallel_group), with
is_first_microbatch=True on the first micro-batch of a step and False after. The single process
trains on the concatenation of the ranks' micro-batches, so the amaxes it records are the MAX
over the ranks' (what fp8_group reduces), and its parameters are what data parallelism should
produce, up to bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import assert_close, run_distributed

pytestmark = pytest.mark.distributed

HIDDEN, FFN, HEADS, SEQ, MICRO, GAS, STEPS = 32, 64, 2, 8, 2, 2, 3


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import tachyon.nn

        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            tachyon.nn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                        params_dtype=torch.bfloat16, attn_input_format="bshd")
            for _ in range(2)
        )
        self.head = torch.nn.Linear(HIDDEN, 1, dtype=torch.bfloat16)

    def forward(self, x, is_first_microbatch=None, fp8_group=None):
        import tachyon

        with tachyon.fp8_autocast(enabled=True, fp8_group=fp8_group):
            for layer in self.layers:
                x = tachyon.checkpointing.checkpoint(layer, x, is_first_microbatch=is_first_microbatch)
        return self.head(x).float().squeeze(-1)


def micro_batch(micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * micro + rank)  # the same batch every step: the loss must fall
    x = torch.randn(MICRO, SEQ, HIDDEN, generator=gen).to(torch.bfloat16)
    return x, torch.randn(MICRO, SEQ, generator=gen)


def train(world: int) -> dict:
    """Train STEPS steps; world 1 = one process on every rank's data at once."""
    import torch.distributed as dist

    import tachyon

    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    ranks = [rank] if distributed else list(range(world))
    model = Model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO * len(ranks), "gradient_accumulation_steps": GAS,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096},
        # SGD: a parameter's change follows its gradient, so the comparison measures the gradients
        # (Adam would turn a rounding-level difference in a near-zero gradient into a step of +-lr)
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
    }
    engine, _, _, _ = tachyon.initialize(model=model, config=config)
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            xs, ys = zip(*(micro_batch(micro, r) for r in ranks))
            x, y = torch.cat(xs), torch.cat(ys)
            out = engine(x, is_first_microbatch=micro == 0, fp8_group=engine.data_parallel_group)
            loss = torch.nn.functional.mse_loss(out, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    fp8_state = {name: module.fp8_state_dict() for name, module in model.named_modules()
                 if hasattr(module, "fp8_scaling")}
    return {"params": [p.detach().float().clone() for p in model.parameters()], "fp8": fp8_state,
            "losses": losses, "steps": engine.global_steps}


def _flat_states(fp8_state: dict) -> dict[str, torch.Tensor]:
    return {f"{m}.{g}.{role}.{k}": v for m, state in fp8_state.items() for g, roles in state["gemms"].items()
            for role, values in roles.items() for k, v in values.items()}


@pytest.fixture(scope="module")
def runs():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ranks = run_distributed(train, 2, 2, timeout=300)
        single = train(2)
    finally:
        torch.set_num_threads(threads)
    return ranks, single


def test_zero2_bf16_checkpointing_fp8_cache_matches_one_process(runs):
    """The ranks' parameters are identical (ZeRO all-gathers one result) and each parameter's total
    update is the one process's within 5% (RMS). The GEMMs run in FP8 (E5M2 gradients keep 2
    mantissa bits), and the two runs cast with scales from different amax histories, so elementwise
    bf16 tolerances do not apply; a wrong reduction, a lost micro-batch or a stale cached weight
    changes updates by far more."""
    ranks, single = runs
    assert all(r["steps"] == STEPS for r in ranks) and single["steps"] == STEPS
    initial = [p.detach().float() for p in Model().parameters()]
    for i, (a, b) in enumerate(zip(ranks[0]["params"], ranks[1]["params"])):
        assert torch.equal(a, b), f"parameter {i} differs between the ranks"
    moved = 0
    for i, (got, want, start) in enumerate(zip(ranks[0]["params"], single["params"], initial)):
        update = want - start
        if update.norm() == 0:  # a bf16 copy of a master whose change is below its rounding (norm weights at 1.0)
            assert torch.equal(got, start), f"parameter {i} moved on the ranks but not in one process"
            continue
        moved += 1
        error = ((got - start) - update).norm() / update.norm()
        assert error < 0.05, f"parameter {i}: update differs from one process's by {error:.3f} (RMS, relative)"
    assert moved >= 0.75 * len(initial), f"only {moved} of {len(initial)} parameters moved; the comparison tests little"
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_fp8_scales_agree_across_ranks_and_with_one_process(runs):
    ranks, single = runs
    r0, r1, one = (_flat_states(s) for s in (ranks[0]["fp8"], ranks[1]["fp8"], single["fp8"]))
    assert r0.keys() == r1.keys() == one.keys() and r0
    for key in r0:  # fp8_group reduced every amax: the ranks' states are identical
        assert torch.equal(r0[key], r1[key]), key
    scales = [v for k, v in one.items() if k.endswith(".scale")]
    assert any((s != 1.0).any() for s in scales), "no scale was ever updated: FP8 did not run"
    for key in r0:  # the MAX over the ranks' amaxes is the one-process amax (up to bf16 rounding
        # of activations computed in a different batch layout). Gradients: each rank's loss is the
        # mean over its own half of the batch, so its output gradients are twice the one process's
        # (the engine averages the ranks' parameter gradients): amax x2, scale /2.
        want = one[key]
        if ".grad_output." in key:
            want = want / 2 if key.endswith(".scale") else want * 2
        assert_close(r0[key], want, rtol=0.05, atol=1e-5, name=key)
