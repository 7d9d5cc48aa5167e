"""Rank-side pieces of the ZeRO stage 3 tests (tests/engine/test_zero3.py): training through
tachyon.initialize at stage 3 and returning full fp32 parameters, gradient norms and memory.

Kept out of test_* modules so the spawned gloo ranks import only this (cheap) module. The
model, data, loss and the single-process reference are the stage 0-2 tests' (zero_cases.py).
"""

from __future__ import annotations

import dataclasses

import torch

from tests.engine.zero3_compose_cases import compose_scenarios
from tests.engine.zero3_hf_cases import hf_scenarios
from tests.engine.zero_cases import (
    DTYPES,
    LR,
    MICRO,
    WEIGHT_DECAY,
    Case,
    batch,
    loss_fn,
    make_model,
    param_groups,
)


@dataclasses.dataclass(frozen=True)
class Z3Case:
    precision: str = "fp32"
    gas: int = 1
    clip: float = 0.0
    groups: bool = False
    optimizer: str = "torch"
    steps: int = 5
    units: tuple[str, ...] = ("Linear",)
    """zero_optimization.shard_module_classes: each Linear its own FSDP2 unit (the rest in the root)."""
    comm: str | None = None
    """communication_data_type (None: the model dtype)."""
    prefetch: bool = True
    stage: int = 3
    offload: str | None = None
    """"optimizer": offload_optimizer to the CPU; "param": offload_param (and the optimizer) to the CPU."""

    @property
    def name(self) -> str:
        return (f"z{self.stage}-{self.precision}-gas{self.gas}-clip{self.clip:g}-{'2groups' if self.groups else '1group'}-"
                f"{self.optimizer}-{self.steps}steps-units{'+'.join(self.units) or 'root'}"
                + (f"-comm{self.comm}" if self.comm else "") + ("" if self.prefetch else "-noprefetch")
                + (f"-offload-{self.offload}" if self.offload else ""))

    def as_case(self) -> Case:
        """The stage 0-2 tests' case with the same training (for `reference_train`)."""
        return Case(stage=0, precision=self.precision, gas=self.gas, clip=self.clip, groups=self.groups,
                    optimizer=self.optimizer, steps=self.steps)

    def config(self, world_size: int) -> dict:
        zero: dict = {"stage": self.stage}
        if self.stage == 3:
            zero["shard_module_classes"] = list(self.units)
            if not self.prefetch:
                zero["stage3_prefetch_bucket_size"] = 0
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload == "param":
            zero["offload_param"] = {"device": "cpu"}
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": self.gas,
            "train_batch_size": MICRO * self.gas * world_size,
            "gradient_clipping": self.clip,
            "zero_optimization": zero,
        }
        if self.comm:
            cfg["communication_data_type"] = self.comm
        if self.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.precision == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        if self.optimizer == "config-adam":
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
        return cfg


def full_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter whole, fp32 (a collective at stage 3: DTensor.full_tensor)."""
    out = []
    for p in model.parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(value.detach().float().cpu().clone())
    return out


def train_z3_on_rank(case: Z3Case) -> dict:
    import torch.distributed as dist

    import tachyon

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    kwargs = {}
    if case.optimizer == "torch":
        kwargs["optimizer"] = lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    engine, _, _, _ = tachyon.initialize(model=model, model_parameters=param_groups(model, case.groups),
                                         config=case.config(world), **kwargs)
    dtype = DTYPES[case.precision]
    norms = []
    for step in range(case.steps):
        for micro in range(case.gas):
            x, y = batch(step, micro, rank, dtype)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    memory = engine.memory_breakdown()
    optimizer_tensors = [v for m in engine.zero.masters for v in engine.optimizer.state[m].values() if torch.is_tensor(v)]
    return {"params": [p.tolist() for p in full_parameters(model)], "norms": norms,
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "stage": engine.zero_optimization_stage(), "units": len(getattr(engine.zero, "units", ())),
            "memory": memory, "host_step": getattr(engine.optimizer, "host_step", None),
            "devices": sorted({str(t.device) for t in [*engine.zero.masters, *optimizer_tensors]})}


def run_z3_cases(cases: list[Z3Case]) -> dict[str, dict]:
    torch.manual_seed(0)
    return {case.name: train_z3_on_rank(case) for case in cases}


# ---------------------------------------------------------------------- checkpoints
CKPT = Z3Case(gas=1, groups=True, steps=5)
"""The checkpoint scenarios train this case: 3 steps, save, 2 more steps (possibly elsewhere)."""
SAVE_AT = 3


def _engine(stage: int, model: torch.nn.Module, world: int):
    import tachyon

    cfg = CKPT.config(world)
    cfg["zero_optimization"] = {"stage": stage, **({"shard_module_classes": ["Linear"]} if stage == 3 else {})}
    engine, _, _, _ = tachyon.initialize(
        model=model, model_parameters=param_groups(model, CKPT.groups), config=cfg,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY))
    return engine


def _train(engine, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, 0, rank, torch.float32)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def checkpoint_scenarios(root: str) -> dict:
    """On every rank: (a) stage 3 trains 3 steps, saves ``root/z3``, writes save_16bit_model to
    ``root/z3-16bit``, trains 2 more; (b) a fresh stage 2 engine loads ``root/z3`` and trains the 2
    steps; (c) stage 2 trains 3 steps and saves ``root/z2``; a fresh stage 3 engine loads it and
    trains 2; (d) a frozen parameter survives stage 3 -> stage 3 and stage 3 -> stage 2. Returns
    the full parameters of each continuation."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    model = make_model()
    engine = _engine(3, model, world)
    _train(engine, range(SAVE_AT), rank)
    engine.save_checkpoint(f"{root}/z3", client_state={"at": SAVE_AT})
    engine.save_16bit_model(f"{root}/z3-16bit")
    out["at_save"] = [p.tolist() for p in full_parameters(model)]
    _train(engine, range(SAVE_AT, CKPT.steps), rank)
    out["3->3 uninterrupted"] = [p.tolist() for p in full_parameters(model)]
    for stage in (2, 3):
        model = make_model()
        engine = _engine(stage, model, world)
        path, client = engine.load_checkpoint(f"{root}/z3")
        assert client == {"at": SAVE_AT} and engine.global_steps == SAVE_AT, (client, engine.global_steps)
        _train(engine, range(SAVE_AT, CKPT.steps), rank)
        out[f"3->{stage}"] = [p.tolist() for p in full_parameters(model)]
    model = make_model()
    engine = _engine(2, model, world)
    _train(engine, range(SAVE_AT), rank)
    engine.save_checkpoint(f"{root}/z2")
    model = make_model()
    engine = _engine(3, model, world)
    engine.load_checkpoint(f"{root}/z2")
    _train(engine, range(SAVE_AT, CKPT.steps), rank)
    out["2->3"] = [p.tolist() for p in full_parameters(model)]
    out["frozen"] = frozen_round_trip(root, rank, world)
    return out


def frozen_round_trip(root: str, rank: int, world: int) -> dict:
    """A frozen parameter (the LayerNorm's bias, set to 0.25) saved at stage 3, loaded at stage 3
    and at stage 2 into models where it is 0: both get 0.25 back."""
    def model_with_frozen(value: float) -> torch.nn.Module:
        model = make_model()
        with torch.no_grad():
            model[2].bias.fill_(value)
        model[2].bias.requires_grad_(False)
        return model

    engine = _engine(3, model_with_frozen(0.25), world)
    _train(engine, range(1), rank)
    engine.save_checkpoint(f"{root}/frozen")
    got = {}
    for stage in (3, 2):
        model = model_with_frozen(0.0)
        engine = _engine(stage, model, world)
        engine.load_checkpoint(f"{root}/frozen")
        bias = model[2].bias
        got[stage] = (bias.full_tensor() if hasattr(bias, "full_tensor") else bias).tolist()
    return got


def rank_main(cases: list[Z3Case], root: str) -> dict:
    """Everything the 2-rank stage 3 tests check, in ONE launch (spawning ranks costs seconds)."""
    return {"cases": run_z3_cases(cases), "ckpt": checkpoint_scenarios(root), "init": init_scenarios(),
            "accounting": accounting_scenarios(), "compose": compose_scenarios(root),
            "hf": hf_scenarios()}


def save_on_ranks(root: str) -> list:
    """Stage 3 on this launch's ranks: 3 steps of `CKPT`, save ``root/wide``."""
    import torch.distributed as dist

    model = make_model()
    engine = _engine(3, model, dist.get_world_size())
    _train(engine, range(SAVE_AT), dist.get_rank())
    engine.save_checkpoint(f"{root}/wide")
    return [p.tolist() for p in full_parameters(model)]


def resume_with_fewer_ranks(root: str, saved_world: int) -> list:
    """Stage 3 on fewer ranks than saved ``root/wide``: load it, train to step 5 on the same global
    batch (rank r's micro-step m takes the batch saving rank ``r * k + m`` took, k = saved / now)."""
    import torch.distributed as dist

    import tachyon

    rank, world = dist.get_rank(), dist.get_world_size()
    per = saved_world // world
    model = make_model()
    cfg = CKPT.config(world)
    cfg.update(gradient_accumulation_steps=per, train_batch_size=MICRO * saved_world)
    engine, _, _, _ = tachyon.initialize(
        model=model, model_parameters=param_groups(model, CKPT.groups), config=cfg,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY))
    engine.load_checkpoint(f"{root}/wide")
    for step in range(SAVE_AT, CKPT.steps):
        for micro in range(per):
            x, y = batch(step, 0, rank * per + micro, torch.float32)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    return [p.tolist() for p in full_parameters(model)]


# ---------------------------------------------------------------------- tachyon.zero.Init
def build_under_init(units: tuple[str, ...]) -> torch.nn.Module:
    """`make_model`'s model and values, built under tachyon.zero.Init. With ``units`` (the
    Linear layers), each Linear is sharded as soon as it is attached, so the values are written
    inside GatheredParameters(modifier_rank=0), as DeepSpeed's zero.Init asks; without, the root
    is sharded when the block ends, after they were written."""
    import tachyon

    reference = make_model()
    with tachyon.zero.Init(unit_classes=list(units)):
        model = torch.nn.Sequential(*[type(m)(*_args(m)) for m in reference])
        with tachyon.zero.GatheredParameters(list(model.parameters()), modifier_rank=0, enabled=bool(units)):
            with torch.no_grad():
                for p, value in zip(model.parameters(), reference.parameters()):
                    p.copy_(value)
    return model


def _args(module: torch.nn.Module) -> tuple:
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, torch.nn.LayerNorm):
        return module.normalized_shape
    return ()


def init_scenarios() -> dict:
    """Stage 3 training of models built under tachyon.zero.Init (with and without units), and a
    GatheredParameters edit of a live engine's parameter kept from rank 0."""
    import torch.distributed as dist

    import tachyon

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    constructor = torch.nn.Linear.__init__
    with tachyon.zero.Init(unit_classes=["Linear"]):
        alone = torch.nn.Linear(5, 3)  # a unit: sharded when its constructor returns, attached or not
        norm = torch.nn.LayerNorm(3)  # not a unit, not attached: left whole
    out["patching"] = {"unit_meta": alone.weight.is_meta, "kept": tuple(tachyon.zero.local_values(alone.weight).shape),
                       "other_meta": norm.weight.is_meta, "restored": torch.nn.Linear.__init__ is constructor}
    refused = {}
    for stage, kept_for in ((3, (0, 4)), (2, (rank, world))):  # shards for 4 ranks; stage 2
        odd = torch.nn.Sequential(torch.nn.Linear(4, 4))
        tachyon.zero.shard_parameters(odd, *kept_for)
        try:
            tachyon.initialize(model=odd, config={**Z3Case().config(world), "zero_optimization": {"stage": stage}},
                               optimizer=lambda groups: torch.optim.SGD(groups, lr=LR))
        except ValueError as error:
            refused[stage] = (str(error), tachyon.zero.built_sharded(odd[0].weight))
    out["refused"] = refused
    for units in ((), ("Linear",)):
        case = Z3Case(units=units)
        model = build_under_init(units)
        meta = all(p.is_meta for p in model.parameters())
        engine, _, _, _ = tachyon.initialize(
            model=model, config=case.config(world),
            optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY))
        _train(engine, range(case.steps), rank)
        out[f"units{len(units)}"] = {"meta": meta, "params": [p.tolist() for p in full_parameters(model)]}
    weight = model[0].weight
    with tachyon.zero.GatheredParameters(weight, modifier_rank=0):
        whole = model[0].weight
        shape = tuple(whole.shape)
        whole.data.fill_(float(rank + 1))  # rank 0 writes 1, rank 1 writes 2: rank 0's is kept
    out["gathered"] = {"shape": shape, "after": model[0].weight.full_tensor().unique().tolist(),
                       "same_object": model[0].weight is weight}
    return out


# ---------------------------------------------------------------------- memory cap
CAPPED_LAYERS, CAPPED_WIDTH = 24, 1024


def _vm_data() -> int:
    """This process's private writable memory (VmData: what RLIMIT_DATA limits), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _train_steps(engine, width: int, steps: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(steps):
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _capped_config(world: int) -> dict:
    return {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "shard_module_classes": ["Linear"]},
            "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}


def train_under_memory_cap(budget: int) -> dict:
    """Cap this process's private writable memory (the soft RLIMIT_DATA, which counts what
    VmData shows: heap, anonymous mappings and thread stacks, not address space merely reserved)
    at its current size + ``budget`` bytes, then: building the whole model plainly fails (its
    fp32 size is above the budget), building it under tachyon.zero.Init and training 2 stage-3
    SGD steps works. Returns the model's fp32 bytes, the losses, the plain build's error and the
    engine's memory breakdown.

    Set up first, so that the cap measures the model: one malloc arena with a fixed mmap
    threshold (freed large blocks go back to the system at once), and a tiny stage-3 run under
    Init on a Mesh made first (whose data-parallel group both engines use), so the lazy imports,
    gloo's groups and threads and FSDP2's state exist before the cap. The cap is
    lifted on return (the hard limit is left as it was)."""
    import ctypes
    import gc
    import resource

    import torch.distributed as dist

    import tachyon
    from tachyon.parallel import Mesh

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-8, 1)  # M_ARENA_MAX
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed at 1 MiB
    world = dist.get_world_size()

    def build(layers: int, width: int) -> torch.nn.Module:
        linears = [torch.nn.Linear(width, width) for _ in range(layers)]
        return torch.nn.Sequential(*[m for layer in linears for m in (layer, torch.nn.Tanh())])

    mesh = Mesh()  # its data-parallel group's buffers and threads are made here, before the cap
    torch.manual_seed(0)
    with tachyon.zero.Init(unit_classes=["Linear"]):
        warm = build(2, 16)
    engine, _, _, _ = tachyon.initialize(model=warm, config=_capped_config(world), mpu=mesh.mpu)
    _train_steps(engine, 16, 1)
    del engine, warm
    gc.collect()

    full_bytes = CAPPED_LAYERS * (CAPPED_WIDTH + 1) * CAPPED_WIDTH * 4
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _vm_data() + budget
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        plain_error = None
        try:
            build(CAPPED_LAYERS, CAPPED_WIDTH)
        except (RuntimeError, MemoryError) as error:
            plain_error = str(error).splitlines()[0][:200]
        gc.collect()
        torch.manual_seed(0)
        with tachyon.zero.Init(unit_classes=["Linear"]):
            model = build(CAPPED_LAYERS, CAPPED_WIDTH)
        engine, _, _, _ = tachyon.initialize(model=model, config=_capped_config(world), mpu=mesh.mpu)
        losses = _train_steps(engine, CAPPED_WIDTH, 2)
        memory = engine.memory_breakdown()
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    return {"full_bytes": full_bytes, "budget": budget, "plain_error": plain_error, "losses": losses,
            "memory": memory}


# ---------------------------------------------------------------------- bytes per rank, bytes on the wire
ACCOUNT_SHAPES = ((16, 8), (16,), (8, 16), (8,))
"""The accounting model's parameters: Linear(8, 16), Linear(16, 8); every dim 0 divides by 2 and 4."""


def accounting_scenarios() -> dict:
    """For stage 0 (data parallel), 1, 2 and 3 (and 3 with the parameters and optimizer
    offloaded), bf16 with AdamW from the config: one more step
    after a first one, with every torch.distributed call counted (`CommCounter`), the memory
    breakdown and (stage 3) the live tensor bytes after its backward."""
    import torch.distributed as dist

    import tachyon
    from tachyon.engine.zero import live_tensor_bytes
    from tachyon.parallel import CommCounter

    world = dist.get_world_size()
    out = {}
    for stage in (0, 1, 2, 3, "3-offload"):
        torch.manual_seed(0)
        base = live_tensor_bytes() if stage == 3 else 0  # (a walk over every object: only where checked)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        zero = {"stage": 3, "shard_module_classes": ["Linear"]} if stage in (3, "3-offload") else {"stage": stage}
        if stage == "3-offload":
            zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
        cfg = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
               "communication_data_type": "bf16", "zero_optimization": zero,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        engine, _, _, _ = tachyon.initialize(model=model, config=cfg)
        x = torch.randn(2, 8, dtype=torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        with CommCounter() as comm:
            engine.backward(engine(x).float().square().mean())
            memory = engine.memory_breakdown()
            live = live_tensor_bytes(collect=False) - base if stage == 3 else None
            engine.step()
        out[stage] = {"memory": memory, "live": live,
                      "calls": [(c.kind, c.dtype, c.payload, c.sent) for c in comm.calls]}
        engine.destroy()
    return out
