"""Shared pieces of the engine tests: a small model, deterministic data, the rank-side training
loop over many configurations, and the single-process plain-PyTorch reference.

Kept out of test_* modules so the spawned gloo ranks import only this (cheap) module.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

IN, HIDDEN, OUT = 6, 13, 3  # odd sizes: parameters straddle partitions and buckets
MICRO = 2
LR, WEIGHT_DECAY = 1e-2, 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    stage: int
    precision: str = "fp32"
    gas: int = 1
    clip: float = 0.0
    overlap: bool = True
    groups: bool = False
    """Two param groups: weights with weight decay, biases and norms without."""
    optimizer: str = "torch"
    """"torch": torch.optim.AdamW via a callable; "config-adam"/"config-lamb": the config's."""
    steps: int = 20
    bucket: int | None = 40
    """reduce_bucket_size (allgather_bucket_size: 3x); None: DeepSpeed's default keys (no bucket
    keys, no overlap_comm key)."""
    accum: str | None = None
    """data_types.grad_accum_dtype (None: the precision's default)."""
    hidden: int = HIDDEN
    live: bool = False
    """Also count every live tensor storage of the process (after the last backward, inside the
    optimizer step, after the step), less what was alive before the model was built (garbage
    collected there only: a reference cycle left by training then counts as live)."""
    extra: tuple = ()
    """Top-level config (key, value) pairs to add, e.g. (("prescale_gradients", True),)."""

    @property
    def name(self) -> str:
        bucket = "default-buckets" if self.bucket is None else f"bucket{self.bucket}"
        return (
            f"stage{self.stage}-{self.precision}-gas{self.gas}-clip{self.clip:g}-"
            f"{'overlap' if self.overlap else 'sync'}-{'2groups' if self.groups else '1group'}-{self.optimizer}-"
            f"{self.steps}steps-{bucket}" + (f"-accum{self.accum}" if self.accum else "")
            + (f"-hidden{self.hidden}" if self.hidden != HIDDEN else "") + ("-live" if self.live else "")
            + "".join(f"-{k}={v}" for k, v in self.extra)
        )

    def config(self, world_size: int) -> dict:
        zero = {"stage": self.stage}
        if self.bucket is not None:
            zero.update(reduce_bucket_size=self.bucket, allgather_bucket_size=3 * self.bucket, overlap_comm=self.overlap)
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": self.gas,
            "train_batch_size": MICRO * self.gas * world_size,
            "gradient_clipping": self.clip,
            "zero_optimization": zero,
        }
        if self.accum:
            cfg["data_types"] = {"grad_accum_dtype": self.accum}
        cfg.update(dict(self.extra))
        if self.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.precision == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        if self.optimizer == "config-adam":
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
        if self.optimizer == "config-lamb":
            cfg["optimizer"] = {"type": "Lamb", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
        return cfg


def make_model(hidden: int = HIDDEN) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, OUT)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def param_groups(model: torch.nn.Module, two_groups: bool) -> list[dict]:
    if not two_groups:
        return [{"params": list(model.parameters())}]
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, micro: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
    x = torch.randn(MICRO, IN, generator=gen)
    y = torch.randn(MICRO, OUT, generator=gen)
    return x.to(dtype), y


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def train_on_rank(case: Case) -> dict:
    """Train ``case`` with tachyon.initialize on this rank; returns the final parameters (fp32
    copies), the memory breakdown after the last backward (before its step), the live-storage
    counts when ``case.live``, and the grad norms seen."""
    import torch.distributed as dist

    import tachyon
    from tachyon.engine.zero import live_tensor_bytes

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    base = live_tensor_bytes() if case.live else 0
    model = make_model(case.hidden)
    kwargs = {}
    if case.optimizer == "torch":
        kwargs["optimizer"] = lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    engine, _, _, _ = tachyon.initialize(
        model=model, model_parameters=param_groups(model, case.groups), config=case.config(world), **kwargs
    )
    live = {}
    if case.live:
        inner_step = engine.optimizer.step

        def step_and_count(*args, **kw):
            live["in step"] = live_tensor_bytes(collect=False) - base
            return inner_step(*args, **kw)

        engine.optimizer.step = step_and_count
    dtype = DTYPES[case.precision]
    norms = []
    for step in range(case.steps):
        for micro in range(case.gas):
            x, y = batch(step, micro, rank, dtype)
            engine.backward(loss_fn(engine(x.to(engine.device)), y.to(engine.device)))
            del x, y
            if step == case.steps - 1 and micro == case.gas - 1:
                memory = engine.memory_breakdown()
                if case.live:
                    live["after backward"] = live_tensor_bytes(collect=False) - base
            engine.step()
        norms.append(engine.get_global_grad_norm())
    if case.live:
        live["after step"] = live_tensor_bytes(collect=False) - base
    return {
        "params": [p.detach().float().cpu().clone() for p in model.parameters()],
        "memory": memory,
        "live": live,
        "psi": engine.zero.flat.num_params,
        "padded": engine.zero.flat.numel,
        "norms": norms,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
    }


def reference_train(case: Case, world_size: int, device: str = "cpu") -> dict:
    """Plain PyTorch, one process, the same global batch: the micro-batches of every rank and
    micro-step accumulated (in fp32 for bf16/fp16 models, with fp32 master weights), the global
    norm clipped like torch.nn.utils.clip_grad_norm_, one optimizer step per batch."""
    from tachyon.engine.optim import FusedAdam, Lamb

    model = make_model(case.hidden)
    dtype = DTYPES[case.precision]
    model.to(device=device, dtype=dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    groups = [
        dict(g, params=[masters[index[id(p)]] for p in g["params"]]) for g in param_groups(model, case.groups)
    ]
    if case.optimizer == "torch":
        opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    elif case.optimizer == "config-adam":
        opt = FusedAdam(groups, lr=LR, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
    else:
        opt = Lamb(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for step in range(case.steps):
        acc = [torch.zeros_like(m) for m in masters]
        for micro in range(case.gas):
            for rank in range(world_size):
                x, y = batch(step, micro, rank, dtype)
                (loss_fn(model(x.to(device)), y.to(device)) / (case.gas * world_size)).backward()
                for a, p in zip(acc, params):
                    a.add_(p.grad.float())
                    p.grad = None
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a) for a in acc]))
        norms.append(float(norm))
        if case.clip > 0:
            coef = min(1.0, case.clip / (float(norm) + 1e-6))
            for a in acc:
                a.mul_(coef)
        for m, a in zip(masters, acc):
            m.grad = a
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return {"params": [p.detach().float().cpu().clone() for p in params], "norms": norms}


def run_cases(cases: list[Case]) -> dict[str, dict]:
    """Rank-side entry point: every case in this one process group launch. Tensors come back
    as nested lists (tensors in a multiprocessing queue would outlive their process)."""
    torch.manual_seed(0)
    out = {}
    for case in cases:
        result = train_on_rank(case)
        result["params"] = [p.tolist() for p in result["params"]]
        out[case.name] = result
    return out


def as_tensors(values: list) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float32) for v in values]


# ---------------------------------------------------------------------- fp16 overflow
FP16_SCALE_POWER, FP16_WINDOW = 8, 3


def _snapshot(engine) -> list[torch.Tensor]:
    tensors = [engine.zero.flat.buffer, *engine.zero.masters]
    for master in engine.zero.masters:
        tensors.extend(v for v in engine.optimizer.state[master].values() if torch.is_tensor(v))
    return [t.detach().clone() for t in tensors]


def fp16_overflow_on_rank(stage: int, inject: list[bool]) -> dict:
    """fp16 training with dynamic loss scaling; on the steps where ``inject[step]`` the LAST
    rank alone puts an inf into one gradient element. Returns per step: the loss scale after
    the step, whether all parameters, masters and optimizer states stayed bit-identical, and
    the skipped/global step counters."""
    import torch.distributed as dist

    import tachyon

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = make_model()
    config = Case(stage=stage, precision="fp16").config(world)
    config["fp16"] = {"enabled": True, "initial_scale_power": FP16_SCALE_POWER, "loss_scale_window": FP16_WINDOW}
    engine, optimizer, _, _ = tachyon.initialize(
        model=model, config=config, optimizer=lambda g: torch.optim.AdamW(g, lr=LR)
    )
    poison = {"on": False}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if poison["on"]:
            grad = grad.clone()
            grad.view(-1)[1] = float("inf")
        return grad

    model[0].weight.register_hook(hook)
    scales, unchanged = [], []
    for step, bad in enumerate(inject):
        before = _snapshot(engine) if step > 0 else None
        poison["on"] = bad and rank == world - 1
        x, y = batch(step, 0, rank, torch.float16)
        engine.backward(loss_fn(engine(x.to(engine.device)), y.to(engine.device)))
        engine.step()
        after = _snapshot(engine)
        unchanged.append(before is not None and all(torch.equal(a, b) for a, b in zip(before, after)))
        scales.append(engine.loss_scale)
    return {
        "scales": scales,
        "unchanged": unchanged,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


# ---------------------------------------------------------------------- failing ranks
def _engine_with_group_timeout(timeout_s: float, stage: int):
    """(engine, rank, world size): torch.distributed started with a ``timeout_s`` group timeout,
    then an engine at ZeRO ``stage`` over `make_model`."""
    import datetime

    import torch.distributed as dist

    import tachyon
    from tachyon.parallel.distributed import init_distributed

    init_distributed(timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = tachyon.initialize(
        model=make_model(), config=Case(stage=stage).config(world), optimizer=lambda g: torch.optim.AdamW(g, lr=LR)
    )
    return engine, rank, world


def rank_dies_mid_training(timeout_s: float) -> None:
    """The last rank exits abruptly before its 3rd backward; the others must raise."""
    import os

    engine, rank, world = _engine_with_group_timeout(timeout_s, stage=2)
    for step in range(4):
        if step == 2 and rank == world - 1:
            os._exit(3)
        x, y = batch(step, 0, rank, torch.float32)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def rank_hangs_mid_training(timeout_s: float, hang_s: float) -> None:
    """The last rank sleeps ``hang_s`` before its 3rd backward; the others must raise after
    the data-parallel group's ``timeout_s``."""
    import time

    from tachyon.engine.zero import CollectiveError

    engine, rank, world = _engine_with_group_timeout(timeout_s, stage=1)
    for step in range(4):
        if step == 2 and rank == world - 1:
            time.sleep(hang_s)
        start = time.monotonic()
        x, y = batch(step, 0, rank, torch.float32)
        try:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        except CollectiveError as error:
            raise CollectiveError(f"{error} [failed after {time.monotonic() - start:.1f} s]") from error


# ---------------------------------------------------------------------- bytes on the wire
COLLECTIVES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    """Bytes a collective moves, as the ZeRO paper counts them: the reduce-scatter's input (the
    whole bucket), the all-gather's output (the whole bucket), the all-reduced tensor; anything
    else: every tensor argument."""
    tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        tensors = [args[1] if len(args) > 1 else kwargs["input"]]
    elif name in ("all_gather_single", "all_gather_into_tensor"):
        tensors = [args[0] if args else kwargs["output_tensor"]]
    return sum(t.numel() * t.element_size() for t in tensors)


def collective_bytes_on_rank(case: Case) -> dict:
    """Train ``case`` for its steps; during the last one every torch.distributed collective is
    wrapped and recorded as (name, dtype, bytes) (a collective that calls another under an older
    name is recorded once). Also returns the padded flat size and the number of buckets."""
    import torch.distributed as dist

    import tachyon

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(case.hidden)
    engine, _, _, _ = tachyon.initialize(model=model, config=case.config(world),
                                         optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
    calls, depth, originals = [], [0], {}

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
                calls.append((name, str(first.dtype) if first is not None else "", _payload(name, args, kwargs)))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    dtype = DTYPES[case.precision]
    for step in range(case.steps):
        if step == case.steps - 1:
            originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
            for name, fn in originals.items():
                setattr(dist, name, wrap(name, fn))
        try:
            for micro in range(case.gas):
                x, y = batch(step, micro, rank, dtype)
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
    return {"calls": calls, "padded": engine.zero.flat.numel, "buckets": len(engine.zero.buckets.buckets),
            "groups": len(engine.zero.flat.regions)}


def rank_main(cases: list[Case], overflow_stages: list[int], inject: list[bool], comm_cases: list[Case]) -> dict:
    """Everything one world size checks, in ONE launch (spawning ranks costs seconds)."""
    out = {"cases": run_cases(cases)}
    out["overflow"] = {stage: fp16_overflow_on_rank(stage, inject) for stage in overflow_stages}
    out["comm"] = {case.name: collective_bytes_on_rank(case) for case in comm_cases}
    return out
