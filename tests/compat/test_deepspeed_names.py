"""tachyon.compat.deepspeed: DeepSpeed's names are tachyon's objects; the rest fail clearly."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
import torch

import tachyon
import tachyon.compat.deepspeed as deepspeed
from tachyon.compat._names import Unsupported
from tests.utils import assert_close


def test_top_level_names_are_tachyons_own_objects():
    import tachyon.nn as tnn

    assert deepspeed.initialize is tachyon.initialize
    assert deepspeed.DeepSpeedEngine is tachyon.Engine
    assert deepspeed.init_distributed is deepspeed.comm.init_distributed  # DeepSpeed's signature over tachyon's
    assert deepspeed.DeepSpeedTransformerLayer is tnn.TransformerKernelLayer
    assert issubclass(deepspeed.DeepSpeedTransformerConfig, tnn.TransformerKernelConfig)
    assert deepspeed.checkpointing is tachyon.checkpointing
    assert deepspeed.ops.transformer.DeepSpeedTransformerConfig is deepspeed.DeepSpeedTransformerConfig
    import tachyon.compat.deepspeed.runtime.activation_checkpointing.checkpointing as ckpt

    assert ckpt.checkpoint is tachyon.checkpointing.checkpoint and ckpt.configure is tachyon.checkpointing.configure


def test_resolving_a_compat_name_leaves_tachyons_lazy_names_intact():
    # a compat lookup must not import a submodule that shadows a lazy attribute of the same name
    deepspeed.initialize  # noqa: B018
    assert callable(tachyon.initialize) and not isinstance(tachyon.initialize, types.ModuleType)


def test_config_without_max_seq_length_is_deepspeeds_api():
    config = deepspeed.DeepSpeedTransformerConfig(batch_size=2, hidden_size=32, heads=4, attn_dropout_ratio=0.0,
                                                  hidden_dropout_ratio=0.0, num_hidden_layers=1,
                                                  initializer_range=0.02)
    layer = deepspeed.DeepSpeedTransformerLayer(config)
    out = layer(torch.randn(2, 300, 32))  # any length: DeepSpeed's config has no max_seq_length
    assert out.shape == (2, 300, 32)
    with pytest.raises(ValueError, match="heads"):
        deepspeed.DeepSpeedTransformerConfig(batch_size=2, hidden_size=30, heads=4, attn_dropout_ratio=0.0,
                                             hidden_dropout_ratio=0.0, num_hidden_layers=1, initializer_range=0.02)


def test_add_config_arguments_adds_deepspeeds_four_arguments():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and not args.deepscale
    old = parser.parse_args(["--deepscale", "--deepscale_config", "old.json"])
    assert old.deepscale and old.deepspeed_config == "old.json", "the deprecated name still reaches initialize"
    assert parser.parse_args([]).deepspeed_config is None
    with pytest.raises(TypeError, match="ArgumentParser"):
        deepspeed.add_config_arguments({})


def test_initialize_reads_the_config_from_args(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}')
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", str(path)])
    model = torch.nn.Linear(4, 2)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    before = model.weight.detach().clone()
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert isinstance(engine, tachyon.Engine) and optimizer is engine.optimizer
    assert not torch.equal(before, model.weight.detach()), "the step did not change the weights"


@pytest.mark.parametrize("key, value", [
    ("progressive_layer_drop", {"enabled": True}),
    ("optimizer", {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 7}}),
])
def test_features_reached_through_the_config_pass_unchanged(key, value):
    from tachyon.config import load_config

    config = load_config({"train_micro_batch_size_per_gpu": 1, key: value}, 1)
    section = getattr(config, key)
    if key == "progressive_layer_drop":
        assert section.enabled
    else:
        assert section.type == "OneBitAdam" and section.params["freeze_step"] == 7, section


def _tachyon_name(module: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ModuleNotFoundError, AttributeError):
        return None


def test_pipeline_names_are_tachyons_pipeline():
    import tachyon.parallel.pipeline as pipeline
    from tachyon.compat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    assert deepspeed.pipe.PipelineModule is PipelineModule is deepspeed.PipelineModule
    assert issubclass(PipelineModule, pipeline.PipelineModule)  # loss_fn optional, ProcessTopology accepted
    assert LayerSpec is pipeline.LayerSpec and TiedLayerSpec is pipeline.TiedLayerSpec


def test_lazy_names_pick_up_a_feature_as_soon_as_its_module_exists(monkeypatch):
    fake = types.ModuleType("tachyon.parallel.pipeline")

    class PipelineModule(torch.nn.Module):
        pass

    fake.PipelineModule, fake.LayerSpec = PipelineModule, object()
    monkeypatch.setitem(sys.modules, "tachyon.parallel.pipeline", fake)
    assert deepspeed.pipe.LayerSpec is fake.LayerSpec


def test_a_broken_tachyon_module_is_not_mistaken_for_a_missing_feature(monkeypatch):
    from tachyon.compat._names import Target, resolve

    # the module exists but its own import fails on something else: that error surfaces
    error = ModuleNotFoundError("No module named 'some_dependency'", name="some_dependency")
    real_import = __import__("importlib").import_module

    def failing(name, *args):
        if name == "tachyon.parallel.pipeline":
            raise error
        return real_import(name, *args)

    monkeypatch.setattr("importlib.import_module", failing)
    with pytest.raises(ModuleNotFoundError, match="some_dependency"):
        resolve("deepspeed.pipe.PipelineModule", Target((("tachyon.parallel.pipeline", "PipelineModule"),)))


def test_init_inference_calls_tachyons_engine_or_says_it_is_missing():
    if _tachyon_name("tachyon.inference", "init_inference") is None:
        with pytest.raises(NotImplementedError, match="inference engine is not in this version of tachyon"):
            deepspeed.init_inference(torch.nn.Linear(2, 2))
    else:
        with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
            deepspeed.init_inference("not a model")


def test_profiler_names_resolve_to_tachyons_profiler_or_fail_clearly():
    profiler = deepspeed.profiling.flops_profiler.FlopsProfiler
    if _tachyon_name("tachyon.profiling.flops", "FlopsProfiler") is None:
        with pytest.raises(NotImplementedError, match="flops profiler is not in this version of tachyon"):
            profiler(torch.nn.Linear(2, 2))
    else:
        assert profiler is tachyon.profiling.FlopsProfiler
        assert deepspeed.profiling.flops_profiler.get_model_profile is tachyon.profiling.get_model_profile


def test_zero_helpers_behave_as_deepspeed_below_stage_3():
    model = torch.nn.Linear(3, 3)
    with deepspeed.zero.Init(enabled=False):
        inner = torch.nn.Linear(3, 3)
    assert inner.weight.shape == (3, 3)
    with deepspeed.zero.GatheredParameters(model.parameters(), modifier_rank=0):
        model.weight.data.fill_(1.0)
    assert (model.weight == 1).all(), "parameters are whole below ZeRO-3; changes stay"
    deepspeed.zero.register_external_parameter(model, model.weight)
    assert issubclass(deepspeed.zero.Init, tachyon.zero.Init)
    assert deepspeed.zero.GatheredParameters is tachyon.zero.GatheredParameters
    with pytest.raises(RuntimeError, match="torch.distributed"):  # shards need the ranks
        deepspeed.zero.Init().__enter__()
    with pytest.raises(ValueError, match="nvme"):
        deepspeed.zero.Init(remote_device="nvme")
    with pytest.raises(NotImplementedError, match="ZeRO-3 internal"):
        deepspeed.zero.TiledLinear(3, 3)


def test_comm_maps_tachyons_startup_and_torchs_collectives():
    import torch.distributed as dist

    from tachyon.parallel import distributed as tdist

    import inspect

    assert list(inspect.signature(deepspeed.comm.init_distributed).parameters) == [
        "dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout", "init_method",
        "dist_init_required", "config", "rank", "world_size"]  # DeepSpeed's order, over tachyon's
    with pytest.raises(RuntimeError, match="dist_init_required=False.* torch.distributed is not initialized"):
        deepspeed.comm.init_distributed(dist_init_required=False)  # DeepSpeed's "use the script's": there is none
    assert not dist.is_initialized()
    assert deepspeed.comm.get_rank is tdist.get_rank and deepspeed.comm.new_group is tdist.new_group
    assert deepspeed.comm.all_reduce is dist.all_reduce and deepspeed.comm.ReduceOp is dist.ReduceOp
    assert deepspeed.comm.get_world_size() == 1 and deepspeed.comm.get_rank() == 0


def test_fused_adam_takes_deepspeeds_arguments_and_steps_like_tachyons():
    from tachyon.engine.optim import FusedAdam

    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    ours = deepspeed.ops.adam.FusedAdam(a.parameters(), 1e-2, True, (0.8, 0.99), 1e-6, True, 0.1, False, True)
    theirs = FusedAdam(b.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, adam_w_mode=True)
    assert isinstance(ours, FusedAdam)
    x = torch.randn(4, 5)
    for model, opt in ((a, ours), (b, theirs)):
        for _ in range(3):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p.detach(), q.detach(), name="FusedAdam via DeepSpeed's signature")
    with pytest.raises(NotImplementedError, match="AMSGrad"):
        deepspeed.ops.adam.FusedAdam(a.parameters(), amsgrad=True)


def test_fused_lamb_takes_deepspeeds_arguments():
    from tachyon.engine.optim import Lamb

    model = torch.nn.Linear(5, 3)
    opt = deepspeed.ops.lamb.FusedLamb(model.parameters(), lr=1e-3, weight_decay=0.01, max_coeff=5.0)
    assert isinstance(opt, Lamb) and opt.defaults["max_coeff"] == 5.0
    with pytest.raises(NotImplementedError, match="gradient_clipping"):
        deepspeed.ops.lamb.FusedLamb(model.parameters(), max_grad_norm=1.0)


def test_unknown_names_list_what_is_mapped():
    with pytest.raises(AttributeError, match=r"deepspeed\.initialise is not one of the names.*Did you mean 'initialize'"):
        deepspeed.initialise  # noqa: B018
    with pytest.raises(AttributeError, match="FusedAdam"):
        deepspeed.ops.adam.FusedAdamW  # noqa: B018
    assert not hasattr(deepspeed, "no_such_name")
    with pytest.raises(ImportError):
        from tachyon.compat.deepspeed import no_such_name  # noqa: F401


def test_unsupported_placeholders_import_and_refuse_every_use():
    from tachyon.compat.deepspeed import OnDevice  # import works

    assert not OnDevice and "meta device" in repr(OnDevice)
    for use in (lambda: OnDevice(dtype=torch.float16), lambda: OnDevice.__enter__(), lambda: OnDevice.anything):
        with pytest.raises(NotImplementedError, match=r"deepspeed\.OnDevice: .*build it normally"):
            use()


def test_optimizer_wrapper_classes_import_and_isinstance_says_why():
    from tachyon.compat.deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from tachyon.compat.deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for wrapper in (FP16_UnfusedOptimizer, FP16_Optimizer):
        with pytest.raises(NotImplementedError, match="engine.optimizer is the torch optimizer"):
            isinstance(opt, wrapper)
