"""DeepSpeed's PipelineEngine settings on a PipelineModule: the config's checkpoint interval and
``use_reentrant`` go onto the module, ``set_checkpoint_interval`` rebuilds which runs of layers
are checkpointed (DeepSpeed's rule: runs holding parameters), and numbers as labels reach the
loss as tensors. One stage, one process, tiny layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tachyon.compat.deepspeed as deepspeed
from tachyon.compat.deepspeed.pipe import PipelineModule
from tachyon.compat.deepspeed.runtime.activation_checkpointing import checkpointing


def _layers():
    torch.manual_seed(0)
    return [nn.ReLU(), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1)]


def _plain_call(function, *args):
    return function(*args)


def test_checkpoint_runs_follow_the_interval_and_hold_parameters():
    net = PipelineModule(layers=_layers(), num_stages=1, activation_checkpoint_interval=2)
    assert net.is_checkpointable_results == [False, True]  # the ReLU run has no parameters
    net.set_checkpoint_interval(1)
    assert net.activation_checkpoint_interval == 1 and net.is_checkpointable_results == [False, False, True, True]
    net.set_checkpoint_interval(0)
    assert net.is_checkpointable_results == []
    with pytest.raises(ValueError, match="activation_checkpoint_interval must be an int >= 0"):
        net.set_checkpoint_interval(-1)


def test_the_config_sets_the_interval_and_the_non_reentrant_function():
    net = PipelineModule(layers=_layers(), num_stages=1)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
              "pipeline": {"activation_checkpoint_interval": 2, "use_reentrant": False}}
    engine, *_ = deepspeed.initialize(model=net, config=config, dist_init_required=False)
    assert net.activation_checkpoint_interval == 2 and net.is_checkpointable_results == [False, True]
    assert net.activation_checkpoint_func is checkpointing.non_reentrant_checkpoint
    assert not engine._reentrant_activation_checkpointing()
    net.activation_checkpoint_func = _plain_call  # a function tachyon does not know: counted as reentrant (DeepSpeed)
    assert engine._reentrant_activation_checkpointing()
    net.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
    x = torch.randn(1, 4)
    out = engine.eval_batch(iter([(x, 0), (x, 0)]))  # numbers as labels: no loss_fn, the output is the loss
    torch.testing.assert_close(out.reshape(-1), nn.Sequential(*net.stage_modules[0].ordered_layers())(x).reshape(-1))
