"""tachyon.engine.onebit_hooks: who averages what, binding a 1-bit optimizer to a ZeRO strategy,
and on 2 gloo ranks the real engine (gradient accumulation 2) training OneBitAdam and OneBitLamb
at ZeRO stage 0 (gradient all-reduce skipped, momentum compressed) and stage 2 (compressed bucket
reduce-scatter): close to uncompressed Adam/LAMB, the gradient bytes, fp16 and bf16 (at stages 2,
1 and 0), and an engine checkpoint mid-compression that resumes identically with the error
buffers restored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tachyon.engine.onebit_hooks import (
    OneBitComm,
    averages_gradients,
    bind_onebit_optimizer,
    error_feedback_state,
    reduce_gradients,
)
from tachyon.engine.optim import FusedAdam, OneBitAdam, OneBitLamb
from tachyon.engine.zero import DataParallelComm, build_zero_strategy
from tests.engine.test_onebit_adam import CONVERGENCE_RTOL, WIRE_RATIO_LIMIT, GLOBAL_BATCH, labelled, make_models
from tests.utils import run_distributed


def _step(optimizer, params) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()


# ---------------------------------------------------------------------- single process
def test_who_averages():
    params = [torch.nn.Parameter(torch.randn(4))]
    assert averages_gradients(FusedAdam(params))
    onebit = OneBitAdam(params, freeze_step=1)
    assert averages_gradients(onebit) and reduce_gradients(onebit, params)
    _step(onebit, params)
    assert not averages_gradients(onebit) and not reduce_gradients(onebit, params)
    onebit.reduce_momentum = False  # ZeRO: the reduce-scatter averages (compressed) in both stages
    assert averages_gradients(onebit)


def _strategy(stage: int):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    return build_zero_strategy(stage, [{"params": list(model.parameters())}], model_dtype=torch.float32,
                               grad_accum_dtype=torch.float32, comm=DataParallelComm(None),
                               device=torch.device("cpu"))


def test_bind_on_stage0_sets_segments_and_the_averaging_switch():
    zero = _strategy(0)
    opt = OneBitLamb(zero.optimizer_param_groups(with_segments=False), freeze_step=1)
    assert bind_onebit_optimizer(opt, zero)
    group = opt.param_groups[0]
    assert group["num_segments"] == 4 and group["segments"][:, 1].tolist() == [35, 7, 21, 3]
    assert opt.reduce_momentum and zero._local_gradients() is False
    _step(opt, group["params"])
    assert zero._local_gradients() is True  # stage 0 stops averaging: the optimizer does it
    assert not isinstance(zero.comm, OneBitComm)


def test_bind_on_stage2_wraps_the_comm():
    zero = _strategy(2)
    opt = OneBitAdam(zero.optimizer_param_groups(with_segments=False), freeze_step=1)
    assert bind_onebit_optimizer(opt, zero)
    assert isinstance(zero.comm, OneBitComm) and opt.gradient_reducer is zero.comm
    assert opt.reduce_momentum is False and zero.comm.world_size == 1
    assert "gradient_error_feedback" in error_feedback_state(opt)
    _step(opt, opt.param_groups[0]["params"])
    assert opt.in_compression_stage and zero._local_gradients() is False  # stages 1/2 keep reducing


def test_bind_refuses_foreign_params_and_ignores_other_optimizers():
    zero = _strategy(0)
    assert bind_onebit_optimizer(FusedAdam(zero.optimizer_param_groups(with_segments=False)), zero) is False
    with pytest.raises(ValueError, match="not the ZeRO strategy's masters"):
        bind_onebit_optimizer(OneBitAdam([torch.nn.Parameter(torch.randn(3))]), zero)


# ---------------------------------------------------------------------- the engine, 2 ranks
STEPS, GAS = 120, 2
FREEZE = {"adam": 40, "lamb": 80}
"""40 compressed steps for LAMB, 80 for Adam: long enough for the error feedback to matter (the
1-bit runs end 0.28% / 1.62% / 1.22% above the uncompressed ones: stage-0 Adam, stage-2 Adam,
stage-2 LAMB), and the checkpoint 20 steps into compression still has buffers to restore."""
LR = {"adam": 3e-3, "lamb": 1e-2}
CASES = [(0, "adam"), (2, "adam"), (2, "lamb")]
LOW_PRECISION = [("fp16", 2), ("bf16", 1), ("bf16", 0)]
LOW_PRECISION_STEPS, LOW_PRECISION_FREEZE = 30, 10
"""20 compressed steps in fp16 / bf16: the loss falls from 2.09 to about 1.12 (the test asks for 0.3)."""


def _engine(kind: str, onebit: bool, world: int, stage: int = 2, precision: str = "fp32", freeze: int | None = None):
    import tachyon
    from tachyon.engine.optim import Lamb

    teacher, model = make_models()
    lr, freeze = LR[kind], freeze or FREEZE[kind]
    build = None
    if not onebit:
        build = (lambda params: FusedAdam(params, lr=lr)) if kind == "adam" else (lambda params: Lamb(params, lr=lr))
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world * GAS), "gradient_accumulation_steps": GAS,
              "steps_per_print": 100_000,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096, "overlap_comm": True}}
    if onebit:  # DeepSpeed's config: the engine builds and binds the optimizer itself
        config["optimizer"] = {"type": "OneBitAdam" if kind == "adam" else "OneBitLamb",
                               "params": {"lr": lr, "freeze_step": freeze, "comm_backend_name": "gloo"}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 20}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, optimizer, _, _ = tachyon.initialize(model=model, optimizer=build, config=config)
    if onebit:
        assert isinstance(optimizer, OneBitAdam if kind == "adam" else OneBitLamb), type(optimizer)
        if stage:  # bound by the engine: its ZeRO reduce-scatters go through the optimizer's compressor
            assert optimizer.gradient_reducer is engine.zero.comm, "the engine did not bind the 1-bit optimizer"
        else:
            assert optimizer.reduce_momentum and optimizer.group is engine.zero.comm.group
    return teacher, model, engine


def _engine_steps(engine, teacher, steps: range, rank: int, world: int, count_steps=()) -> dict:
    from tachyon.parallel.tensor.comm_counter import CommCounter

    counted = {}
    for step in steps:
        x, y = labelled(1000 + step, GLOBAL_BATCH, teacher)
        mine_x, mine_y = x[rank::world], y[rank::world]
        micro = len(mine_x) // GAS
        counter = CommCounter()
        if step in count_steps:
            counter.__enter__()
        for m in range(GAS):
            xs, ys = mine_x[m * micro:(m + 1) * micro], mine_y[m * micro:(m + 1) * micro]
            engine.backward(F.cross_entropy(engine(xs.to(next(engine.module.parameters()).dtype)).float(), ys))
            engine.step()
        if step in count_steps:
            counter.__exit__()
            counted[step] = {kind: counter.bytes(kind=kind, field="sent")
                             for kind in ("reduce_scatter", "all_to_all", "all_gather", "all_reduce")}
    return counted


def _eval(model, teacher) -> float:
    x, y = labelled(7, 4096, teacher)
    with torch.no_grad():
        return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y).item()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).clone()


def engine_rank_main(checkpoint_dir: str) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out: dict = {}
    for stage, kind in CASES:
        key = f"stage{stage} {kind}"
        teacher, model, engine = _engine(kind, False, world, stage)
        counted = _engine_steps(engine, teacher, range(STEPS), rank, world, count_steps=(FREEZE[kind],))
        out[f"{key} reference"] = _eval(model, teacher)
        out[f"{key} warm-up bytes"] = counted[FREEZE[kind]]
        teacher, model, engine = _engine(kind, True, world, stage)
        resume_at = FREEZE[kind] + 20
        counted = _engine_steps(engine, teacher, range(resume_at), rank, world, count_steps=(FREEZE[kind] + 1,))
        out[f"{key} compressed bytes"] = counted[FREEZE[kind] + 1]
        checkpointed = (stage, kind) == (2, "adam")
        if checkpointed:
            engine.save_checkpoint(checkpoint_dir, tag="mid")
            errors = error_feedback_state(engine.optimizer)
        _engine_steps(engine, teacher, range(resume_at, STEPS), rank, world)
        out[f"{key} onebit"] = _eval(model, teacher)
        out[f"{key} params"] = _flat(model)
        if checkpointed:
            out["error buckets"] = len(errors["gradient_error_feedback"]["worker_errors"])
            teacher, model, engine = _engine(kind, True, world, stage)
            engine.load_checkpoint(checkpoint_dir, tag="mid")  # restores the error buffers itself
            _engine_steps(engine, teacher, range(resume_at, STEPS), rank, world)
            out["resumed params"] = _flat(model)
    # low precision: fp16 compresses scaled gradients (the error buffers follow the loss scale);
    # bf16 reduces in bf16 (stage 1: at the boundary only; stage 0: momentum in fp32)
    for precision, stage in LOW_PRECISION:
        teacher, model, engine = _engine("adam", True, world, stage, precision=precision, freeze=LOW_PRECISION_FREEZE)
        before = _eval(model, teacher)
        _engine_steps(engine, teacher, range(LOW_PRECISION_STEPS), rank, world)
        opt = engine.optimizer
        errors = ([r.worker_error for r in opt.gradient_reducer._reducers.values()] if stage else
                  [opt._compressor.worker_error, opt._compressor.server_error])
        out[f"{precision} stage{stage}"] = {
            "before": before, "after": _eval(model, teacher), "params": _flat(model),
            "compressing": opt.in_compression_stage,
            "errors": len(errors), "errors_finite": all(bool(torch.isfinite(e).all()) for e in errors),
            "errors_nonzero": all(bool(e.any()) for e in errors), "scale": engine.precision.loss_scale}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("onebit_engine"))
    return run_distributed(engine_rank_main, 2, path, timeout=900)


@pytest.mark.distributed
@pytest.mark.parametrize("stage, kind", CASES)
def test_engine_converges_close_to_uncompressed(runs, stage, kind):
    key = f"stage{stage} {kind}"
    for rank, r in enumerate(runs):
        gap = (r[f"{key} onebit"] - r[f"{key} reference"]) / r[f"{key} reference"]
        assert gap <= CONVERGENCE_RTOL, (f"rank {rank}: 1-bit {key} ends at {r[f'{key} onebit']:.4f}, "
                                         f"{100 * gap:.2f}% above {r[f'{key} reference']:.4f}")
        assert torch.equal(r[f"{key} params"], runs[0][f"{key} params"]), f"rank {rank}: parameters differ"


@pytest.mark.distributed
@pytest.mark.parametrize("stage, kind", CASES)
def test_engine_gradient_traffic_is_compressed(runs, stage, kind):
    key = f"stage{stage} {kind}"
    plain = "all_reduce" if stage == 0 else "reduce_scatter"
    for rank, r in enumerate(runs):
        warm, compressed = r[f"{key} warm-up bytes"], r[f"{key} compressed bytes"]
        assert warm[plain] > 0 and warm["all_to_all"] == 0, warm
        assert compressed[plain] <= 8 and compressed["all_to_all"] > 0, compressed  # 8: LAMB's norm reductions
        sent = compressed["all_to_all"] + (compressed["all_gather"] if stage == 0 else 0)
        ratio = sent / warm[plain]
        assert ratio <= WIRE_RATIO_LIMIT, f"rank {rank}: {key} gradient bytes {ratio:.4f} of the fp32 {plain}"
        if stage == 2:  # ZeRO's parameter all-gather after the step is not compressed
            assert compressed["all_gather"] == warm["all_gather"]


@pytest.mark.distributed
def test_engine_checkpoint_mid_compression_resumes_identically(runs):
    for rank, r in enumerate(runs):
        assert r["error buckets"] > 1, "no bucket error buffers were saved; the test proves nothing"
        assert torch.equal(r["resumed params"], r["stage2 adam params"]), f"rank {rank}: the resumed run differs"


@pytest.mark.distributed
@pytest.mark.parametrize("precision, stage", LOW_PRECISION)
def test_engine_low_precision_compressed_training(runs, precision, stage):
    key = f"{precision} stage{stage}"
    for rank, r in enumerate(runs):
        got = r[key]
        assert got["compressing"] and got["errors"] >= 1 and got["errors_nonzero"], f"rank {rank}: {got}"
        assert got["errors_finite"], f"rank {rank}: inf/NaN in the error buffers: {got}"
        assert got["after"] < got["before"] - 0.3, f"rank {rank}: {key} 1-bit training did not learn: {got}"
        assert torch.equal(got["params"], runs[0][key]["params"]), f"rank {rank}: parameters differ"
