"""Rank-side pieces of the ZeRO stage 3 tests (tests/engine/test_zero3.py): training through
tachyon.initialize at stage 3 and returning full fp32 parameters, gradient norms and memory.

Kept out of test_* modules so the spawned gloo ranks import only this (cheap) module. The
model, data, loss and the single-process reference are the stage 0-2 tests' (zero_cases.py).
"""

from __future__ import annotations

import dataclasses

import torch

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

    @property
    def name(self) -> str:
        return (f"z3-{self.precision}-gas{self.gas}-clip{self.clip:g}-{'2groups' if self.groups else '1group'}-"
                f"{self.optimizer}-{self.steps}steps-units{'+'.join(self.units) or 'root'}"
                + (f"-comm{self.comm}" if self.comm else "") + ("" if self.prefetch else "-noprefetch"))

    def as_case(self) -> Case:
        """The stage 0-2 tests' case with the same training (for `reference_train`)."""
        return Case(stage=0, precision=self.precision, gas=self.gas, clip=self.clip, groups=self.groups,
                    optimizer=self.optimizer, steps=self.steps)

    def config(self, world_size: int) -> dict:
        zero: dict = {"stage": 3, "shard_module_classes": list(self.units)}
        if not self.prefetch:
            zero["stage3_prefetch_bucket_size"] = 0
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
    return {"params": [p.tolist() for p in full_parameters(model)], "norms": norms,
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "stage": engine.zero_optimization_stage(), "units": len(engine.zero.units)}


def run_z3_cases(cases: list[Z3Case]) -> dict[str, dict]:
    torch.manual_seed(0)
    return {case.name: train_z3_on_rank(case) for case in cases}
