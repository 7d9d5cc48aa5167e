"""tachyon.initialize and the Engine's API in one process: arguments, queries, the dataloader,
config sources, and bad input failing before any training state exists."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.distributed as dist

import tachyon
from tachyon.config import ConfigError
from tests.engine.zero_cases import LR, Case, batch, loss_fn, make_model
from tests.utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}


def adamw(groups):
    return torch.optim.AdamW(groups, lr=LR)


def train_micro_step(engine, step: int, micro: int) -> None:
    """One micro-step on this test's deterministic data (on the engine's device)."""
    x, y = batch(step, micro, 0, torch.float32)
    engine.backward(loss_fn(engine(x.to(engine.device)), y.to(engine.device)))
    engine.step()


def test_initialize_returns_engine_optimizer_loader_scheduler_and_trains():
    model = make_model()
    engine, optimizer, loader, scheduler = tachyon.initialize(model=model, optimizer=adamw, config=BASE)
    assert isinstance(engine, tachyon.Engine) and engine.module is model
    assert isinstance(optimizer, torch.optim.AdamW) and loader is None and scheduler is None
    assert engine.train_batch_size() == 4
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 2
    assert engine.zero_optimization_stage() == 0
    assert engine.get_lr() == [LR]
    assert engine.get_global_grad_norm() is None
    before = [p.detach().clone() for p in model.parameters()]
    boundaries = []
    for micro in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        train_micro_step(engine, 0, micro)
    assert boundaries == [False, True, False, True]
    assert (engine.micro_steps, engine.global_steps, engine.skipped_steps) == (4, 2, 0)
    assert engine.get_global_grad_norm() > 0
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_parameters_become_views_into_one_flat_buffer():
    model = make_model()
    engine, *_ = tachyon.initialize(model=model, optimizer=adamw, config=dict(BASE, zero_optimization={"stage": 1}))
    flat = engine.zero.flat.buffer
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert engine.zero.flat.num_params == sum(p.numel() for p in model.parameters())
    # fp32 masters alias the model buffer: the optimizer holds one flat tensor per group
    (master,) = engine.optimizer.param_groups[0]["params"]
    assert master.dim() == 1 and master.data_ptr() == flat.data_ptr()


def test_bf16_casts_the_model_and_keeps_fp32_masters():
    model = make_model()
    engine, optimizer, *_ = tachyon.initialize(model=model, optimizer=adamw, config=dict(BASE, bf16={"enabled": True}))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    (master,) = optimizer.param_groups[0]["params"]
    assert master.dtype == torch.float32
    assert_close(master[: model[0].weight.numel()], model[0].weight.float().reshape(-1), rtol=0, atol=0)
    assert engine.precision.grad_accum_dtype == torch.bfloat16  # DeepSpeed's default: accumulate in bf16


def test_train_and_eval_switch_the_module():
    model = make_model()
    engine, *_ = tachyon.initialize(model=model, optimizer=adamw, config=BASE)
    assert engine.eval() is engine and not model.training
    engine.train()
    assert model.training
    model.custom_attribute = 7
    assert engine.custom_attribute == 7  # attribute access falls through to the module


def test_training_data_gives_a_distributed_loader_with_micro_batches_and_collate_fn():
    data = [(torch.full((3,), float(i)), i) for i in range(10)]
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])

    engine, _, loader, _ = tachyon.initialize(
        model=make_model(), optimizer=adamw, training_data=data, collate_fn=collate, config=BASE
    )
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    assert loader.sampler.num_replicas == 1 and loader.sampler.rank == 0
    xs, ys = next(iter(loader))
    assert xs.shape == (2, 3) and ys.shape == (2,) and seen == [2]
    assert sorted(int(y) for _, ys in loader for y in ys) == list(range(10))
    assert loader is engine.training_dataloader


def test_config_from_args_deepspeed_config_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(dict(BASE, gradient_clipping=1.0)))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, *_ = tachyon.initialize(args=args, model=make_model(), optimizer=adamw)
    assert engine.config.gradient_clipping == 1.0
    engine, *_ = tachyon.initialize(args=argparse.Namespace(config=str(path)), model=make_model(), optimizer=adamw)
    assert engine.config.gradient_clipping == 1.0
    with pytest.raises(ValueError, match="config is given twice"):
        tachyon.initialize(args=args, config=BASE, model=make_model(), optimizer=adamw)
    # an explicit config wins over args.config (scripts use that name for model configs too)
    engine, *_ = tachyon.initialize(args=argparse.Namespace(config="model.yaml"), config=BASE,
                                    model=make_model(), optimizer=adamw)
    assert engine.config.gradient_clipping == 0.0


def test_optimizer_and_scheduler_from_the_config():
    config = dict(
        BASE,
        optimizer={"type": "Adam", "params": {"lr": 0.1}},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                   "warmup_num_steps": 4, "warmup_type": "linear"}},
    )
    engine, optimizer, _, scheduler = tachyon.initialize(model=make_model(), config=config)
    assert type(optimizer).__name__ == "FusedAdam" and scheduler is not None
    lrs = []
    for step in range(3):
        for micro in range(2):
            train_micro_step(engine, step, micro)
        lrs.append(engine.get_lr()[0])
    assert lrs[0] < lrs[1] < lrs[2] <= 0.1, lrs


def test_a_torch_optimizer_instance_is_rebound_to_the_flat_masters():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, opt, _, sched = tachyon.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=dict(BASE, zero_optimization={"stage": 2})
    )
    assert opt is optimizer and sched is scheduler
    assert opt.param_groups[0]["params"] == engine.zero.masters
    w0 = model[0].weight.detach().clone()
    for micro in range(2):
        train_micro_step(engine, 0, micro)
    assert not torch.equal(w0, model[0].weight) and engine.get_lr() == [0.25]


def test_one_flat_master_per_param_group_with_segments():
    model = make_model()
    groups = [{"params": [model[0].weight, model[3].weight]},
              {"params": [model[0].bias, model[2].weight, model[2].bias, model[3].bias], "weight_decay": 0.0}]
    engine, optimizer, *_ = tachyon.initialize(model=model, model_parameters=groups, optimizer=adamw, config=BASE)
    assert len(optimizer.param_groups) == 2 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert "segments" not in optimizer.param_groups[0], "only LAMB needs the segment table"
    model = make_model()
    groups = [{"params": [model[0].weight, model[3].weight]},
              {"params": [model[0].bias, model[2].weight, model[2].bias, model[3].bias], "weight_decay": 0.0}]
    lamb = dict(BASE, optimizer={"type": "Lamb", "params": {"lr": 1e-3}})
    engine, optimizer, *_ = tachyon.initialize(model=model, model_parameters=groups, config=lamb)
    segments = optimizer.param_groups[0]["segments"]
    assert segments.tolist() == [[0, 78, 0], [78, 39, 1]] and optimizer.param_groups[0]["num_segments"] == 2
    assert optimizer.norm_reducer(torch.ones(2)).tolist() == [1.0, 1.0]


def _bad(config_update=None, **kwargs):
    model = make_model()
    model_before = [(p.data_ptr(), p.dtype, p.detach().clone()) for p in model.parameters()]
    config = dict(BASE, **(config_update or {}))
    with pytest.raises((ConfigError, ValueError)) as info:
        tachyon.initialize(model=model, config=config, **kwargs)
    # nothing was created: the model is untouched (same storage, dtype, values, no hooks)
    for (ptr, dtype, value), p in zip(model_before, model.parameters()):
        assert p.data_ptr() == ptr and p.dtype == dtype and torch.equal(p, value)
        assert not p._post_accumulate_grad_hooks
    assert not (dist.is_available() and dist.is_initialized())
    return str(info.value)


@pytest.mark.parametrize(
    "update, expected",
    [
        ({"zero_optimisation": {"stage": 1}}, "did you mean 'zero_optimization'"),
        ({"train_batch_size": "8"}, "`train_batch_size`"),
        ({"train_batch_size": 6, "gradient_accumulation_steps": 2}, "inconsistent batch sizes"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"optimizer": {"type": "Adamm"}}, "`optimizer.type`"),
        ({"scheduler": {"type": "WarmUpLRR"}}, "`scheduler.type`"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "`fp16.enabled` and `bf16.enabled`"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ],
    ids=["unknown-key", "wrong-type", "batch-sizes", "stage4", "optimizer", "scheduler", "fp16+bf16", "negative-clip"],
)
def test_bad_config_fails_before_any_state_is_created(update, expected):
    assert expected in _bad(update)


def test_bad_config_in_a_launched_job_creates_no_process_group(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29599")
    try:
        assert "zero_optimization.stage" in _bad({"zero_optimization": {"stage": 4}})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_optimizer_given_twice_is_an_error():
    optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert "optimizer" in _bad(optimizer, optimizer=adamw)


def test_bad_arguments_are_value_errors():
    assert "mpu should be a model-parallel unit with get_data_parallel_rank()" in _bad(mpu=object())
    assert "dist_init_required=True" in _bad(dist_init_required=True)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        tachyon.initialize(model=lambda x: x, config=BASE)
    with pytest.raises(ConfigError, match="no config"):
        tachyon.initialize(model=make_model())
    model = make_model()
    used = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    used.step()
    with pytest.raises(ValueError, match="already has state"):
        tachyon.initialize(model=model, optimizer=used, config=BASE)


def test_backward_rejects_a_non_scalar_loss():
    engine, *_ = tachyon.initialize(model=make_model(), optimizer=adamw, config=BASE)
    with pytest.raises(ValueError, match="scalar"):
        engine.backward(engine(torch.randn(2, 6, device=engine.device)))


def test_memory_breakdown_single_process_fp32_stage0():
    model = make_model()
    engine, *_ = tachyon.initialize(model=model, optimizer=adamw, config=Case(stage=0).config(1))
    train_micro_step(engine, 0, 0)
    x, y = batch(1, 0, 0, torch.float32)
    engine.backward(loss_fn(engine(x.to(engine.device)), y.to(engine.device)))  # gradients held until the step
    memory = engine.memory_breakdown()
    psi = engine.zero.flat.numel  # padded element count
    # fp32: masters alias the model, so 4 (params) + 4 (grads) + 8 (Adam moments) bytes each
    assert memory["parameters"] == 4 * psi and memory["gradients"] == 4 * psi
    assert memory["master_weights"] == 0 and memory["optimizer_states"] == 8 * psi + 4  # + the step scalar
    assert memory["model_states"] == 16 * psi + 4 and memory["buckets"] == 0
    engine.step()
    assert engine.memory_breakdown()["gradients"] == 0  # freed by the step


def test_initializing_the_same_model_twice_trains_like_a_fresh_engine():
    from tests.engine.zero_cases import train_on_rank

    case = Case(stage=2, gas=2, clip=0.5, steps=3)
    fresh = train_on_rank(case)
    model = make_model()
    tachyon.initialize(model=model, optimizer=adamw, config=case.config(1))  # abandoned engine
    engine, *_ = tachyon.initialize(model=make_model(), optimizer=adamw, config=case.config(1))
    engine2, *_ = tachyon.initialize(model=model, optimizer=adamw, config=case.config(1))
    for step in range(case.steps):
        for micro in range(case.gas):
            x, y = batch(step, micro, 0, torch.float32)
            engine2.backward(loss_fn(engine2(x.to(engine2.device)), y.to(engine2.device)))
            engine2.step()
    for actual, expected in zip(model.parameters(), fresh["params"]):
        assert_close(actual.detach().cpu(), expected, rtol=0, atol=0, name="parameter after re-initialize")
    del engine


def test_an_optimizer_callable_gets_plain_parameters_like_deepspeed():
    received = []

    def build(params):
        params = list(params)
        received.append(params)
        return torch.optim.SGD(params, lr=0.1)

    engine, optimizer, *_ = tachyon.initialize(model=make_model(), optimizer=build, config=BASE)
    assert all(isinstance(p, torch.Tensor) for p in received[0]) and received[0] == engine.zero.masters
    assert "num_segments" not in optimizer.param_groups[0]  # SGD needs no segment table

    def build_lamb(params):
        from tachyon.engine.optim.lamb import Lamb

        return Lamb(list(params), lr=1e-3)

    engine, optimizer, *_ = tachyon.initialize(model=make_model(), optimizer=build_lamb, config=BASE)
    assert optimizer.param_groups[0]["num_segments"] == 6  # LAMB's segments attached after construction
