"""The ``progressive_layer_drop`` and ``flops_profiler`` sections: DeepSpeed's keys and defaults,
and errors that name the key and what is allowed."""

from __future__ import annotations

import re

import pytest

from tachyon.config import ConfigError, load_config


def cfg(**sections):
    return {"train_batch_size": 8, **sections}


def raises(fragment: str):
    return pytest.raises(ConfigError, match=re.escape(fragment))


def test_progressive_layer_drop_defaults():
    pld = load_config(cfg()).progressive_layer_drop
    assert (pld.enabled, pld.theta, pld.gamma) == (False, 0.5, 0.001)
    pld = load_config(cfg(progressive_layer_drop={"enabled": True})).progressive_layer_drop
    assert (pld.enabled, pld.theta, pld.gamma) == (True, 0.5, 0.001)
    pld = load_config(cfg(progressive_layer_drop={"enabled": True, "theta": 1, "gamma": 0})).progressive_layer_drop
    assert (pld.theta, pld.gamma) == (1.0, 0.0)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"enabled": True, "theta": 0.0}, "`progressive_layer_drop.theta` should be greater than 0; got 0.0"),
        ({"enabled": True, "theta": 1.5}, "`progressive_layer_drop.theta` should be less than or equal to 1"),
        ({"enabled": True, "gamma": -0.1}, "`progressive_layer_drop.gamma` should be greater than or equal to 0"),
        ({"enabled": "yes"}, "`progressive_layer_drop.enabled` should be a valid boolean"),
        ({"enabled": True, "thetta": 0.5}, "unknown key 'progressive_layer_drop.thetta'; did you mean "
                                           "'progressive_layer_drop.theta'?"),
    ],
)
def test_progressive_layer_drop_errors(section, message):
    with raises(message):
        load_config(cfg(progressive_layer_drop=section))


def test_flops_profiler_defaults_are_deepspeeds():
    fp = load_config(cfg(flops_profiler={"enabled": True})).flops_profiler
    assert (fp.enabled, fp.profile_step, fp.module_depth, fp.top_modules, fp.detailed, fp.output_file,
            fp.recompute_fwd_factor) == (True, 1, -1, 1, True, None, 0.0)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"profile_step": -1}, "`flops_profiler.profile_step` should be greater than or equal to 0; got -1"),
        ({"module_depth": -2}, "`flops_profiler.module_depth` should be greater than or equal to -1; got -2"),
        ({"top_modules": 0}, "`flops_profiler.top_modules` should be greater than 0; got 0"),
        ({"output_file": 3}, "`flops_profiler.output_file` should be a valid string; got 3"),
        ({"profile_stepp": 1}, "did you mean 'flops_profiler.profile_step'?"),
    ],
)
def test_flops_profiler_errors(section, message):
    with raises(message):
        load_config(cfg(flops_profiler={"enabled": True, **section}))


def test_sections_round_trip():
    given = cfg(progressive_layer_drop={"enabled": True, "theta": 0.25, "gamma": 0.01},
                flops_profiler={"enabled": True, "profile_step": 3, "output_file": "/tmp/p.txt"})
    config = load_config(given)
    assert load_config(config.to_dict()) == config
    assert config.ignored_keys == ()
