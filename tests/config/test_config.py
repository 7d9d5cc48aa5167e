"""load_config: loading, defaults, unknown keys, wrong types, unsupported features, round trip."""

from __future__ import annotations

import json
import re

import pytest

from tachyon.config import (
    ACCEPTED_IGNORED_KEYS,
    OFF_VALUES,
    UNSUPPORTED_KEYS,
    ConfigError,
    TachyonConfig,
    load_config,
)

BASE = {"train_micro_batch_size_per_gpu": 2}


def cfg(**sections):
    return {**BASE, **sections}


def raises(pattern: str):
    """pytest.raises(ConfigError) matching ``pattern`` literally (key paths contain dots)."""
    return pytest.raises(ConfigError, match=re.escape(pattern))


# ---------------------------------------------------------------- loading


def test_load_from_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg(fp16={"enabled": True}, zero_optimization={"stage": 2})))
    for source in (path, str(path)):
        config = load_config(source, world_size=2)
        assert config.precision == "fp16"
        assert config.zero_stage == 2
        assert config.train_batch_size == 4


def test_missing_file(tmp_path):
    with raises("config file not found"):
        load_config(tmp_path / "nope.json")


def test_invalid_json_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  ]\n}\n')
    with pytest.raises(ConfigError, match=r"bad\.json:3:3: invalid JSON \(and invalid Hjson"):
        load_config(path)


def test_hjson_config_files_load_as_deepspeed_reads_them(tmp_path):
    """DeepSpeed reads config files with hjson: comments, trailing commas, unquoted keys and
    quoteless values load; a duplicate key is still refused."""
    path = tmp_path / "ds.json"
    path.write_text(
        "# a DeepSpeed config\n{\n  train_batch_size: 8  // global batch\n"
        "  optimizer: {\n    type: Adam\n    params: {lr: 1e-3,}\n  },\n  /* precision */ 'bf16': {enabled: true},\n}\n")
    config = load_config(path, world_size=2)
    assert config.train_batch_size == 8 and config.optimizer.type == "Adam" and config.bf16.enabled
    assert config.train_micro_batch_size_per_gpu == 4
    path.write_text("{train_batch_size: 8\n train_batch_size: 4}")
    with raises("duplicate key 'train_batch_size'"):
        load_config(path)


def test_duplicate_keys_in_file(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with raises("duplicate key 'train_batch_size'"):
        load_config(path)


@pytest.mark.parametrize("source", [3, None, ["train_batch_size"]])
def test_wrong_source_type(source):
    with raises("config should be a path to a JSON file, a dict or a TachyonConfig"):
        load_config(source)


def test_top_level_json_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with raises("the config should be a JSON object; got list"):
        load_config(path)


def test_input_dict_is_not_modified():
    given = cfg(bfloat16={"enabled": True}, optimizer={"type": "adam"}, dump_state=True)
    snapshot = json.loads(json.dumps(given))
    load_config(given)
    assert given == snapshot


def test_tachyon_config_is_rechecked_against_world_size():
    config = load_config({"train_batch_size": 8}, world_size=2)
    assert load_config(config, world_size=2) == config
    with raises("world_size (4)"):
        load_config(config, world_size=4)


# ---------------------------------------------------------------- defaults (DeepSpeed's)


def test_defaults_match_deepspeed():
    config = load_config(BASE)
    assert config.gradient_clipping == 0.0
    assert config.steps_per_print == 10
    assert config.wall_clock_breakdown is False
    assert config.seed is None
    assert config.prescale_gradients is False
    assert config.gradient_predivide_factor == 1.0
    assert config.communication_data_type is None
    assert config.zero_allow_untested_optimizer is False
    assert config.zero_force_ds_cpu_optimizer is True
    assert config.optimizer is None and config.scheduler is None
    assert config.precision == "fp32" and config.zero_stage == 0
    assert config.fp16.model_dump() == {
        "enabled": False, "auto_cast": False, "loss_scale": 0.0, "initial_scale_power": 16,
        "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
        "min_loss_scale": 1.0,
    }  # fmt: skip
    assert config.fp16.dynamic_loss_scale
    # check_grad_overflow is on here (off in DeepSpeed): a nan/inf step is skipped in every precision
    assert config.bf16.model_dump() == {"enabled": False, "check_grad_overflow": True}
    assert config.zero_optimization.model_dump() == {
        "stage": 0, "contiguous_gradients": True, "reduce_scatter": True,
        "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
        "overlap_comm": False, "round_robin_gradients": False, "stage3_prefetch_bucket_size": 50_000_000,
        "shard_module_classes": None, "offload_optimizer": None, "offload_param": None,
    }  # fmt: skip
    assert config.data_types.grad_accum_dtype is None
    assert config.checkpoint.model_dump() == {
        "tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False, "allow_nonfinite": False,
    }  # fmt: skip
    assert config.activation_checkpointing.model_dump() == {
        "partition_activations": False, "cpu_checkpointing": False,
        "contiguous_memory_optimization": False, "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False, "profile": False,
    }  # fmt: skip
    for monitor in (config.tensorboard, config.csv_monitor):
        assert monitor.model_dump() == {
            "enabled": False, "output_path": "", "job_name": "DeepSpeedJobName",
        }  # fmt: skip
    assert config.ignored_keys == ()


def test_typical_deepspeed_config_loads():
    config = load_config(
        {
            "train_batch_size": 256,
            "gradient_accumulation_steps": 4,
            "gradient_clipping": 1,
            "steps_per_print": 100,
            "wall_clock_breakdown": False,
            "seed": 1234,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100,
                                                              "total_num_steps": 10000}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 2e8,
                                  "allgather_bucket_size": 2e8, "contiguous_gradients": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "bf16",
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                         "number_checkpoints": 4},
            "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "gpt"},
            "checkpoint": {"tag_validation": "fail"},
        },
        world_size=8,
    )  # fmt: skip
    assert config.train_micro_batch_size_per_gpu == 8
    assert config.gradient_clipping == 1.0 and isinstance(config.gradient_clipping, float)
    assert config.precision == "bf16" and config.zero_stage == 2
    assert config.zero_optimization.reduce_bucket_size == 200_000_000
    assert isinstance(config.zero_optimization.reduce_bucket_size, int)
    assert config.optimizer.params["betas"] == (0.9, 0.95)
    assert config.scheduler.params["warmup_type"] == "log"
    assert config.checkpoint.tag_validation == "Fail"
    assert config.tensorboard.enabled and config.tensorboard.job_name == "gpt"


# ---------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "config, message",
    [
        (cfg(zero_optimisation={"stage": 1}),
         "unknown key 'zero_optimisation'; did you mean 'zero_optimization'?"),
        (cfg(gradient_cliping=1.0),
         "unknown key 'gradient_cliping'; did you mean 'gradient_clipping'?"),
        ({"train_micro_batch_size": 2},
         "unknown key 'train_micro_batch_size'; did you mean 'train_micro_batch_size_per_gpu'?"),
        (cfg(zero_optimization={"stag": 1}),
         "unknown key 'zero_optimization.stag'; did you mean 'zero_optimization.stage'?"),
        (cfg(fp16={"enable": True}), "unknown key 'fp16.enable'; did you mean 'fp16.enabled'?"),
        (cfg(fp16={"initial_scale_pow": 8}),
         "unknown key 'fp16.initial_scale_pow'; did you mean 'fp16.initial_scale_power'?"),
        (cfg(optimizer={"type": "Adam", "param": {}}),
         "unknown key 'optimizer.param'; did you mean 'optimizer.params'?"),
        (cfg(optimizer={"type": "Adam", "params": {"learning_rate": 1e-3, "lr": 1}}),
         "unknown key 'optimizer.params.learning_rate'"),
        (cfg(optimizer={"type": "SGD", "params": {"momentom": 0.9}}),
         "unknown key 'optimizer.params.momentom'; did you mean 'optimizer.params.momentum'?"),
        (cfg(scheduler={"type": "WarmupLR", "params": {"warmup_max": 0.1}}),
         "unknown key 'scheduler.params.warmup_max'; did you mean 'scheduler.params.warmup_max_lr'?"),
        (cfg(activation_checkpointing={"partition_activation": True}),
         "did you mean 'activation_checkpointing.partition_activations'?"),
        (cfg(checkpoint={"tag_validate": "Warn"}),
         "did you mean 'checkpoint.tag_validation'?"),
        (cfg(Fp16={"enabled": True}), "unknown key 'Fp16'; did you mean 'fp16'?"),
    ],
)  # fmt: skip
def test_unknown_keys_get_did_you_mean(config, message):
    with raises(message):
        load_config(config)


def test_unknown_key_without_close_match_lists_allowed_keys():
    with raises("unknown key 'bf16.xyz'; keys allowed at `bf16`:") as info:
        load_config(cfg(bf16={"xyz": 1}))
    assert "enabled" in str(info.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(cfg(zero_optimisation={}, fp16={"enabled": "yes"}, pipeline={"stages": 0}))
    problems = info.value.problems
    assert len(problems) == 3
    assert str(info.value).startswith("3 problems in the config:")
    assert any("fp16.enabled" in p for p in problems)


# ---------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    "config, message",
    [
        (cfg(zero_optimization={"stage": "2"}),
         '`zero_optimization.stage` should be a valid integer; got "2" (str)'),
        (cfg(zero_optimization={"stage": 5}), "`zero_optimization.stage` should be 0, 1, 2 or 3; got 5"),
        (cfg(zero_optimization={"stage": True}), "`zero_optimization.stage` should be a valid integer"),
        (cfg(zero_optimization={"reduce_bucket_size": 5.5e8 + 0.5}),
         "`zero_optimization.reduce_bucket_size` should be a valid integer"),
        (cfg(fp16={"enabled": 1}), "`fp16.enabled` should be a valid boolean; got 1 (int)"),
        (cfg(fp16={"enabled": "true"}), '`fp16.enabled` should be a valid boolean; got "true"'),
        (cfg(fp16={"loss_scale_window": 0}), "`fp16.loss_scale_window` should be greater than 0"),
        (cfg(fp16={"min_loss_scale": 0}), "`fp16.min_loss_scale` should be greater than 0"),
        (cfg(gradient_clipping=-1.0), "`gradient_clipping` should be greater than or equal to 0"),
        (cfg(gradient_clipping="1.0"), "`gradient_clipping` should be a valid number"),
        (cfg(gradient_clipping=float("nan")), "`gradient_clipping` should be a finite number"),
        (cfg(steps_per_print=0), "`steps_per_print` should be greater than 0"),
        (cfg(seed=1.5), "`seed` should be a valid integer"),
        (cfg(wall_clock_breakdown=None), "`wall_clock_breakdown` should be a valid boolean"),
        (cfg(gradient_predivide_factor=0), "`gradient_predivide_factor` should be greater than 0"),
        (cfg(communication_data_type="int8"), "`communication_data_type` should be 'fp32', 'fp16' or 'bf16'"),
        (cfg(data_types={"grad_accum_dtype": "fp64"}), "`data_types.grad_accum_dtype` should be"),
        (cfg(checkpoint={"tag_validation": "Sometimes"}), "`checkpoint.tag_validation` should be 'Warn', 'Ignore' or 'Fail'"),
        (cfg(tensorboard={"output_path": 3}), "`tensorboard.output_path` should be a valid string"),
        (cfg(fp16=True), "`fp16` should be a JSON object (a section of keys); got true (bool)"),
        (cfg(optimizer=["Adam"]), "`optimizer` should be a JSON object"),
        (cfg(train_batch_size="auto"), "Hugging Face Trainer integration"),
    ],
)  # fmt: skip
def test_wrong_types_name_path_value_and_expected(config, message):
    with raises(message):
        load_config(config)


def test_ints_are_accepted_where_floats_are_expected():
    config = load_config(cfg(gradient_clipping=1, fp16={"loss_scale": 128, "enabled": True}))
    assert config.gradient_clipping == 1.0 and config.fp16.loss_scale == 128.0
    assert not config.fp16.dynamic_loss_scale


@pytest.mark.parametrize("alias, canonical", [("float16", "fp16"), ("BF16", "bf16"),
                                              ("bfloat16", "bf16"), ("fp32", "fp32")])
def test_dtype_aliases(alias, canonical):
    assert load_config(cfg(communication_data_type=alias)).communication_data_type == canonical


def test_zero_overlap_comm_null_is_deepspeed_dynamic_default():
    assert load_config(cfg(zero_optimization={"stage": 2, "overlap_comm": None})).zero_optimization.overlap_comm is False


def test_number_checkpoints_false_means_unset():
    config = load_config(cfg(activation_checkpointing={"number_checkpoints": False}))
    assert config.activation_checkpointing.number_checkpoints is None


def test_zero_optimization_as_bool_is_refused_with_the_dict_form():
    for value in (True, False):
        with raises('write the section as an object, e.g. "zero_optimization": {"stage": 1}'):
            load_config(cfg(zero_optimization=value))


# ---------------------------------------------------------------- cross-section rules


def test_fp16_and_bf16_both_enabled():
    with raises("`fp16.enabled` and `bf16.enabled` are both true"):
        load_config(cfg(fp16={"enabled": True}, bf16={"enabled": True}))


def test_bfloat16_is_an_alias_for_bf16():
    config = load_config(cfg(bfloat16={"enabled": True}))
    assert config.bf16.enabled and config.precision == "bf16"
    assert "bfloat16" not in config.to_dict() and config.to_dict()["bf16"]["enabled"] is True
    with raises("`fp16.enabled` and `bf16.enabled` are both true"):
        load_config(cfg(fp16={"enabled": True}, bfloat16={"enabled": True}))
    with raises("both `bf16` and its older name `bfloat16`"):
        load_config(cfg(bf16={"enabled": True}, bfloat16={"enabled": True}))


def test_grad_accum_dtype_must_be_fp32_or_training_precision_without_zero():
    ok = load_config(cfg(bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"}))
    assert ok.data_types.grad_accum_dtype == "bf16"
    with raises('`data_types.grad_accum_dtype: "fp16"` with "bf16" training and no ZeRO'):
        load_config(cfg(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp16"}))


def test_fp16_hysteresis_is_deepspeeds_per_stage():
    """DeepSpeed's fp16 optimizer without ZeRO halves at every overflow; its ZeRO optimizers spend
    the hysteresis first."""
    fp16 = {"enabled": True, "hysteresis": 3}
    assert load_config(cfg(fp16=fp16)).fp16.hysteresis == 1
    assert load_config(cfg(fp16=fp16)).ignored_keys == ("fp16.hysteresis",)
    assert load_config(cfg(fp16=fp16, zero_optimization={"stage": 2})).fp16.hysteresis == 3


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("accum", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2])
def test_every_grad_accum_dtype_starts_with_zero_as_in_deepspeed(stage, accum, precision):
    """DeepSpeed's ZeRO-1/2 accept every (model dtype, grad_accum_dtype) pair; a pair other than
    the model dtype or fp32 accumulates in the model dtype there, and is reported as ignored."""
    sections = {} if precision == "fp32" else {precision: {"enabled": True}}
    config = load_config(cfg(zero_optimization={"stage": stage}, data_types={"grad_accum_dtype": accum}, **sections))
    if accum in ("fp32", precision):
        assert config.data_types.grad_accum_dtype == accum and config.ignored_keys == ()
    else:
        assert config.data_types.grad_accum_dtype is None
        assert config.ignored_keys == ("data_types.grad_accum_dtype",)


def test_cpu_checkpointing_needs_partition_activations():
    with raises("`activation_checkpointing.cpu_checkpointing: true` needs"):
        load_config(cfg(activation_checkpointing={"cpu_checkpointing": True}))


# ---------------------------------------------------------------- unsupported features


def test_zero_stage_3_is_accepted():
    assert load_config(cfg(zero_optimization={"stage": 3})).zero_stage == 3


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_offload_sections(key):
    config = load_config(cfg(zero_optimization={"stage": 3, key: {"device": "CPU", "pin_memory": True}}))
    assert getattr(config.zero_optimization, key).device == "cpu"
    with raises(f'`zero_optimization.{key}.device: "nvme"`'):
        load_config(cfg(zero_optimization={"stage": 3, key: {"device": "nvme"}}))
    # device "none" (as HF templates write) leaves offload off
    config = load_config(cfg(zero_optimization={"stage": 2, key: {"device": "none"}}))
    assert not config.zero_optimization.offloads_optimizer and not config.zero_optimization.offloads_params


@pytest.mark.parametrize("key", ["stage3_max_live_parameters", "stage3_gather_16bit_weights_on_model_save",
                                 "gather_16bit_weights_on_model_save", "max_live_parameters"])
def test_stage3_knobs_are_accepted_and_ignored_below_stage_3(key):
    """DeepSpeed reads them only at stage 3 (which tachyon refuses by the stage key itself)."""
    config = load_config(cfg(zero_optimization={"stage": 2, key: 1}))
    assert config.ignored_keys == (f"zero_optimization.{key}",)


@pytest.mark.parametrize(
    "section, value",
    [
        ("hybrid_engine", {"enabled": True}),
        ("sparse_attention", {"mode": "fixed"}),
        ("amp", {"enabled": True, "opt_level": "O1"}),
        ("wandb", {"enabled": True, "project": "x"}),
        ("elasticity", {"enabled": True}),
        ("sequence_parallel_size", 2),
        ("sparse_gradients", True),
    ],
)
def test_unsupported_sections(section, value):
    with raises(f"`{section}"):
        load_config(cfg(**{section: value}))
    with raises("is a DeepSpeed feature tachyon does not support yet"):
        load_config(cfg(**{section: value}))


@pytest.mark.parametrize(
    "section, value",
    [
        ("wandb", {"enabled": False}),
        ("sequence_parallel_size", 1),
        ("sparse_gradients", False),
    ],
)
def test_unsupported_features_switched_off_are_accepted_and_reported(section, value):
    config = load_config(cfg(**{section: value}))
    assert config.ignored_keys == (section,)
    assert config.to_dict()[section] == value


@pytest.mark.parametrize(
    "config, message",
    [
        (cfg(fp16={"enabled": True, "auto_cast": True}), "`fp16.auto_cast: true` is a DeepSpeed feature"),
        (cfg(checkpoint={"load_universal": True}), "`checkpoint.load_universal: true` is a DeepSpeed feature"),
        (cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True}), "`bf16.bf16_master_weights_and_grads: true`"),
        (cfg(zero_optimization={"zero_quantized_weights": True}), "`zero_optimization.zero_quantized_weights: true`"),
    ],
)  # fmt: skip
def test_unsupported_values(config, message):
    with raises(message):
        load_config(config)


def test_refused_field_value_still_type_checked_otherwise():
    with raises("`fp16.auto_cast` should be a valid boolean"):
        load_config(cfg(fp16={"auto_cast": "no"}))
    assert load_config(cfg(fp16={"auto_cast": False})).ignored_keys == ()


# ---------------------------------------------------------------- accepted-but-ignored keys


def test_accepted_ignored_keys_are_reported_and_round_trip():
    given = cfg(
        dump_state=True,
        timers={"throughput": {"enabled": True}},
        zero_optimization={"stage": 1, "allgather_partitions": True, "sub_group_size": 1e9},
        bf16={"enabled": True, "immediate_grad_update": False},
        optimizer={"type": "Adam", "legacy_fusion": False},
    )
    config = load_config(given)
    assert set(config.ignored_keys) == {
        "dump_state", "timers", "zero_optimization.allgather_partitions",
        "zero_optimization.sub_group_size", "bf16.immediate_grad_update", "optimizer.legacy_fusion",
    }  # fmt: skip
    assert load_config(config.to_dict()) == config
    assert config.to_dict()["zero_optimization"]["allgather_partitions"] is True


def test_key_tables_are_consistent():
    assert set(OFF_VALUES) <= set(UNSUPPORTED_KEYS)
    assert not set(ACCEPTED_IGNORED_KEYS) & set(UNSUPPORTED_KEYS)
    fields = set(TachyonConfig.model_fields)
    for path in (*UNSUPPORTED_KEYS, *ACCEPTED_IGNORED_KEYS):
        top = path.split(".")[0]
        if "." in path:
            assert top in fields, path  # nested keys live in real sections
        else:
            assert top not in fields, path


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("world", [1, 4])
def test_round_trip(world):
    config = load_config(
        {
            "train_batch_size": 32,
            "optimizer": {"type": "lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3}},
            "fp16": {"enabled": True, "loss_scale_window": 500},
            "zero_optimization": {"stage": 1},
            "seed": 7,
            "csv_monitor": {"enabled": True, "output_path": "/tmp/x"},
            "flops_profiler": {"enabled": False},
            "wandb": {"enabled": False},
        },
        world_size=world,
    )  # fmt: skip
    as_dict = config.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict  # JSON-ready
    again = load_config(as_dict, world_size=world)
    assert again == config
    assert again.to_dict() == as_dict
    assert again.ignored_keys == ("wandb",)


def test_round_trip_through_a_file(tmp_path):
    config = load_config(cfg(bf16={"enabled": True}, zero_optimization={"stage": 2}))
    path = tmp_path / "out.json"
    path.write_text(json.dumps(config.to_dict(), indent=2))
    assert load_config(path) == config


def test_ignored_keys_under_the_bfloat16_alias_round_trip():
    config = load_config(cfg(bfloat16={"enabled": True, "immediate_grad_update": True}))
    assert config.ignored_keys == ("bf16.immediate_grad_update",)
    assert config.to_dict()["bf16"] == {"enabled": True, "check_grad_overflow": True, "immediate_grad_update": True}
    assert load_config(config.to_dict()) == config


def test_equality_includes_ignored_keys():
    assert load_config(cfg(dump_state=True)) != load_config(cfg())
    assert load_config(cfg(dump_state=True)) == load_config(cfg(dump_state=True))
