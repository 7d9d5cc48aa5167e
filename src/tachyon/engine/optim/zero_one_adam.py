"""ZeroOneAdam: 0/1 Adam (Lu et al. 2022, arXiv 2202.06009; DeepSpeed's ZeroOneAdam) on tachyon's
1-bit compressed all-reduce (`tachyon.parallel.compression`).

    opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=100000, var_update_scaler=16,
                      local_step_scaler=32678, local_step_clipper=16)

Two stages, per element in fp32 (t: the step count; no bias correction, as DeepSpeed's):

- variance updates (t <= var_freeze_step, and one step more): at steps where
  ``t % var_interval == 0`` the gradient ``g`` must be averaged over the data-parallel ranks
  by the caller (uncompressed), and ``v = beta2*v + (1-beta2)*g*g``, ``m = beta1*m + (1-beta1)*g``;
  at the other steps the caller passes each rank's LOCAL gradient, which is averaged here with
  the 1-bit compressed all-reduce (error feedback) and only the momentum moves. ``var_interval``
  starts at 1 and doubles every ``var_update_scaler`` variance updates.
- local steps (after the step where t > var_freeze_step): the variance is frozen; every rank
  steps on its local gradient (``lrs`` sums the learning rates used); every
  ``local_step_interval`` steps the ranks synchronise: each takes its displacement since the
  last synchronisation ``u = p - sync_params``, averages ``u * (sqrt(v)+eps)`` with the
  compressed all-reduce, sets ``m = -mean / lrs`` and ``p = sync_params + mean / (sqrt(v)+eps)``,
  so every rank holds bit-identical parameters again. ``local_step_interval`` doubles every
  ``local_step_scaler`` steps, up to ``local_step_clipper``.

Every step: ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``.

`in_compression_stage` says whether the NEXT step wants local gradients (the engine then skips
its data-parallel averaging; DeepSpeed's ``enable_backward_allreduce``). A param group may hold
``exp_avg_mask`` (multiplied into the compressed averages, as DeepSpeed's).

Differences from DeepSpeed's (deliberate): DeepSpeed spends the first ``step()`` setting up
buffers without updating; here every step updates. On one rank the "average" of a gradient is
the gradient itself (DeepSpeed leaves the momentum unchanged at those steps when alone).
DeepSpeed accumulates the local updates in ``momentum_accumulator`` and undoes them by
subtraction, which rounds differently on each rank, so its ranks' parameters drift apart by a
few ulps at every synchronisation; here the parameters at the last synchronisation are kept
(``sync_params``, in the place of that accumulator) and the ranks agree exactly.
``sync_params`` and ``lrs`` are kept in ``state_dict`` (DeepSpeed drops its accumulator on load,
losing the local updates since the last synchronisation); the error-feedback buffers are not
saved (as DeepSpeed) and restart at zero. Refused: amsgrad=True, eps_inside_sqrt=True,
max_grad_norm > 0 (clip with the engine's ``gradient_clipping``), comm_backend_name other than
"nccl" / "gloo". ``deepspeed`` is accepted for DeepSpeed's argument order and unused: pass the
data-parallel ``group`` (the engine does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tachyon.engine.optim._state import restore_fp32_states
from tachyon.engine.optim.masks import MaskedGroups
from tachyon.engine.optim.onebit import check_onebit_arguments
from tachyon.parallel.compression import DEFAULT_BLOCK_SIZE, CompressedAllReduce


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ZeroOneAdam: {name} must be an int >= 1; got {value!r}")
    return value


class ZeroOneAdam(MaskedGroups, torch.optim.Optimizer):
    """0/1 Adam (module docstring). Params fp32, fp16 or bf16 (states fp32)."""

    def __init__(
        self, params, deepspeed: Any = None, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
        var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
        amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl", *,
        group=None, block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        del deepspeed  # DeepSpeed's engine handle; tachyon passes the process group instead
        _positive_int("var_freeze_step", var_freeze_step)
        check_onebit_arguments("ZeroOneAdam", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               freeze_step=var_freeze_step, eps_inside_sqrt=eps_inside_sqrt,
                               max_grad_norm=max_grad_norm, amsgrad=amsgrad, cuda_aware=cuda_aware,
                               comm_backend_name=comm_backend_name, block_size=block_size)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = _positive_int("var_update_scaler", var_update_scaler)
        self.local_step_scaler = _positive_int("local_step_scaler", local_step_scaler)
        self.local_step_clipper = _positive_int("local_step_clipper", local_step_clipper)
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.group, self.block_size = group, block_size
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self._reducers: dict[Tensor, CompressedAllReduce] = {}
        self._group_size: int | None = None

    @staticmethod
    def check_zero_stage(stage: int) -> None:
        """ValueError for a ZeRO stage other than 0 (the engine asks before building anything)."""
        if stage != 0:
            raise ValueError(f"ZeroOneAdam with zero_optimization.stage {stage}: it averages each rank's whole "
                             "gradient and displacement itself, and ZeRO partitions them (DeepSpeed does not combine "
                             "them either); use stage 0, or OneBitAdam with ZeRO stages 1-2")

    def bind_data_parallel(self, group: Any, world_size: int, *, partitioned: bool = False) -> None:
        """Average over ``group`` of ``world_size`` ranks (the engine's data-parallel group;
        world_size 1: nothing to average). ``partitioned`` (ZeRO stages 1-2: each rank holds a
        partition of the parameters) is refused: 0/1 Adam needs every rank's whole gradient."""
        if partitioned:
            self.check_zero_stage(1)
        if self._reducers:
            raise RuntimeError("ZeroOneAdam.bind_data_parallel: the optimizer already communicated; bind it before "
                               "training")
        self.group, self._group_size = group, world_size

    # ------------------------------------------------------------------ stage
    def _steps_done(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state[p]:
                    return int(self.state[p]["step"])
        return 0

    def _first_state(self) -> dict | None:
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state[p]:
                    return self.state[p]
        return None

    @property
    def freeze_key(self) -> bool:
        """Whether the variance is frozen (local steps); DeepSpeed's name."""
        return self._steps_done() > self.var_freeze_step

    @property
    def in_compression_stage(self) -> bool:
        """True when the next step wants each rank's local gradient (not averaged by the caller)."""
        if self.freeze_key:
            return True
        state = self._first_state()
        interval = state["var_interval"] if state is not None else 1
        return (self._steps_done() + 1) % interval != 0

    # ------------------------------------------------------------------ communication
    def _world_size(self) -> int:
        if self._group_size is not None:
            return self._group_size
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def _average(self, p: Tensor, tensor: Tensor, index: int, group: dict) -> Tensor:
        """The compressed mean of ``tensor`` over the ranks (itself on one rank), masked by the
        group's ``exp_avg_mask``."""
        if self._world_size() > 1:
            reducer = self._reducers.get(p)
            if reducer is None:
                reducer = self._reducers[p] = CompressedAllReduce(tensor.numel(), group=self.group,
                                                                  block_size=self.block_size, device=tensor.device)
            flat = tensor.reshape(-1).contiguous()
            reducer(flat)
            tensor = flat.view_as(tensor)
        mask = self.group_mask(index, group, p)
        if mask is not None:
            tensor = tensor * mask
        return tensor

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen = self.freeze_key
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("ZeroOneAdam: sparse gradients are not supported")
                state = self.state[p]
                if len(state) == 0:
                    state.update(step=0, exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.float32), lrs=0.0,
                                 var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float()
                p32 = p if p.dtype == torch.float32 else p.float()
                if frozen and "sync_params" not in state:  # the first local step starts from here
                    state["sync_params"] = p32.detach().clone()
                if not frozen:
                    if t % state["var_interval"] == 0:  # the caller averaged g
                        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                    else:
                        m.mul_(beta1).add_(self._average(p, g, index, group), alpha=1.0 - beta1)
                else:
                    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                    state["lrs"] += lr
                denom = v.sqrt().add_(eps)
                update = m / denom
                if weight_decay > 0.0:
                    update.add_(p32, alpha=weight_decay)
                p32.add_(update, alpha=-lr)
                if frozen:
                    if t % state["local_step_interval"] == 0:  # synchronise the ranks
                        anchor = state["sync_params"]
                        mean = self._average(p, (p32 - anchor).mul_(denom), index, group)
                        m.copy_(mean).div_(-state["lrs"])
                        p32.copy_(anchor.add_(mean.div_(denom)))
                        state["lrs"] = 0.0
                    state["local_step_counter"] += 1
                    if state["local_step_counter"] == self.local_step_scaler:
                        state["local_step_counter"] = 0
                        state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
                elif t % state["var_interval"] == 0:
                    state["var_counter"] += 1
                    if state["var_counter"] == self.var_update_scaler:
                        state["var_counter"] = 0
                        state["var_interval"] *= 2
                if p32 is not p:
                    p.copy_(p32)
        if not frozen and self.freeze_key:
            # the error buffers held gradient errors; from now on they carry accumulated updates
            for reducer in self._reducers.values():
                reducer.worker_error.zero_()
                reducer.server_error.zero_()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, keeping each group's current ``exp_avg_mask`` (as DeepSpeed: the mask
        belongs to the training script, not the checkpoint); the error buffers restart at zero."""
        state_dict = dict(state_dict, param_groups=[dict(g) for g in state_dict["param_groups"]])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            saved.pop("exp_avg_mask", None)
            if "exp_avg_mask" in group:
                saved["exp_avg_mask"] = group["exp_avg_mask"]
        super().load_state_dict(state_dict)
        restore_fp32_states(self, state_dict, ("exp_avg", "exp_avg_sq", "sync_params"))
        self._reducers.clear()


__all__ = ["ZeroOneAdam"]
