"""The hook 1-bit optimizers use: an optimizer whose ``in_compression_stage`` is True gets this
rank's own gradient (no data-parallel averaging at ZeRO stage 0; it communicates compressed
gradients itself); while False the engine averages as usual. ZeRO stages 1/2 refuse it (a rank
owns one partition of the masters and needs every rank's gradient for it). 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests.engine.zero_cases import batch, loss_fn, make_model
from tests.utils import assert_close, run_distributed

pytestmark = pytest.mark.distributed


class CompressingSGD(torch.optim.SGD):
    """SGD with lr 0 (the parameters never move, so every step sees the same model) that
    records the gradient the engine hands it."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.0)
        self.in_compression_stage = False
        self.seen: list[torch.Tensor] = []

    def step(self, closure=None):
        self.seen.append(torch.cat([p.grad.reshape(-1) for g in self.param_groups for p in g["params"]]).clone())
        return super().step(closure)


def _rank(stage: int) -> dict:
    import torch.distributed as dist

    import tachyon
    from tachyon.parallel import CommCounter

    rank = dist.get_rank()
    engine, optimizer, *_ = tachyon.initialize(
        model=make_model(), optimizer=CompressingSGD,
        config={"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}})
    x, y = batch(0, 0, rank, torch.float32)
    calls = {}
    for compressing in (False, True):
        optimizer.in_compression_stage = compressing
        try:
            with CommCounter() as comm:
                engine.backward(loss_fn(engine(x), y))
        except RuntimeError as error:
            return {"error": str(error)}
        engine.step()
        calls[compressing] = [(c.kind, c.payload) for c in comm.calls]
    return {"seen": optimizer.seen, "calls": calls, "padded": engine.zero.flat.numel}


def _both_stages() -> dict:
    return {stage: _rank(stage) for stage in (0, 1)}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_both_stages, 2, timeout=300)


def test_compression_stage_gets_this_ranks_own_gradient(ranks):
    results = [r[0] for r in ranks]
    (averaged0, local0), (averaged1, local1) = (r["seen"] for r in results)
    assert torch.equal(averaged0, averaged1), "outside the compression stage every rank gets the averaged gradient"
    assert not torch.equal(local0, local1), "in the compression stage each rank keeps its own gradient"
    assert_close((local0 + local1) / 2, averaged0, name="mean of the local gradients vs the averaged one")
    for result in results:
        assert result["calls"][False] == [("all_reduce", 4 * result["padded"])]
        assert result["calls"][True] == [], "no data-parallel reduction in the compression stage"


def test_compression_stage_is_refused_with_partitioned_masters(ranks):
    for result in (r[1] for r in ranks):
        assert "ZeRO stage 1 partitions the masters over the data-parallel ranks" in result["error"]
        assert "use zero_optimization.stage 0" in result["error"]
