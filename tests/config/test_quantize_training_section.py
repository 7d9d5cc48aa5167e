"""The ``quantize_training`` section (MoQ): DeepSpeed's keys (``quantize-algo`` included),
defaults, the keys accepted and ignored, and errors that name the key and what is allowed. The
typed section and the standalone ``MoQConfig.from_dict`` agree on every section."""

from __future__ import annotations

import re

import pytest

from tachyon.config import ConfigError, MoQConfig, load_config


def cfg(**sections):
    return {"train_batch_size": 8, **sections}


def raises(fragment: str):
    return pytest.raises(ConfigError, match=re.escape(fragment))


DEEPSPEED_SECTION = {
    "enabled": True, "quantize_verbose": True, "quantizer_kernel": True,
    "quantize-algo": {"q_type": "symmetric", "rounding": "nearest"},
    "quantize_bits": {"start_bits": 12, "target_bits": 8},
    "quantize_schedule": {"quantize_period": 400, "schedule_offset": 10},
    "quantize_groups": 8,
    "fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.01},
    "eigenvalue": {"enabled": False, "max_iter": 50},
}


def test_off_by_default_with_deepspeeds_defaults():
    section = load_config(cfg()).quantize_training
    assert section.enabled is False
    assert section.moq_config() == MoQConfig(16, 8, 100, 0, None, None, False, 0.001, False)


def test_a_deepspeed_section_is_typed_and_matches_the_standalone_parser():
    config = load_config(cfg(quantize_training=DEEPSPEED_SECTION))
    section = config.quantize_training
    assert section.enabled and section.quantize_algo.q_type == "symmetric"
    assert (section.quantize_bits.start_bits, section.quantize_schedule.quantize_period) == (12, 400)
    expected = MoQConfig(12, 8, 400, 10, 8, None, True, 0.01, True)
    assert section.moq_config() == MoQConfig.from_dict(DEEPSPEED_SECTION) == expected
    assert set(config.ignored_keys) == {"quantize_training.quantizer_kernel", "quantize_training.eigenvalue"}


def test_round_trip_keeps_the_hyphenated_key():
    config = load_config(cfg(quantize_training=DEEPSPEED_SECTION))
    out = config.to_dict()["quantize_training"]
    assert out["quantize-algo"] == {"q_type": "symmetric", "rounding": "nearest"} and "quantize_algo" not in out
    assert load_config(config.to_dict()) == config


@pytest.mark.parametrize(
    "section, message",
    [
        ({"quantize_bits": {"start_bits": 4, "target_bits": 8}},
         "`quantize_training.quantize_bits`: start_bits (4) must be >= target_bits (8)"),
        ({"quantize_bits": {"target_bits": 1}}, "`quantize_training.quantize_bits.target_bits` should be greater than "
                                                "or equal to 2; got 1"),
        ({"quantize_schedule": {"schedule_offset": -1}}, "`quantize_training.quantize_schedule.schedule_offset` should "
                                                         "be greater than or equal to 0"),
        ({"quantize-algo": {"q_type": "asymmetric"}}, "`quantize_training.quantize-algo.q_type` should be 'symmetric'"),
        ({"quantize-algo": {"q_typ": "symmetric"}}, "did you mean 'quantize_training.quantize-algo.q_type'?"),
        ({"quantize_algo": {}}, "unknown key 'quantize_training.quantize_algo'; did you mean "
                                "'quantize_training.quantize-algo'?"),
        ({"quantize_groups": 0}, "`quantize_training.quantize_groups` should be greater than 0"),
        ({"quantize_groups": 4, "group_size": 64}, "`quantize_training`: give quantize_groups or group_size, not both"),
        ({"eigenvalue": {"enabled": True}}, "`quantize_training.eigenvalue: {\"enabled\": true}` is a DeepSpeed "
                                            "feature tachyon does not support yet"),
        ({"fp16_mixed_quantize": {"quantize_change_ratio": 0}}, "`quantize_training.fp16_mixed_quantize."
                                                                "quantize_change_ratio` should be greater than 0"),
        ({"enabled": 1}, "`quantize_training.enabled` should be a valid boolean"),
    ],
)
def test_bad_values_name_the_key(section, message):
    with raises(message):
        load_config(cfg(quantize_training={"enabled": True, **section} if "enabled" not in section else section))


def test_a_disabled_section_is_still_checked():
    with raises("start_bits (4) must be >= target_bits (8)"):
        load_config(cfg(quantize_training={"enabled": False, "quantize_bits": {"start_bits": 4}}))


def test_tensor_parallelism_is_refused_with_moq():
    with raises("`quantize_training.enabled: true` with `tensor_parallel.tp_size: 2`"):
        load_config(cfg(quantize_training={"enabled": True}, tensor_parallel={"tp_size": 2}), world_size=2)
    load_config(cfg(quantize_training={"enabled": False}, tensor_parallel={"tp_size": 2}), world_size=2)


def test_top_level_eigenvalue_stays_refused():
    with raises("`eigenvalue: {\"enabled\": true}` is a DeepSpeed feature tachyon does not support yet"):
        load_config(cfg(eigenvalue={"enabled": True}))
