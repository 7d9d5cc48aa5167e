"""The optimizer and scheduler sections: type matching, per-type params, DeepSpeed defaults."""

from __future__ import annotations

import re

import pytest

from tachyon.config import OPTIMIZER_PARAMS, SCHEDULER_PARAMS, ConfigError, load_config


def load(optimizer=None, scheduler=None):
    config = {"train_batch_size": 8}
    if optimizer is not None:
        config["optimizer"] = optimizer
    if scheduler is not None:
        config["scheduler"] = scheduler
    return load_config(config)


def raises(pattern: str):
    return pytest.raises(ConfigError, match=re.escape(pattern))


# ---------------------------------------------------------------- optimizer


@pytest.mark.parametrize(
    "given, canonical", [("adam", "Adam"), ("ADAMW", "AdamW"), ("Lamb", "Lamb"), ("sgd", "SGD")]
)
def test_optimizer_type_is_case_insensitive_and_canonical(given, canonical):
    assert load({"type": given}).optimizer.type == canonical


def test_optimizer_defaults_match_deepspeed():
    adam = load({"type": "Adam"}).optimizer.params
    assert adam == {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
        "torch_adam": False, "adam_w_mode": True, "bias_correction": True,
    }  # fmt: skip
    lamb = load({"type": "Lamb"}).optimizer.params
    assert lamb == {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 10.0,
        "min_coeff": 0.01, "bias_correction": True,
    }  # fmt: skip
    sgd = load({"type": "SGD"}).optimizer.params
    assert sgd == {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}


def test_adam_w_mode_semantics():
    # DeepSpeed: "Adam" decouples weight decay unless adam_w_mode is false; "AdamW" always does.
    assert load({"type": "Adam"}).optimizer.params["adam_w_mode"] is True
    assert load({"type": "Adam", "params": {"adam_w_mode": False}}).optimizer.params["adam_w_mode"] is False
    assert load({"type": "AdamW"}).optimizer.params["adam_w_mode"] is True
    # DeepSpeed: AdamW decouples whatever adam_w_mode says; the false is accepted and reported
    config = load({"type": "AdamW", "params": {"adam_w_mode": False}})
    assert config.optimizer.params["adam_w_mode"] is True
    assert config.ignored_keys == ("optimizer.params.adam_w_mode",)


def test_params_null_means_defaults():
    assert load({"type": "SGD", "params": None}).optimizer.params["lr"] == 1e-3


@pytest.mark.parametrize("name", ["Adagrad", "Lion", "Muon"])
def test_unsupported_optimizers(name):
    with raises(f'`optimizer.type: "{name}"` is a DeepSpeed feature tachyon does not support yet'):
        load({"type": name})


@pytest.mark.parametrize(
    "name, guess", [("Adamm", "Adam"), ("adam_w", "AdamW"), ("LAMB2", "Lamb"), ("sdg", "SGD")]
)
def test_unknown_optimizer_did_you_mean(name, guess):
    with raises(f'`optimizer.type` "{name}" is not known; did you mean "{guess}"?'):
        load({"type": name})


def test_optimizer_type_required_and_a_string():
    with raises("`optimizer.type` is required (one of Adam, AdamW, Lamb, SGD, OneBitAdam, OneBitLamb, ZeroOneAdam)"):
        load({"params": {"lr": 1e-3}})
    with raises("`optimizer.type` should be a string"):
        load({"type": 3})


def test_amsgrad_true_is_refused():
    with raises("`optimizer.params.amsgrad: true` is a DeepSpeed feature tachyon does not support yet (AMSGrad)"):
        load({"type": "AdamW", "params": {"amsgrad": True}})
    assert load({"type": "Adam", "params": {"amsgrad": False}}).optimizer.params["amsgrad"] is False


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lr": "0.1"}, '`optimizer.params.lr` should be a valid number; got "0.1" (str)'),
        ({"lr": -1}, "`optimizer.params.lr` should be greater than or equal to 0"),
        ({"betas": [0.9]}, "`optimizer.params.betas` should be a pair [beta1, beta2]; got [0.9]"),
        ({"betas": [0.9, 1.5]}, "`optimizer.params.betas.1` should be less than 1"),
        ({"torch_adam": "yes"}, "`optimizer.params.torch_adam` should be a valid boolean"),
        ({"lr": "auto"}, "Hugging Face Trainer integration"),
    ],
)
def test_optimizer_param_types(params, message):
    with raises(message):
        load({"type": "Adam", "params": params})


def test_params_belong_to_the_type():
    with raises("unknown key 'optimizer.params.momentum'"):
        load({"type": "Adam", "params": {"momentum": 0.9}})
    with raises("unknown key 'optimizer.params.amsgrad'"):
        load({"type": "Lamb", "params": {"amsgrad": False}})


def test_sgd_nesterov_needs_momentum_and_no_dampening():
    with raises("`optimizer.params.nesterov: true` needs `optimizer.params.momentum` > 0"):
        load({"type": "SGD", "params": {"nesterov": True}})
    ok = load({"type": "SGD", "params": {"nesterov": True, "momentum": 0.9}})
    assert ok.optimizer.params["nesterov"] is True


def test_lamb_coeff_order():
    with raises("`optimizer.params.min_coeff` (1.0) must not exceed `optimizer.params.max_coeff` (0.5)"):
        load({"type": "Lamb", "params": {"min_coeff": 1.0, "max_coeff": 0.5}})


def test_registries_cover_the_canonical_names():
    assert set(OPTIMIZER_PARAMS) == {"Adam", "AdamW", "Lamb", "SGD", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"}
    assert set(SCHEDULER_PARAMS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}


# ---------------------------------------------------------------- scheduler


def test_scheduler_defaults_match_deepspeed():
    warmup = load(scheduler={"type": "WarmupLR"}).scheduler.params
    assert warmup == {
        "last_batch_iteration": -1, "warmup_min_lr": 0.0, "warmup_max_lr": None,
        "warmup_num_steps": 1000, "warmup_type": "log",
    }  # fmt: skip  (warmup_max_lr None: each param group warms up to its own lr, as DeepSpeed's WarmupLR)
    decay = load(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}).scheduler
    assert decay.params == {**warmup, "warmup_max_lr": 0.001, "total_num_steps": 10}
    assert load(scheduler={"type": "LRRangeTest"}).scheduler.params == {
        "last_batch_iteration": -1, "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False,
    }  # fmt: skip
    cosine = load(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}).scheduler
    assert cosine.params == {
        "last_batch_iteration": -1, "total_num_steps": 10, "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "warmup_type": "log",
    }  # fmt: skip
    one_cycle = load(scheduler={"type": "OneCycle",
                                "params": {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1}}).scheduler
    assert one_cycle.params == {
        "last_batch_iteration": -1, "cycle_min_lr": 0.0, "cycle_max_lr": 0.1,
        "decay_lr_rate": 0.0, "cycle_first_step_size": 2000, "cycle_second_step_size": None,
        "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
        "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    "scheduler, message",
    [
        ({"type": "WarmupDecayLR"}, "`scheduler.params.total_num_steps` is required"),
        ({"type": "WarmupCosineLR", "params": {}}, "`scheduler.params.total_num_steps` is required"),
        ({"type": "OneCycle"}, "`scheduler.params.cycle_min_lr` is required"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
         "`scheduler.params.warmup_type` should be 'log' or 'linear'"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}},
         "`scheduler.params.warmup_num_steps` should be a valid integer"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}},
         "`scheduler.params.cos_min_ratio` should be less than or equal to 1"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 1.0, "cycle_max_lr": 0.1}},
         "`scheduler.params.cycle_min_lr` (1.0) must not exceed `scheduler.params.cycle_max_lr` (0.1)"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
         "`scheduler.params.warmup_num_steps` should be greater than 0"),
        ({"type": "WarmupCosine"}, '`scheduler.type` "WarmupCosine" is not known; did you mean "WarmupCosineLR"?'),
        ({"type": "WarmupLR", "params": []}, "`scheduler.params` should be a JSON object"),
    ],
)  # fmt: skip
def test_scheduler_errors(scheduler, message):
    with raises(message):
        load(scheduler=scheduler)


def test_scheduler_type_is_case_insensitive():
    assert load(scheduler={"type": "warmuplr"}).scheduler.type == "WarmupLR"


def test_last_batch_iteration_is_accepted():
    params = load(scheduler={"type": "WarmupLR", "params": {"last_batch_iteration": 5}}).scheduler.params
    assert params["last_batch_iteration"] == 5


def test_optimizer_and_scheduler_null_mean_absent():
    config = load_config({"train_batch_size": 8, "optimizer": None, "scheduler": None})
    assert config.optimizer is None and config.scheduler is None
