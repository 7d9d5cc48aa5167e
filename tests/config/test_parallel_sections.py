"""The ``tensor_parallel`` and ``pipeline`` sections: values, DeepSpeed's spellings, the
data-parallel size the batch sizes are resolved over, and the combinations refused."""

from __future__ import annotations

import re

import pytest

from tachyon.config import ACCEPTED_IGNORED_KEYS, UNSUPPORTED_KEYS, ConfigError, load_config, parse_config

BASE = {"train_micro_batch_size_per_gpu": 2}


def cfg(**sections):
    return {**BASE, **sections}


def raises(pattern: str):
    return pytest.raises(ConfigError, match=re.escape(pattern))


def test_defaults_are_plain_data_parallelism():
    config = load_config(cfg(), world_size=4)
    assert config.tensor_parallel.size == 1 and config.pipeline.num_stages is None
    assert config.pipeline.schedule == "1F1B" and config.pipeline.partition == "parameters"
    assert config.model_parallel_size == 1 and config.train_batch_size == 8
    assert "pipeline" not in UNSUPPORTED_KEYS and "tensor_parallel" not in UNSUPPORTED_KEYS


@pytest.mark.parametrize(("sections", "dp"), [
    ({"tensor_parallel": {"tp_size": 2}}, 4),
    ({"tensor_parallel": {"autotp_size": 4}}, 2),
    ({"pipeline": {"stages": 2}}, 4),
    ({"pipeline": {"stages": 2}, "tensor_parallel": {"tp_size": 2}}, 2),
    ({"pipeline": {"stages": "auto"}, "tensor_parallel": {"autotp_size": 0}}, 8),
])
def test_batch_sizes_are_resolved_over_the_data_parallel_ranks(sections, dp):
    """train_batch_size = micro x gas x dp, dp = world / (stages x tp_size): the tensor- and
    pipeline-parallel ranks of one model copy read the same samples."""
    config = load_config(cfg(gradient_accumulation_steps=3, **sections), world_size=8)
    assert config.train_batch_size == 2 * 3 * dp
    assert config.model_parallel_size == 8 // dp


def test_initialize_passes_the_data_parallel_size_itself():
    """A PipelineModule or an mpu decides the layout (stages "auto"): initialize resolves the
    batch sizes over the size it found."""
    config = load_config(cfg(train_batch_size=12), world_size=8, data_parallel_size=2)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (12, 2, 3)
    with raises("data_parallel_size=3 does not divide the world size 8"):
        load_config(cfg(), world_size=8, data_parallel_size=3)


@pytest.mark.parametrize(("sections", "message"), [
    ({"tensor_parallel": {"tp_size": 3}}, "`tensor_parallel.tp_size` (3) does not divide the world size (4)"),
    ({"pipeline": {"stages": 3}}, "`pipeline.stages` (3) does not divide the world size (4)"),
    ({"pipeline": {"stages": 2}, "tensor_parallel": {"tp_size": 4}},
     "`pipeline.stages` (2) x `tensor_parallel.tp_size` (4) = 8 does not divide the world size (4)"),
    ({"tensor_parallel": {"tp_size": 0}}, "`tensor_parallel.tp_size` should be greater than 0; got 0"),
    ({"tensor_parallel": {"tp_size": 2, "autotp_size": 4}},
     "`tensor_parallel.tp_size` (2) and `tensor_parallel.autotp_size` (4) name the same setting with different values"),
    ({"tensor_parallel": {"tp_sise": 2}}, "did you mean 'tensor_parallel.tp_size'?"),
    ({"pipeline": {"stages": 0}}, '`pipeline.stages` should be "auto" or an int >= 1; got 0'),
    ({"pipeline": {"stages": "2"}}, '`pipeline.stages` should be "auto" or an int >= 1; got "2"'),
    ({"pipeline": {"schedule": "zero-bubble"}}, "`pipeline.schedule` should be 'GPipe', '1F1B' or 'interleaved_1F1B'"),
    ({"pipeline": {"partition": "type:["}}, '`pipeline.partition`: "type:[" is not a valid regex'),
    ({"pipeline": {"partition": "layers"}}, '`pipeline.partition` should be "parameters" (DeepSpeed\'s "best"), "uniform"'),
    ({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}},
     "`zero_optimization.stage: 2` with `pipeline.stages: 2`: ZeRO stages 2 and 3 partition gradients during "
     "every micro-batch's backward"),
    ({"tensor_parallel": {"tp_size": 2, "sequence_parallel": True},
      "activation_checkpointing": {"partition_activations": True}},
     "`activation_checkpointing.partition_activations: true` with `tensor_parallel.sequence_parallel: true`"),
])
def test_bad_sections_are_refused_naming_the_key(sections, message):
    with raises(message):
        load_config(cfg(**sections), world_size=4)


def test_schedule_and_partition_spellings():
    """Schedule names are case- and dash-insensitive; DeepSpeed's ``partition: "best"`` is the
    parameter-balanced split; ``pipe_partitioned`` / ``grad_partitioned`` are accepted and
    listed as ignored."""
    for given, canonical in (("gpipe", "GPipe"), ("1f1b", "1F1B"), ("Interleaved-1F1B", "interleaved_1F1B")):
        assert parse_config(cfg(pipeline={"schedule": given})).pipeline.schedule == canonical
    config = parse_config(cfg(pipeline={"partition": "best", "pipe_partitioned": True, "grad_partitioned": False,
                                        "activation_checkpoint_interval": 1, "seed_layers": True}))
    assert config.pipeline.partition == "parameters" and config.pipeline.activation_checkpoint_interval == 1
    assert {"pipeline.pipe_partitioned", "pipeline.grad_partitioned"} <= set(ACCEPTED_IGNORED_KEYS)
    assert set(config.ignored_keys) >= {"pipeline.pipe_partitioned", "pipeline.grad_partitioned"}
    assert parse_config(cfg(pipeline={"partition": "type:Transformer.*"})).pipeline.partition == "type:Transformer.*"


def test_parse_config_leaves_batch_sizes_as_given():
    config = parse_config(cfg(tensor_parallel={"tp_size": 2}))
    assert config.train_batch_size is None and config.tensor_parallel.tp_size == 2
