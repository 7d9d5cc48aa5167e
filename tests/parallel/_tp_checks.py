"""Comparisons shared by the parallel tests: parameters against single-process training."""

from __future__ import annotations

import torch

from tests.utils import describe_mismatch

PARALLEL_REL = 1e-5
"""Issue 10's acceptance bound: after 5 optimizer steps every parameter of a parallel layout is
within 1e-5 of single-process training, relative to the tensor's largest magnitude (fp32; the
layouts differ from one process only in summation order: the tp partial sums, the dp
all-reduce, the micro-batch accumulation)."""

MIN_MOVE = 1e-2
"""Training must have moved the reference's parameters by at least this much overall (relative
norm), and changed every tensor, so a layout that does not train cannot pass."""


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30))


def assert_matches_reference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                             initial: dict[str, torch.Tensor], where: str) -> float:
    """Every reference parameter is in ``state`` with its shape and within PARALLEL_REL; returns
    the worst relative error."""
    missing = sorted(set(reference) - set(state))
    assert not missing, f"{where}: parameters missing from the parallel model: {missing}"
    moved = sum(float((reference[k] - initial[k]).double().norm() ** 2) for k in reference) ** 0.5
    size = sum(float(initial[k].double().norm() ** 2) for k in reference) ** 0.5
    assert moved > MIN_MOVE * size, f"{where}: the reference barely trained (moved {moved / size:.3g} of its norm)"
    worst = 0.0
    for key, expected in reference.items():
        actual = state[key]
        assert tuple(actual.shape) == tuple(expected.shape), f"{where}: {key} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        assert not torch.equal(expected, initial[key]), f"{where}: the reference did not change {key}"
        err = relative_error(actual, expected)
        scale = float(expected.abs().max())
        assert err <= PARALLEL_REL, (
            f"{where}: {key} relative error {err:.3g} > {PARALLEL_REL:g}\n"
            f"{describe_mismatch(actual, expected, 0.0, PARALLEL_REL * scale)}"
        )
        worst = max(worst, err)
    return worst


def gather_full_grads(model: torch.nn.Module, tp) -> dict[str, torch.Tensor]:
    """{name: gradient at the full (unsharded) shape} of a tensor-parallel model (a collective)."""
    import torch.distributed as dist

    from tachyon.parallel.tensor.shard import shard_spec, unshard_tensor

    out = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        spec = shard_spec(p)
        if spec is None:
            out[name] = grad.clone()
            continue
        shards = [torch.empty_like(grad) for _ in range(tp.size)]
        dist.all_gather(shards, grad.contiguous(), group=tp.group)
        out[name] = unshard_tensor(shards, spec)
    return out
