"""The DeepSpeed LR schedules: values at given steps worked out by hand from DeepSpeed's formulas
(the numbers are written here, not computed with tachyon), resume via state_dict, edge cases."""

from __future__ import annotations

import pytest
import torch

from tachyon.config import load_config
from tachyon.engine.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler
from tachyon.engine.optim import FusedAdam


def _adam(lr=0.2, betas=(0.9, 0.95), groups=1):
    return FusedAdam([{"params": [torch.zeros(2, requires_grad=True)]} for _ in range(groups)], lr=lr, betas=betas)


def _lrs_at(sched, steps):
    """lr of group 0 after each step count in ``steps`` (step() called once per count)."""
    out, done = {}, 0
    for target in sorted(steps):
        while done < target:
            sched.step()
            done += 1
        out[target] = sched.optimizer.param_groups[0]["lr"]
    return [out[s] for s in steps]


def _check(actual, expected):
    assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15), f"{actual} != {expected}"


def test_warmup_lr_log():
    # W = 10: lr(i) = 0.1 * log(i + 1) / log(10); after construction i = -1 -> warmup_min_lr
    opt = _adam()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.0
    # steps 1, 2, 5, 10, 11, 50 -> i = 0, 1, 4, 9, 10, 49
    _check(_lrs_at(sched, [1, 2, 5, 10, 11, 50]), [0.0, 0.030102999566398, 0.069897000433602, 0.1, 0.1, 0.1])
    assert sched.get_last_lr() == [0.1]


def test_warmup_lr_linear_and_default_max():
    # warmup_max_lr=None takes the optimizer lr 0.2; linear: 0.02 + 0.18 * i / 10
    sched = WarmupLR(_adam(lr=0.2), warmup_min_lr=0.02, warmup_num_steps=10, warmup_type="linear")
    _check(_lrs_at(sched, [1, 4, 10, 11]), [0.02, 0.074, 0.182, 0.2])


@pytest.mark.parametrize("warmup_type,expected", [("log", [0.0, 0.1, 0.1]), ("linear", [0.0, 0.05, 0.1])])
def test_warmup_one_step_is_two(warmup_type, expected):
    # DeepSpeed floors warmup_num_steps at 2: log: i=1 -> log 2 / log 2 = 1; linear: 1/2
    sched = WarmupLR(_adam(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=1, warmup_type=warmup_type)
    _check(_lrs_at(sched, [1, 2, 3]), expected)


def test_per_group_lrs():
    opt = _adam(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.02], warmup_num_steps=10,
                     warmup_type="linear")
    for _ in range(6):
        sched.step()  # i = 5
    _check(sched.get_last_lr(), [0.05, 0.015])


def test_warmup_decay_lr():
    # W = 10, T = 20, linear warmup to 0.1, then 0.1 * (20 - i) / 10, 0 from i = 20 on
    sched = WarmupDecayLR(_adam(), total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.1,
                          warmup_num_steps=10, warmup_type="linear")
    _check(_lrs_at(sched, [6, 11, 16, 21, 26]), [0.05, 0.1, 0.05, 0.0, 0.0])


def test_warmup_decay_lr_returns_to_min_lr():
    sched = WarmupDecayLR(_adam(), total_num_steps=20, warmup_min_lr=0.01, warmup_max_lr=0.1,
                          warmup_num_steps=10, warmup_type="linear")
    _check(_lrs_at(sched, [16, 21, 40]), [0.055, 0.01, 0.01])


def test_warmup_decay_total_below_warmup_warns():
    with pytest.warns(UserWarning, match="less than warmup_num_steps"):
        WarmupDecayLR(_adam(), total_num_steps=5, warmup_num_steps=10)


def test_warmup_cosine_lr():
    # base lr 0.2, r0 = 0.1, W = 10, T = 20, c = 0.01, linear warmup:
    # i=0: 0.1 -> 0.02; i=5: 0.1 + 0.5 * 0.9 = 0.55 -> 0.11
    # i=10: progress 1/10, (1 + cos(0.1 pi)) / 2 = 0.9755282581475768 -> 0.01 + 0.99 * that
    #       = 0.9757729755661010 -> 0.1951545951132202
    # i=14: progress 1/2 -> 0.505 -> 0.101; i=19: progress 1 -> 0.01 -> 0.002; past T: stays 0.002
    opt = _adam(lr=0.2)
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=10,
                           cos_min_ratio=0.01, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0
    _check(_lrs_at(sched, [1, 6, 11, 15, 20, 31]), [0.02, 0.11, 0.1951545951132202, 0.101, 0.002, 0.002])


def test_one_cycle_lr_and_momentum():
    # total = 8, step ratio 0.5; b = i + 1, x = b / 8 within the cycle
    opt = _adam(betas=(0.9, 0.95))
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.5, cycle_first_step_size=4,
                     decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.1)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.95)
    expected = {
        1: (0.0325, 0.875),  # i=0: x=1/8, scale 0.25
        4: (0.1, 0.8),  # i=3: x=0.5, scale 1 (the peak)
        6: (0.055, 0.85),  # i=5: x=0.75, scale (0.75-1)/(0.5-1) = 0.5
        8: (0.01, 0.9),  # i=7: b=8 starts cycle 2, x=0
        9: (0.008, 0.945),  # i=8: decay, d=1, interval 0.5: 0.01/1.25, 0.9*1.05
        10: (0.01 / 1.5, 0.99),  # i=9: d=2, interval 1: 0.01/1.5, 0.9*1.1
    }
    for step, (lr, mom) in expected.items():
        while sched.last_batch_iteration + 1 < step:
            sched.step()
        _check(opt.param_groups[0]["lr"], lr)
        _check(opt.param_groups[0]["betas"][0], mom)
        assert opt.param_groups[0]["betas"][1] == 0.95


def test_one_cycle_stairs_and_no_decay():
    # 2 stairs per half: scale = floor(position * 2 / 4) / 2; no decay after the cycle
    sched = OneCycle(_adam(), cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                     cycle_first_stair_count=2)
    _check(_lrs_at(sched, [1, 2, 4, 5, 9, 20]), [0.01, 0.055, 0.1, 0.055, 0.01, 0.01])


def test_one_cycle_without_betas_does_not_cycle_momentum():
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.5)
    with pytest.warns(UserWarning, match="no betas"):
        sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    sched.step()
    assert opt.param_groups[0]["momentum"] == 0.5 and sched.get_mom() is None


@pytest.mark.parametrize("make", [
    lambda o: WarmupLR(o, warmup_max_lr=0.1, warmup_num_steps=10),
    lambda o: WarmupDecayLR(o, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10),
    lambda o: WarmupCosineLR(o, total_num_steps=20, warmup_num_steps=5),
    lambda o: OneCycle(o, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4),
], ids=["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"])
def test_state_dict_resume(make):
    """A fresh schedule that loads the state dict continues exactly where the first one was."""
    opt = _adam(lr=0.2)
    sched = make(opt)
    for _ in range(7):
        sched.step()
    state = sched.state_dict()
    opt2 = _adam(lr=0.2)
    resumed = make(opt2)
    resumed.load_state_dict(state)
    for _ in range(6):
        sched.step()
        resumed.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    assert resumed.state_dict() == sched.state_dict()


def test_cosine_resume_keeps_base_lr_from_state():
    opt = _adam(lr=0.2)
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=5)
    for _ in range(7):
        sched.step()
    # resume onto an optimizer whose lr was already scheduled (as a restored checkpoint has it)
    resumed = WarmupCosineLR(_adam(lr=opt.param_groups[0]["lr"]), total_num_steps=20, warmup_num_steps=5)
    resumed.load_state_dict(sched.state_dict())
    sched.step()
    resumed.step()
    assert resumed.get_last_lr() == sched.get_last_lr()


def test_get_last_lr_before_any_lr_raises():
    sched = WarmupLR(_adam(), last_batch_iteration=5)
    with pytest.raises(RuntimeError, match="call step"):
        sched.get_last_lr()


@pytest.mark.parametrize("make,match", [
    (lambda o: WarmupLR(o, warmup_type="cosine"), "warmup_type='cosine'"),
    (lambda o: WarmupLR(o, warmup_num_steps=-1), "warmup_num_steps must be an int >= 1"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.1]), "warmup_min_lr has 2 values"),
    (lambda o: WarmupDecayLR(o, total_num_steps=0), "total_num_steps must be an int >= 1"),
    (lambda o: WarmupCosineLR(o, total_num_steps=10, cos_min_ratio=2.0), "cos_min_ratio"),
    (lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=0), "cycle_first_step_size"),
    (lambda o: WarmupLR(o, last_batch_iteration=-2), "last_batch_iteration"),
])
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make(_adam())


@pytest.mark.parametrize("section,cls,lr_after_one_step", [
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}},
     WarmupLR, 0.0),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_min_lr": 0.01, "warmup_num_steps": 10}},
     WarmupDecayLR, 0.01),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_min_ratio": 0.5, "warmup_num_steps": 10}},
     WarmupCosineLR, 0.1),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}},
     OneCycle, 0.0325),
])
def test_build_scheduler_from_config(section, cls, lr_after_one_step):
    config = load_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.2}},
                          "scheduler": section})
    opt = _adam(lr=0.2)
    sched = build_scheduler(config.scheduler, opt)
    assert type(sched) is cls
    sched.step()
    _check(opt.param_groups[0]["lr"], lr_after_one_step)


def test_build_scheduler_rejects():
    with pytest.raises(ValueError, match="scheduler.type='LRFinder'"):
        build_scheduler({"type": "LRFinder", "params": {}}, _adam())
    with pytest.raises(ValueError, match="scheduler.params.warmup_ratio is not a parameter of WarmupLR"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_ratio": 0.1}}, _adam())


# ---------------------------------------------------------------- DeepSpeed's exact numerics


def test_warmup_lr_without_max_warms_each_group_to_its_own_lr():
    opt = FusedAdam([{"params": [torch.zeros(2, requires_grad=True)], "lr": 0.1},
                     {"params": [torch.zeros(2, requires_grad=True)], "lr": 0.02}])
    sched = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    sched.step()
    sched.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.02]


def test_warmup_lr_from_the_config_warms_each_group_to_its_own_lr():
    """Through tachyon.initialize: the config's WarmupLR without warmup_max_lr (DeepSpeed's None)."""
    import tachyon

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.02}]
    config = {"train_batch_size": 1, "scheduler": {"type": "WarmupLR",
                                                   "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}}
    engine, *_ = tachyon.initialize(model=model, model_parameters=groups, config=config,
                                    optimizer=lambda g: torch.optim.SGD(g, lr=0.5))
    for _ in range(3):
        engine.lr_scheduler.step()
    assert engine.get_lr() == [0.1, 0.02]


def test_log_warmup_is_bit_identical_to_deepspeeds_expression():
    """DeepSpeed: inverse_log_warm_up * log(i + 1) with inverse_log_warm_up = 1 / log(W)."""
    import math

    opt = _adam(lr=0.5)
    sched = WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.37, warmup_num_steps=1000)
    inverse = 1.0 / math.log(1000)
    for i in range(0, 999, 7):
        sched.step(i)
        assert opt.param_groups[0]["lr"] == 0.001 + (0.37 - 0.001) * (inverse * math.log(i + 1)), i


def test_tensor_lrs_stay_tensors_filled_in_place():
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=lr)
    for sched in (WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=4),
                  WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2),
                  OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_momentum=False)):
        sched.step()
        assert opt.param_groups[0]["lr"] is lr and torch.is_tensor(sched.get_last_lr()[0])
    assert 0 < float(lr) < 0.1


def test_lr_range_test_values():
    from tachyon.engine.lr_schedules import LRRangeTest

    opt = _adam()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
    assert opt.param_groups[0]["lr"] == 0.01
    _check(_lrs_at(sched, [1, 3, 4]), [0.01 * (1 + 2.0 * 1 / 4), 0.01 * (1 + 2.0 * 3 / 4), 0.01 * (1 + 2.0)])
    stairs = LRRangeTest(_adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_staircase=True)
    _check(_lrs_at(stairs, [1, 3, 4, 8]), [0.01, 0.01, 0.02, 0.03])
    built = build_scheduler({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.5}}, _adam())
    assert isinstance(built, LRRangeTest) and built.optimizer.param_groups[0]["lr"] == 0.5
