"""ZeRO stages 0/1/2 on 2 and 4 gloo ranks against single-process plain-PyTorch training.

One launch per world size runs every configuration (spawning ranks costs seconds): fp32 and
bf16 (bf16 and fp32 gradient accumulation, bf16 and fp32 communication), gradient accumulation 1
and 4, clipping on and off, one and two param groups, bucketed reductions overlapped or not,
DeepSpeed's default bucket keys, torch AdamW, tachyon's FusedAdam and LAMB from the config; then
fp16 and bf16 memory measurements with the default config (every live tensor storage of the
process, and `memory_breakdown`), the fp16 overflow scenario, and the bytes every
torch.distributed collective moves in one step. The tests below only read the results.
"""

from __future__ import annotations

import pytest
import torch

from tachyon.engine.zero import model_state_bytes
from tests.engine.zero_cases import (
    DTYPES,
    FP16_SCALE_POWER,
    Case,
    as_tensors,
    rank_main,
    reference_train,
)
from tests.utils import assert_close, run_distributed, tolerance

pytestmark = pytest.mark.distributed

FP32_WIRE = (("communication_data_type", "fp32"),)
EQUIVALENCE = [
    # bf16 here with fp32 accumulation and fp32 reductions: compared element by element
    Case(stage=stage, precision=precision, gas=gas, clip=clip, overlap=overlap, groups=groups,
         accum="fp32" if precision == "bf16" else None, extra=FP32_WIRE if precision == "bf16" else ())
    for stage in (0, 1, 2)
    for precision in ("fp32", "bf16")
    for gas, clip, overlap, groups in ((1, 0.0, True, False), (4, 0.5, False, True))
] + [
    Case(stage=2, optimizer="config-adam", gas=2, clip=0.5, groups=True),
    Case(stage=1, optimizer="config-lamb", groups=True),
    Case(stage=2, optimizer="config-lamb", precision="bf16", gas=2, clip=0.5, accum="fp32", extra=FP32_WIRE),
    # averaging variants: divide before the reduction, or split between before and after
    Case(stage=2, gas=2, extra=(("prescale_gradients", True),)),
    Case(stage=1, extra=(("gradient_predivide_factor", 2.0),)),
    Case(stage=2, bucket=None, groups=True),  # DeepSpeed's default bucket keys: one bucket per group
] + [
    # bf16 reductions (DeepSpeed's defaults, and fp32 accumulation reduced in bf16): compared
    # tensor by tensor, relative to the tensor's norm (a sum rounded to bf16 can cancel to ~0)
    Case(stage=stage, precision="bf16", gas=gas, clip=0.5 * (gas > 1), groups=gas > 1, bucket=bucket, steps=10)
    for stage, gas, bucket in ((0, 1, 40), (1, 1, 40), (2, 1, 40), (1, 4, None), (2, 4, None))
] + [Case(stage=1, precision="bf16", gas=4, accum="fp32", groups=True, steps=10)]
# DeepSpeed's default config (no bucket keys); bf16 also with fp32 accumulation. Every live
# storage is counted (a few tenths of a second per count) for bf16's defaults and for fp32
# accumulation at stage 0; the rest check memory_breakdown only.
MEMORY = [Case(stage=s, precision=p, accum=a, steps=2, bucket=None, hidden=256,
               live=(p, a) == ("bf16", None) or (a, s) == ("fp32", 0))
          for p, a in (("fp16", None), ("bf16", None), ("bf16", "fp32")) for s in (0, 1, 2)]
COMM = [
    Case(stage=0, precision="bf16", steps=2, bucket=64),
    Case(stage=1, precision="bf16", gas=2, steps=2, bucket=64),
    Case(stage=1, precision="bf16", gas=2, steps=2, bucket=64, accum="fp32"),
    Case(stage=2, precision="bf16", gas=2, steps=2, bucket=64, overlap=False),
    Case(stage=2, precision="bf16", steps=2, bucket=64, extra=(("communication_data_type", "fp32"),)),
    Case(stage=2, steps=2, bucket=None),
    Case(stage=1, precision="fp16", steps=2, bucket=None, hidden=64),
]
OVERFLOW_STAGES = [0, 2]
INJECT = [False, True, True, False, False, False, False]
"""Overflow on steps 1 and 2: with hysteresis 2 the first only spends hysteresis, the second
halves the scale; the window (3) then doubles it after 3 clean steps."""

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


# 4 ranks (uneven partition boundaries over more ranks) in the slow run: the default suite keeps 2;
# 4-rank partitions are also loaded in tests/engine/test_checkpoint_distributed.py's reshard test
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"])
def world(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the references run here, beside nothing else
    results = run_distributed(rank_main, request.param, EQUIVALENCE + MEMORY, OVERFLOW_STAGES, INJECT, COMM,
                              timeout=400)
    yield request.param, results
    torch.set_num_threads(threads)


def _bf16_wire(case: Case) -> bool:
    return case.precision != "fp32" and dict(case.extra).get("communication_data_type", case.precision) != "fp32"


@pytest.mark.parametrize("case", EQUIVALENCE, ids=lambda c: c.name)
def test_matches_single_process_training(world, case):
    world_size, results = world
    reference = reference_train(case, world_size)
    bf16_rtol, _ = tolerance(torch.bfloat16)
    for rank, result in enumerate(results):
        got = result["cases"][case.name]
        assert got["global_steps"] == case.steps and got["micro_steps"] == case.steps * case.gas
        for i, (actual, expected) in enumerate(zip(as_tensors(got["params"]), reference["params"])):
            name = f"{case.name} on {world_size} ranks, rank {rank}, parameter {i}"
            if case.precision == "fp32":
                assert_close(actual, expected, rtol=FP32_RTOL, atol=FP32_ATOL, name=name)
            elif not _bf16_wire(case):
                assert_close(actual, expected, dtype=torch.bfloat16, name=name)
            else:
                error = float((actual - expected).norm() / expected.norm())
                assert error <= bf16_rtol, f"{name}: relative error {error:.3g} > {bf16_rtol} (norm-wise)"
        # the norm is global: every rank reports the same value, the single-process one
        rtol = bf16_rtol if _bf16_wire(case) else 1e-5
        assert_close(torch.tensor(got["norms"]), torch.tensor(reference["norms"]), rtol=rtol, atol=1e-6,
                     name=f"{case.name}: grad norms on rank {rank}")
    if case.clip:
        assert max(reference["norms"]) > case.clip, "clipping never engaged; the case tests nothing"


def _formula(case: Case, padded: int, world_size: int, gradient_bytes: int | None = None) -> float:
    """`model_state_bytes` for ``case`` over the padded flat size (each rank holds the padding
    too) plus Adam's 4-byte step tensor; ``gradient_bytes``: override the gradient term."""
    accum = DTYPES[case.accum] if case.accum else DTYPES[case.precision]  # bf16 and fp16 accumulate in their own dtype
    out = model_state_bytes(padded, world_size, case.stage, param_bytes=2, grad_accum_bytes=accum.itemsize)
    total = out["model_states"] + 4
    if gradient_bytes is not None:
        total += gradient_bytes - out["gradients"]
    return total


SMALL_TENSORS = 2048
"""Live bytes beyond the model states that a step may hold: LAMB segments, Adam's step tensor,
the batch and the loss (measured: well under 1 KiB)."""


@pytest.mark.parametrize("case", MEMORY, ids=lambda c: c.name)
def test_default_config_memory_matches_the_formulas(world, case):
    """DeepSpeed's default config: the engine's own breakdown after the boundary backward is the
    formula to the byte; every live tensor storage of the process, after backward, inside the
    optimizer step (fp32 master gradients replace the accumulator) and after the step (no
    gradients), is the formula plus a few small tensors. No bucket buffer outlives backward,
    and at stages 1/2 no gradient larger than the partition exists."""
    world_size, results = world
    for rank, result in enumerate(results):
        got = result["cases"][case.name]
        memory, live, padded = got["memory"], got["live"], got["padded"]
        shard = padded if case.stage == 0 else padded / world_size
        where = f"{case.name} rank {rank}/{world_size} (padded Psi {padded})"
        expected = _formula(case, padded, world_size)
        assert memory["model_states"] == expected and memory["buckets"] == 0, f"{where}: {memory} vs {expected}"
        if not case.live:
            continue
        checks = {
            "after backward": expected,
            "in step": _formula(case, padded, world_size, gradient_bytes=4 * shard),
            "after step": _formula(case, padded, world_size, gradient_bytes=0),
        }
        for point, formula in checks.items():
            assert formula <= live[point] <= formula + SMALL_TENSORS, (
                f"{where}: {live[point]} live bytes {point}, formula {formula:.0f} (+ at most {SMALL_TENSORS}); "
                f"all points {live}"
            )


@pytest.mark.parametrize("case", COMM, ids=lambda c: c.name)
def test_bytes_on_the_wire_are_the_zero_formulas(world, case):
    """Every torch.distributed call of one step, wrapped: stage 0 all-reduces the padded
    gradient once (2 Psi on a ring); stages 1/2 reduce-scatter it once per reduction (one
    reduce_scatter per bucket, Psi in the reduction dtype) and all-gather the parameters once
    (one all_gather per bucket, Psi in the model dtype): 2 Psi per step, the ZeRO paper's
    volume. Stage 2 reduces every micro-step, stage 1 only at the boundary (unless it
    accumulates in a wider dtype). Nothing else but 1-element all-reduces (norm, overflow)."""
    world_size, results = world
    model_bytes = DTYPES[case.precision].itemsize
    comm_dtype = dict(case.extra).get("communication_data_type", case.precision)
    comm_bytes = DTYPES[comm_dtype].itemsize
    accum_bytes = DTYPES[case.accum].itemsize if case.accum else model_bytes
    reductions = case.gas if case.stage == 2 or accum_bytes > model_bytes else 1
    for rank, result in enumerate(results):
        got = result["comm"][case.name]
        padded, buckets, calls = got["padded"], got["buckets"], got["calls"]
        if case.bucket is None:
            assert buckets == got["groups"], f"default bucket size: one bucket per param group, got {buckets}"
        big = [c for c in calls if c[2] > 8]
        small = [c for c in calls if c[2] <= 8]
        by_op: dict[str, list] = {}
        for name, dtype, nbytes in big:
            by_op.setdefault(name, []).append((dtype, nbytes))
        where = f"{case.name} rank {rank}/{world_size}: calls {big}"
        if case.stage == 0:
            assert set(by_op) == {"all_reduce"}, where
            assert len(by_op["all_reduce"]) == buckets and sum(b for _, b in by_op["all_reduce"]) == padded * comm_bytes, where
        else:
            scatter = by_op.pop("reduce_scatter_single", []) + by_op.pop("reduce_scatter_tensor", [])
            gather = by_op.pop("all_gather_single", []) + by_op.pop("all_gather_into_tensor", [])
            assert not by_op, f"{where}: unexpected collectives {sorted(by_op)}"
            assert len(scatter) == buckets * reductions, where
            assert sum(b for _, b in scatter) == padded * comm_bytes * reductions, where
            assert len(gather) == buckets and sum(b for _, b in gather) == padded * model_bytes, where
            if reductions == 1 and comm_bytes == model_bytes:
                assert sum(b for _, b in scatter + gather) == 2 * padded * model_bytes  # ZeRO: 2 Psi
        assert all(name == "all_reduce" for name, _, _ in small) and len(small) <= 3, f"{where}; small {small}"


@pytest.mark.parametrize("stage", OVERFLOW_STAGES)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world, stage):
    world_size, results = world
    scale = 2.0**FP16_SCALE_POWER
    for rank, result in enumerate(results):
        got = result["overflow"][stage]
        expected = [scale, scale, scale / 2, scale / 2, scale / 2, scale / 2, scale] if stage else \
            [scale, scale / 2, scale / 4, scale / 4, scale / 4, scale / 4, scale / 2]  # no ZeRO: no hysteresis (DeepSpeed)
        assert got["scales"] == expected, (rank, got)
        assert got["unchanged"][1] and got["unchanged"][2], f"rank {rank}: a skipped step changed state: {got}"
        assert not any(got["unchanged"][3:]), f"rank {rank}: clean steps did not update: {got}"
        assert got["skipped_steps"] == 2 and got["global_steps"] == len(INJECT)
        assert got["finite"]
