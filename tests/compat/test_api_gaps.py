"""DeepSpeed names scripts and integrations reach for beyond the engine: version, optimizer
classes, pipeline topologies and partitioning, the config object, schedules, PLD, the
accelerator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tachyon
import tachyon.compat.deepspeed as deepspeed

pytestmark = pytest.mark.usefixtures("one_thread")


def test_version_is_the_deepspeed_release_the_api_follows():
    assert deepspeed.__version__ == "0.19.6" and deepspeed.__version_major__ == 0


def test_the_config_optimizer_is_deepspeeds_fused_class():
    from tachyon.compat.deepspeed.ops.adam import FusedAdam
    from tachyon.compat.deepspeed.ops.lamb import FusedLamb

    _, adam, _, _ = deepspeed.initialize(model=torch.nn.Linear(2, 2),
                                        config={"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {}}})
    _, lamb, _, _ = deepspeed.initialize(model=torch.nn.Linear(2, 2),
                                        config={"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {}}})
    assert isinstance(adam, FusedAdam) and isinstance(lamb, FusedLamb) and not isinstance(lamb, FusedAdam)
    assert adam.optimizer is adam  # DeepSpeed's wrapper attribute
    assert not isinstance(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]), FusedAdam)


def test_pipeline_module_without_loss_fn_trains_on_its_output_as_loss():
    """DeepSpeed allows loss_fn=None: the last layer's output is the loss."""
    from tachyon.compat.deepspeed.pipe import PipelineModule

    class SquareLoss(torch.nn.Module):
        def forward(self, x):
            return x.square().mean()

    torch.manual_seed(0)
    net = PipelineModule(layers=[torch.nn.Linear(4, 4), SquareLoss()], num_stages=1)
    engine, *_ = deepspeed.initialize(model=net, config={"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                                         "optimizer": {"type": "SGD", "params": {"lr": 0.5}}})
    data = iter([(torch.randn(2, 4), torch.zeros(2)) for _ in range(20)])
    losses = [float(engine.train_batch(data)) for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0] and engine.was_step_applied()


def test_process_topologies_are_deepspeeds():
    from tachyon.compat.deepspeed.pipe import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

    topo = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert [topo.get_rank(a=a, b=b) for a in range(2) for b in range(2)] == [0, 1, 2, 3]
    assert topo.get_coord(3) == topo.ProcessCoord(a=1, b=1) and topo.world_size() == 4
    assert topo.get_axis_comm_lists("a") == [[0, 2], [1, 3]] and topo.get_axis_comm_lists("c") == []
    assert topo.filter_match(a=0) == [0, 1] and topo.get_axis_list("b", 1) == [1, 3]
    assert topo.get_dim("c") == 0
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert three.get_axis_names() == ["pipe", "data", "model"] and three.get_rank(pipe=1, data=0, model=1) == 5
    assert three.get_rank_repr(5) == "model_01" and three.get_rank_repr(5, omit_axes=["model"]) == "pipe_01-data_00"
    assert PipeDataParallelTopology(num_pp=4, num_dp=2).get_axis_comm_lists("pipe") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(a=0)


@pytest.mark.parametrize("weights, parts, spread", [([1, 2, 1], 4, 2), ([1, 1, 1, 1], 4, 0), ([1, 1, 1, 1, 1], 4, 1),
                                                    ([1, 1, 1, 1, 0, 1], 4, 1)])
def test_partition_balanced_is_deepspeeds(weights, parts, spread):
    """DeepSpeed's tests/unit/utils/test_partition_balanced.py cases (3 items into 4 parts included)."""
    result = deepspeed.runtime.utils.partition_balanced(weights, parts)
    sums = [sum(weights[b:e]) for b, e in zip(result[:-1], result[1:])]
    assert len(result) == parts + 1 and max(sums) - min(sums) == spread
    assert deepspeed.runtime.utils.partition_uniform(3, 4) == [0, 1, 2, 3, 3]


def test_deepspeed_config_object_reads_a_config():
    from tachyon.compat.deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1}}})
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (8, 4, 2)
    assert config.bfloat16_enabled and config.zero_enabled and config.zero_optimization_stage == 2
    assert config.optimizer_name == "adamw" and config._param_dict["train_batch_size"] == 8
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="train_batch_size"):
        DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3})


def test_runtime_schedules_and_pld_are_deepspeeds():
    from tachyon.compat.deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WARMUP_LR, WarmupLR
    from tachyon.compat.deepspeed.runtime.progressive_layer_drop import ProgressiveLayerDrop

    assert WARMUP_LR == "WarmupLR" and "LRRangeTest" in VALID_LR_SCHEDULES
    assert WarmupLR is tachyon.engine.lr_schedules.WarmupLR
    for theta in (0.0, 0.1, 1.0):  # DeepSpeed's test_pld_schedule
        pld = ProgressiveLayerDrop(theta, 0.001)
        for i in range(10):
            pld.update_state(i)
            assert pld.get_theta() == (1.0 - theta) * np.exp(-0.001 * i) + theta


def test_accelerator_answers_for_this_machine():
    from tachyon.compat.deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc is get_accelerator()
    if not torch.cuda.is_available():
        assert acc.device_name(0) == "cpu" and acc.communication_backend_name() == "gloo"
        assert acc.memory_allocated() == 0 and acc.device_count() == 1
    assert torch.float32 in acc.supported_dtypes() and acc.is_fp16_supported()
    with pytest.raises(AttributeError, match="op builders"):
        acc.create_op_builder  # noqa: B018


def test_cpu_accelerator_forks_the_rng_for_its_own_device_type():
    """DeepSpeed's tests fork the RNG with ``device_type=get_accelerator().device_name()``; on the
    CPU torch.random.fork_rng has no "cpu" device module, the compat accelerator's does."""
    from tachyon.compat.deepspeed.accelerator import TachyonAccelerator

    acc = TachyonAccelerator(cuda=False)
    torch.manual_seed(0)
    with acc.random().fork_rng(devices=[acc.current_device_name()], device_type=acc.device_name()):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), inside)  # the CPU generator was restored after the block
    assert acc.random().manual_seed is torch.random.manual_seed
