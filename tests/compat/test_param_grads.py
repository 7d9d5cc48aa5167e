"""``param.grad`` after ``engine.backward`` and before ``engine.step()``, as in DeepSpeed: without
ZeRO it holds the (averaged) gradient and what a script writes there is what the step uses; at
ZeRO stages 1/2 it is None and ``deepspeed.utils.safe_get_full_grad`` / ``safe_set_full_grad``
read and write the partitioned gradient."""

from __future__ import annotations

import warnings

import pytest
import torch

import tachyon.compat.deepspeed as deepspeed
from tachyon.compat.deepspeed.utils import RepeatingLoader, safe_get_full_grad, safe_set_full_grad
from tests.compat import _grad_ranks
from tests.utils import assert_close, run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")


def make(stage=0, gas=1, precision=None, accum=None, lr=0.1):
    net = _grad_ranks.model()
    config = {"train_batch_size": 2 * gas, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": lr}}}
    if precision:
        config[precision] = {"enabled": True}
    if accum:
        config["data_types"] = {"grad_accum_dtype": accum}
    engine, *_ = deepspeed.initialize(model=net, config=config)
    return engine, net


def loss_of(engine, rows=slice(0, 2), dtype=torch.float32):
    x, y = _grad_ranks.data()
    return torch.nn.functional.mse_loss(engine(x[rows].to(dtype)).float(), y[rows])


def test_stage0_param_grad_holds_the_gradient_and_accumulates_in_place():
    engine, net = make(gas=2)
    engine.backward(loss_of(engine, slice(0, 2)))
    first = [p.grad.clone() for p in net.parameters()]
    grad_object = net[0].weight.grad
    engine.backward(loss_of(engine, slice(2, 4)))
    assert net[0].weight.grad is grad_object, "the second micro-step accumulated into the same tensor"
    reference = _grad_ranks.reference_grads()  # mean over the 4 rows = (mean of 0:2 + mean of 2:4) / 2
    for p, ref in zip(net.parameters(), reference):
        assert_close(p.grad, ref, dtype=torch.float32)
    assert not torch.equal(first[0], net[0].weight.grad)


def test_stage0_gradients_written_before_step_are_used():
    engine, net = make(lr=0.1)
    engine.backward(loss_of(engine))
    before = [p.detach().clone() for p in net.parameters()]
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)  # in place, as scripts clip
    clipped = [p.grad.clone() for p in net.parameters()]
    net[2].bias.grad = torch.full_like(net[2].bias, 2.0)  # a new tensor replaces the gradient
    clipped[-1] = torch.full_like(net[2].bias, 2.0)
    engine.step()
    for b, p, g in zip(before, net.parameters(), clipped):
        assert_close(p.detach(), b - 0.1 * g, dtype=torch.float32)
    assert all(p.grad is None for p in net.parameters()), "the step clears the gradients"


def test_stage0_a_gradient_set_to_none_counts_as_zero_and_warns():
    engine, net = make()
    engine.backward(loss_of(engine))
    before = net[0].bias.detach().clone()
    net[0].bias.grad = None
    with pytest.warns(UserWarning, match="set to None between backward and step"):
        engine.step()
    assert torch.equal(before, net[0].bias.detach())


def test_stage0_bf16_exposes_bf16_views_and_fp32_accumulation_does_not():
    engine, net = make(precision="bf16")
    engine.backward(loss_of(engine, dtype=torch.bfloat16))
    assert net[0].weight.grad.dtype == torch.bfloat16
    engine.step()
    assert net[0].weight.grad is None
    engine, net = make(precision="bf16", accum="fp32")
    engine.backward(loss_of(engine, dtype=torch.bfloat16))
    assert net[0].weight.grad is None, "a bf16 param.grad cannot view an fp32 accumulator"
    full = safe_get_full_grad(net[0].weight)
    assert full.dtype == torch.float32 and full.shape == net[0].weight.shape and full.abs().sum() > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_hide_param_grad_and_warn_when_it_is_written(stage):
    engine, net = make(stage=stage)
    engine.backward(loss_of(engine))
    assert all(p.grad is None for p in net.parameters()), "as DeepSpeed's ZeRO-1/2 after the reducing backward"
    reference = _grad_ranks.model()
    x, y = _grad_ranks.data()
    torch.nn.functional.mse_loss(reference(x[:2]), y[:2]).backward()
    for p, ref in zip(net.parameters(), reference.parameters()):
        assert_close(safe_get_full_grad(p), ref.grad, dtype=torch.float32)
    net[0].weight.grad = torch.zeros_like(net[0].weight)
    with pytest.warns(UserWarning, match="safe_set_full_grad"):
        engine.step()


def test_stage1_param_grad_is_there_between_boundaries():
    engine, net = make(stage=1, gas=2)
    engine.backward(loss_of(engine))
    assert net[0].weight.grad is not None and safe_get_full_grad(net[0].weight) is net[0].weight.grad
    engine.step()
    engine.backward(loss_of(engine, slice(2, 4)))
    assert net[0].weight.grad is None


def test_safe_set_full_grad_writes_what_the_step_uses_at_stage_2():
    engine, net = make(stage=2, lr=1.0)
    engine.backward(loss_of(engine))
    before = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        safe_set_full_grad(p, torch.ones_like(p))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.step()
    for b, p in zip(before, net.parameters()):
        assert_close(p.detach(), b - 1.0, dtype=torch.float32)


def test_repeating_loader_restarts_and_reshuffles():
    data = torch.utils.data.TensorDataset(torch.arange(4.0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1)
    loader = RepeatingLoader(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler))
    epochs = [next(loader)[0].tolist() for _ in range(3)]
    assert all(sorted(e) == [0, 1, 2, 3] for e in epochs) and len({tuple(e) for e in epochs}) > 1
    assert loader.epoch == 2 and sampler.epoch == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_on_two_ranks_param_grad_is_averaged_and_safe_helpers_gather_the_partitions():
    """Stage 0: param.grad is the average over the ranks; stages 1/2: safe_get_full_grad gathers it
    (collective), safe_set_full_grad's value is what the step applies, and the optimizer state
    reads back whole."""
    results = run_distributed(_grad_ranks.rank_main, 2, (0, 1, 2), timeout=120)
    reference = _grad_ranks.reference_grads()
    for rank, out in enumerate(results):
        for stage, got in out.items():
            if stage == 0:
                for g, ref in zip(got["param_grads"], reference):
                    assert_close(g, ref, dtype=torch.float32)
            else:
                assert all(g is None for g in got["param_grads"]), (rank, stage)
            for g, ref in zip(got["full_grads"], reference):
                assert_close(g, ref, dtype=torch.float32)
            assert got["applied"]
            for moved, momentum, ref in zip(got["moved"], got["momentum"], reference):
                assert_close(moved, 0.5 * 0.5 * ref, dtype=torch.float32)  # lr 0.5 x the halved gradient
                assert_close(momentum, 0.5 * ref, dtype=torch.float32)  # SGD's first momentum buffer is the gradient
            assert all(g is None for g in got["after_step"])
