"""Training the small GPT of `_pp_training` through ONE ``tachyon.initialize`` call per layout.

Same model, data, optimizer (SGD lr 0.5, momentum 0.9) and steps as `_pp_training`, but the
engine does everything the module-level tests do by hand: it reads the layout from the config
(``tensor_parallel.tp_size``, ``pipeline.stages`` / ``schedule``) or from ``mpu=`` / the
PipelineModule's mesh, applies tensor parallelism, runs the pipeline schedule
(``engine.train_batch``), averages gradients over the data-parallel axis with its ZeRO stage,
computes the global gradient norm over the whole model and steps. Every function here runs on
each rank of a `run_distributed` launch and returns plain data (full-shape parameters in GPT's
names, losses, norms, byte counts) for the test process to compare with single-process training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.parallel import _pp_training as T

H, L, F, V, S = (T.CFG[k] for k in ("hidden_size", "num_layers", "intermediate_size", "vocab_size", "max_seq_len"))


def config(*, gas: int = 2, stage: int = 0, tp: int | None = None, stages: int | str | None = None,
           schedule: str | None = None, precision: str = "fp32", scale_power: int = 8, **extra) -> dict:
    """A DeepSpeed-style config for the layout (batch sizes resolved by initialize)."""
    out = {"train_batch_size": T.GLOBAL_BATCH, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": T.LR, "momentum": T.MOMENTUM}},
           "zero_optimization": {"stage": stage}, **extra}
    if tp is not None:
        out["tensor_parallel"] = {"tp_size": tp}
    if stages is not None or schedule is not None:
        out["pipeline"] = {k: v for k, v in (("stages", stages), ("schedule", schedule)) if v is not None}
    if precision == "bf16":
        out["bf16"] = {"enabled": True}
    elif precision == "fp16":  # dynamic scale from 2^scale_power: 8 never overflows on this model
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": scale_power}
    return out


# ---------------------------------------------------------------------- single process
def reference_run(precision: str = "fp32", steps: int = T.STEPS, gas: int = 2, scale_power: int = 8,
                  stage: int = 0) -> dict:
    """GPT trained in one process: through a plain torch loop for fp32 (the oracle: state and
    the gradient norm of every step), through tachyon.initialize on one process otherwise
    (what the parallel run in that precision is compared with, with its ``gas`` micro-batches)."""
    if precision == "fp32":
        model = T.build_gpt()
        opt = T.optimizer(model.parameters())
        norms = []
        for step in range(steps):
            ids, labels = T.batch(step)
            opt.zero_grad()
            model(ids, labels=labels).backward()
            norms.append(float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))))
            opt.step()
        return {"state": {k: p.detach().clone() for k, p in model.named_parameters()}, "norms": norms}
    import tachyon

    model = T.build_gpt()
    engine, *_ = tachyon.initialize(model=model, config=config(precision=precision, gas=gas, scale_power=scale_power,
                                                               stage=stage),
                                    dist_init_required=False)
    for step in range(steps):
        _gpt_step(engine, step, dp=1, dp_rank=0, gas=gas)
    return {"state": {k: p.detach().float().clone() for k, p in model.named_parameters()},
            "skipped": engine.skipped_steps}


def initial_state() -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in T.build_gpt().named_parameters()}


# ---------------------------------------------------------------------- tensor parallel (no pipeline)
def _gpt_step(engine, step: int, dp: int, dp_rank: int, gas: int) -> None:
    ids, labels = T.batch(step)
    ids, labels = ids.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank]
    for i, l in zip(ids.chunk(gas), labels.chunk(gas)):
        engine.backward(engine(i, labels=l))
        engine.step()


def split_parameter_count(tp: int) -> int:
    """Parameters one tensor-parallel rank of the GPT holds, from the architecture: per layer QKV
    [3h, h] + [3h], proj [h, h], fc1 [F, h] + [F], fc2 [h, F] and the (tied) vocabulary [V, h]
    are split tp ways; the four norm vectors, proj's and fc2's biases, the positions [S, h] and
    the final norm are replicated."""
    split = L * (3 * H * H + 3 * H + H * H + F * H + F + H * F) + V * H
    replicated = L * 6 * H + S * H + 2 * H
    assert split % tp == 0
    return split // tp + replicated


def gpt_engine(*, tp: int, stage: int, gas: int = 2, precision: str = "fp32", mpu: str | None = None,
               sequence_parallel: bool = False):
    """(GPT, engine) under ``tensor_parallel.tp_size`` (or ``mpu=``: "tachyon" for
    Mesh(...).mpu, "megatron" for a Megatron-style object with getters only)."""
    import tachyon
    from tachyon.parallel import Mesh

    model = T.build_gpt()
    extra = {"tensor_parallel": {"tp_size": tp, "sequence_parallel": True}} if sequence_parallel else {}
    cfg = config(gas=gas, stage=stage, tp=None if (mpu or sequence_parallel) else tp, precision=precision, **extra)
    given = None
    if mpu is not None:
        mesh = Mesh(tp=tp)
        given = mesh.mpu if mpu == "tachyon" else MegatronMpu(mesh)
    engine, *_ = tachyon.initialize(model=model, config=cfg, mpu=given)
    return model, engine


def run_gpt(model, engine, steps) -> dict:
    """Train ``steps`` (their global batches); returns the full state in GPT's names, the
    engine's grad norms, the parameter bytes and the layout the engine saw."""
    from tachyon.parallel.tensor import full_state_dict, tp_group

    mesh, gas = engine.mesh, engine.gradient_accumulation_steps()
    dp, dp_rank = engine.data_parallel_world_size, engine.data_parallel_rank
    norms = []
    for step in steps:
        _gpt_step(engine, step, dp, dp_rank, gas)
        norms.append(engine.get_global_grad_norm())
    if engine.zero_optimization_stage() == 3:
        state = _stage3_full_state(model, tp_group(mesh) if mesh is not None else None)
    else:
        state = full_state_dict(model, tp_group(mesh)) if mesh is not None else model.state_dict()
    names = {name for name, _ in model.named_parameters()}
    stage3 = engine.zero_optimization_stage() == 3
    return {"state": {k: state[k].detach().float().clone() for k in names}, "norms": norms,
            "global_steps": engine.global_steps,
            "sizes": tuple(mesh.size(a) if mesh is not None else (dp if a == "dp" else 1) for a in ("dp", "pp", "tp")),
            "dp_size": dp, "num_params": engine.zero.flat.num_params, "padded": engine.zero.flat.numel,
            "stage": engine.zero_optimization_stage(),
            "local_numel": sum((p.to_local() if stage3 else p).numel() for p in model.parameters()),
            "parameter_bytes": engine.memory_breakdown()["parameters"], "skipped": engine.skipped_steps,
            "batch": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps())}


def _stage3_full_state(model, tp) -> dict[str, torch.Tensor]:
    """Every parameter of a stage-3 model at its full shape on every rank: FSDP2's dim-0 shards
    gathered over dp (``full_tensor``), then the tensor-parallel slices over tp (collectives)."""
    from tachyon.parallel.tensor.shard import shard_spec, unshard_tensor

    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor().detach()
        spec = shard_spec(p)
        if spec is not None and tp is not None and tp.size > 1:
            shards = [torch.empty_like(value) for _ in range(tp.size)]
            dist.all_gather(shards, value.contiguous(), group=tp.group)
            value = unshard_tensor(shards, spec)
        out[name] = value
    return out


def train_gpt(**kw) -> dict:
    """`gpt_engine` trained T.STEPS steps (`run_gpt`)."""
    return run_gpt(*gpt_engine(**kw), range(T.STEPS))


class MegatronMpu:
    """A Megatron-style mpu: getters only (what initialize reads through mesh_from_mpu)."""

    def __init__(self, mesh) -> None:
        self._mesh = mesh

    def get_data_parallel_rank(self):
        return self._mesh.rank("dp")

    def get_data_parallel_world_size(self):
        return self._mesh.size("dp")

    def get_data_parallel_group(self):
        return self._mesh.group("dp")

    def get_tensor_model_parallel_rank(self):
        return self._mesh.rank("tp")

    def get_tensor_model_parallel_world_size(self):
        return self._mesh.size("tp")

    def get_tensor_model_parallel_group(self):
        return self._mesh.group("tp")


# ---------------------------------------------------------------------- pipelines
def build_net(pp: int, *, tp: int = 1, per_rank: int = 1, checkpoint_func=None, interval: int = 0):
    """The GPT as a PipelineModule starting from build_gpt()'s weights; with tp > 1 over
    ``topology=Mesh(pp=, tp=)`` (tensor parallelism is applied by initialize)."""
    from tachyon.parallel import Mesh
    from tachyon.parallel.pipeline import PipelineModule
    from tachyon.parallel.pipeline.gpt import gpt_layer_specs, gpt_loss, gpt_state_dict_to_pipeline

    topology = Mesh(pp=pp, tp=tp) if tp > 1 else None
    kw = {"activation_checkpoint_func": checkpoint_func} if checkpoint_func is not None else {}
    net = PipelineModule(gpt_layer_specs(**T.CFG), num_stages=pp, topology=topology, loss_fn=gpt_loss,
                         stages_per_rank=per_rank, activation_checkpoint_interval=interval, **kw)
    net.load_full_state_dict(gpt_state_dict_to_pipeline(T.build_gpt().state_dict(), L))
    return net


def pipeline_engine(pp: int, schedule: str, *, tp: int = 1, stage: int = 1, gas: int = 4, precision: str = "fp32",
                    scale_power: int = 8, **net_kw):
    import tachyon

    net = build_net(pp, tp=tp, per_rank=2 if schedule == "interleaved_1F1B" else 1, **net_kw)
    cfg = config(gas=gas, stage=stage, stages=pp, schedule=schedule, precision=precision, scale_power=scale_power,
                 tp=tp if tp > 1 else None)
    engine, *_ = tachyon.initialize(model=net, config=cfg)
    return net, engine


def train_pipeline(pp: int, schedule: str, *, steps: int = T.STEPS, **kw) -> dict:
    """The pipeline GPT trained with ``engine.train_batch``; returns GPT-named full state, the
    tied embedding on each stage, the losses and grad norms, and an eval_batch after training."""
    net, engine = pipeline_engine(pp, schedule, **kw)
    return run_pipeline(net, engine, range(steps))


def micro_batch_iter(engine, step: int):
    """The micro-batches of ``step``'s global batch for this rank's data-parallel share."""
    dp, rank, gas = engine.data_parallel_world_size, engine.data_parallel_rank, engine.gradient_accumulation_steps()
    ids, labels = (t.chunk(dp)[rank] for t in T.batch(step))
    return iter(list(zip(ids.chunk(gas), labels.chunk(gas))))


def pipeline_state(net) -> tuple[dict, dict]:
    """(GPT-named full state of this model copy, {tied key: its copy on each stage holding it})."""
    if net.mesh is not None:
        return T.gather_pipeline_state(net)
    from tachyon.parallel.pipeline.gpt import pipeline_state_dict_to_gpt

    return pipeline_state_dict_to_gpt({k: p.detach().clone() for k, p in net.named_parameters()}, L), {}


def run_pipeline(net, engine, steps) -> dict:
    losses, norms = [], []
    for step in steps:
        losses.append(float(engine.train_batch(micro_batch_iter(engine, step))))
        norms.append(engine.get_global_grad_norm())
    state, tied = pipeline_state(net)
    loss, logits = engine.eval_batch(micro_batch_iter(engine, T.STEPS), return_logits=True)
    return {"state": {k: v.float() for k, v in state.items()}, "tied": tied, "losses": losses, "norms": norms,
            "eval": (float(loss), None if logits is None else tuple(logits.shape)),
            "skipped": engine.skipped_steps, "stage_ids": list(net.stage_ids), "global_steps": engine.global_steps}


def pipeline_bytes(pp: int, schedule: str, **kw) -> dict:
    """One steady-state ``engine.train_batch`` (after a first one that sets the stages up): every
    torch.distributed call it made (kind, axis, payload) and, per local stage, the peak bytes of
    saved activations and the bytes each micro-batch's forward saved."""
    from tachyon.parallel import CommCounter

    net, engine = pipeline_engine(pp, schedule, **kw)
    engine.train_batch(micro_batch_iter(engine, 0))
    counters = []
    for stage in net.stage_modules:
        counter = T.LiveActivations(net.parameters())
        counter.wrap(stage)
        counters.append((stage.index, counter))
    with CommCounter(engine.mesh) as comm:
        engine.train_batch(micro_batch_iter(engine, 1))
    return {"calls": [(c.kind, c.axis, c.payload) for c in comm.calls],
            "in_flight": [(index, c.peak, c.per_forward) for index, c in counters],
            "padded": engine.zero.flat.numel}


def world_rank() -> int:
    return dist.get_rank()
