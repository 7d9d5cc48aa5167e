"""ZeroOneAdam (0/1 Adam, DeepSpeed's ZeroOneAdam): the variance-update and local-step policies
with DeepSpeed's exponential intervals, the update itself, the refusals, and 2 gloo ranks
through ``initialize``: the engine averages gradients exactly at the variance-update steps,
the ranks drift apart during local steps and agree again at each synchronisation."""

from __future__ import annotations

import copy

import pytest
import torch

import tachyon
from tachyon.config import ConfigError
from tachyon.engine.optim import ZeroOneAdam
from tests.engine import _zero_one_ranks
from tests.utils import assert_close, run_distributed


def _param(seed: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(seed)))


def _grad(p: torch.nn.Parameter, step: int) -> None:
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + step))


def test_variance_updates_follow_deepspeeds_exponential_intervals():
    p = _param()
    opt = ZeroOneAdam([p], lr=0.01, var_freeze_step=20, var_update_scaler=2)
    averaged, variance_moved = [], []
    for step in range(1, 24):
        averaged.append(not opt.in_compression_stage)  # what the next step wants from the caller
        before = opt.state[p]["exp_avg_sq"].clone() if opt.state[p] else torch.zeros(4, 3)
        _grad(p, step)
        opt.step()
        variance_moved.append(not torch.equal(before, opt.state[p]["exp_avg_sq"]))
    # var_interval 1 for two updates, then 2 for two, then 4, 8 ...; frozen after step 21 > 20
    expected = [t in (1, 2, 4, 6, 8, 12, 16) for t in range(1, 24)]
    assert averaged[:21] == expected[:21] and averaged[21:] == [False, False]
    assert variance_moved == expected
    assert opt.freeze_key and opt.in_compression_stage


def test_first_step_is_adam_without_bias_correction_with_decoupled_decay():
    p = _param()
    p0 = p.detach().clone()
    opt = ZeroOneAdam([p], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    _grad(p, 1)
    g = p.grad.clone()
    opt.step()
    m, v = 0.2 * g, 0.1 * g * g
    assert_close(p.detach(), p0 - 0.1 * (m / (v.sqrt() + 1e-6) + 0.05 * p0), name="0/1 Adam first step")


def test_local_steps_double_up_to_the_clipper_and_sync_keeps_one_rank_exact():
    p = _param()
    opt = ZeroOneAdam([p], lr=0.01, var_freeze_step=1, var_update_scaler=1, local_step_scaler=2,
                      local_step_clipper=4)
    for step in range(1, 3):  # steps 1-2: variance updates; frozen from step 3
        _grad(p, step)
        opt.step()
    intervals, synced = [], []
    for step in range(3, 15):
        intervals.append(opt.state[p]["local_step_interval"])
        _grad(p, step)
        before = p.detach().clone()
        m_before = opt.state[p]["exp_avg"].clone()
        opt.step()
        synced.append(opt.state[p]["lrs"] == 0.0)
        if synced[-1]:  # on one rank the synchronisation restores this rank's own update exactly
            u_denom = opt.state[p]["exp_avg_sq"].sqrt() + 1e-8
            local = before - 0.01 * ((0.9 * m_before + 0.1 * p.grad) / u_denom)
            assert_close(p.detach(), local, name="one-rank synchronisation")
    assert intervals == [1, 1, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4]
    assert synced == [True, True, False, True, False, True, False, False, False, True, False, False]


def test_refusals_and_state_round_trip():
    with pytest.raises(ValueError, match="amsgrad"):
        ZeroOneAdam([_param()], amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        ZeroOneAdam([_param()], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="var_freeze_step must be an int >= 1"):
        ZeroOneAdam([_param()], var_freeze_step=0)
    with pytest.raises(ValueError, match="local_step_clipper"):
        ZeroOneAdam([_param()], local_step_clipper=0)
    params = tachyon.config.load_config({"train_batch_size": 2, "optimizer": {"type": "zerooneadam"}}).optimizer.params
    assert (params["var_freeze_step"], params["var_update_scaler"], params["local_step_scaler"],
            params["local_step_clipper"], params["bias_correction"]) == (100000, 16, 32678, 16, True)  # DeepSpeed's
    with pytest.raises(ConfigError, match="ZeroOneAdam.*stage: 1"):
        tachyon.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": {"stage": 1}})
    model = torch.nn.Linear(2, 2)  # a client ZeroOneAdam under ZeRO-1 is refused before anything is built
    weight, storage = model.weight, model.weight.data_ptr()
    with pytest.raises(ValueError, match="ZeroOneAdam with zero_optimization.stage 1"):
        tachyon.initialize(model=model, optimizer=ZeroOneAdam(model.parameters()),
                           config={"train_batch_size": 2, "zero_optimization": {"stage": 1}})
    assert model.weight is weight and model.weight.data_ptr() == storage  # not moved into a flat buffer
    a, b = _param(), _param()
    mask = torch.ones(4, 3)
    opt = ZeroOneAdam([{"params": [a], "exp_avg_mask": mask}], lr=0.01, var_freeze_step=2, local_step_scaler=1)
    for step in range(1, 6):
        _grad(a, step)
        opt.step()
    other = ZeroOneAdam([{"params": [b], "exp_avg_mask": mask * 0}], lr=0.01, var_freeze_step=2, local_step_scaler=1)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # as read back from a checkpoint
    b.data.copy_(a.detach())
    assert torch.equal(other.param_groups[0]["exp_avg_mask"], mask * 0)  # the script's mask is kept
    assert other.freeze_key and other.state[b]["local_step_interval"] == opt.state[a]["local_step_interval"]
    other.param_groups[0]["exp_avg_mask"] = mask
    for step in range(6, 9):
        _grad(a, step), _grad(b, step)
        opt.step(), other.step()
    assert torch.equal(a.detach(), b.detach())


@pytest.mark.distributed
def test_two_ranks_through_initialize():
    results = run_distributed(_zero_one_ranks.rank_main, 2, timeout=180)
    # var_update_scaler 1: variance updates at steps 1, 2, 4 (interval 1, 2, 4); frozen after step 5 > 4
    averaged = [step in (1, 2, 4) for step in range(1, 15)]
    # local_step_scaler 2, clipper 2: the interval is 1 at steps 6-7, then 2: synchronised at the
    # steps t with t % interval == 0 (DeepSpeed counts t from the start): 6, 7, 8, 10, 12, 14
    synced = [step <= 5 or step in (6, 7, 8, 10, 12, 14) for step in range(1, 15)]
    for out in results:
        assert out["averaged"] == averaged and out["frozen"]
        assert out["same"] == synced, out["same"]
        assert out["losses"][-1] < 0.5 * out["losses"][0]


def test_engine_checkpoint_mid_local_steps_resumes_exactly(tmp_path):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        config = {"train_batch_size": 2, "optimizer": {"type": "ZeroOneAdam", "params": {
            "lr": 0.01, "var_freeze_step": 2, "local_step_scaler": 1, "local_step_clipper": 4}}}
        return tachyon.initialize(model=model, config=config)[0]

    def run(engine, steps):
        for step in steps:
            torch.manual_seed(step)
            engine.backward(engine(torch.randn(2, 4)).square().mean())
            engine.step()

    first = make()
    run(first, range(5))  # frozen since step 3, the local-step interval has grown
    first.save_checkpoint(str(tmp_path), tag="mid")
    run(first, range(5, 9))
    second = make()
    second.load_checkpoint(str(tmp_path), tag="mid")
    assert second.optimizer.freeze_key and "sync_params" in next(iter(second.optimizer.state.values()))
    run(second, range(5, 9))
    for p, q in zip(first.module.parameters(), second.module.parameters()):
        assert torch.equal(p, q)
