"""OneBitAdam: 1-bit Adam (Tang et al. 2021, arXiv 2102.02888) on torch.distributed.

    opt = OneBitAdam(params, lr=1e-3, freeze_step=1000, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.0, bias_correction=True)
    for batch in data:
        loss(batch).backward()
        reduce_gradients(opt, model.parameters())  # averages during warm-up only
        opt.step()                                  # then: local gradients, the momentum goes compressed

(`reduce_gradients` is `tachyon.engine.onebit_hooks.reduce_gradients`; the stages, the compressed
momentum and the state are described in `tachyon.engine.optim.onebit`, the engine side in
`tachyon.engine.onebit_hooks`.)

Update, per element in fp32 with t the step count (DeepSpeed's weight decay: decoupled):

    warm-up (t <= freeze_step), g the averaged gradient:
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        p = p * (1 - lr * weight_decay) - lr / bc1(t) * m / (sqrt(v) / sqrt(bc2(t)) + eps)
    compression (t > freeze_step), g_i this rank's gradient, T the variance's last update:
        m = compressed_mean_i(beta1 * m + (1 - beta1) * g_i)          (v frozen)
        p = p * (1 - lr * weight_decay) - lr / bc1(t) * m / (sqrt(v) / sqrt(bc2(T)) + eps)

with bc1(t) = 1 - beta1**t, bc2(t) = 1 - beta2**t when ``bias_correction`` (the default), else 1.
The warm-up is exactly tachyon's FusedAdam with adam_w_mode=True (it runs its multi-tensor kernel).
DeepSpeed's OnebitAdam accepts ``bias_correction`` but never corrects: pass
``bias_correction=False`` for its update. DeepSpeed also spends the first step() on setting up
buffers (no update); here every step updates.

Arguments are DeepSpeed's, in its order (``deepspeed`` is accepted for that order and unused:
pass the data-parallel ``group`` instead). Refused with a clear error: amsgrad=True,
eps_inside_sqrt=True and max_grad_norm > 0 (DeepSpeed accepts and ignores them), comm_backend_name
other than "nccl"/"gloo". tachyon's own keywords: ``group`` (the data-parallel process group; None:
the default group), ``block_size`` (elements per compression scale), ``reduce_momentum`` (False for
ZeRO-1/2 partitions, see onebit.py), ``backend`` (the warm-up kernel's backend, as FusedAdam's).
A param group may hold ``exp_avg_mask`` (DeepSpeed's: multiplied into the momentum of every
parameter of the group after each compressed all-reduce, for parameters whose momentum must stay
exactly zero where 1-bit compression cannot represent zero).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from tachyon.backend import BACKENDS
from tachyon.engine.optim.adam import adam_group_step
from tachyon.engine.optim.onebit import OneBitOptimizer, SegmentPlan, check_onebit_arguments
from tachyon.parallel.compression import DEFAULT_BLOCK_SIZE


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam (see the module docstring). Params fp32, fp16 or bf16 (states fp32); grads fp32,
    fp16 or bf16."""

    def __init__(
        self, params, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
        bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
        amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl", *,
        group=None, block_size: int = DEFAULT_BLOCK_SIZE, reduce_momentum: bool = True, backend: str | None = None,
    ) -> None:
        del deepspeed  # DeepSpeed's engine handle; tachyon passes the process group instead
        check_onebit_arguments("OneBitAdam", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               freeze_step=freeze_step, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm,
                               amsgrad=amsgrad, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
                               block_size=block_size)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"OneBitAdam: backend={backend!r} is not a tachyon backend; allowed: {BACKENDS}")
        self.backend = backend
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, freeze_step=freeze_step, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group, block_size=block_size,
                         reduce_momentum=reduce_momentum)

    @property
    def adam_freeze_key(self) -> bool:
        """DeepSpeed's name for `in_compression_stage`."""
        return self.in_compression_stage

    def _warmup_group(self, group: dict, plan: SegmentPlan) -> None:
        adam_group_step(self.state, group, adam_w_mode=True, backend=self.backend, owner=type(self).__name__)

    def _compressed_group(self, group: dict, plan: SegmentPlan, previous: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            state = self.state[p]
            t, frozen_at = int(state["step"]), max(1, state["variance_step"])
            bc1 = 1.0 - beta1**t if group["bias_correction"] else 1.0
            bc2_sqrt = math.sqrt(1.0 - beta2**frozen_at) if group["bias_correction"] else 1.0
            p32 = p if p.dtype == torch.float32 else p.float()
            if weight_decay != 0.0:
                p32.mul_(1.0 - lr * weight_decay)
            denom = (state["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps)
            p32.addcdiv_(state["exp_avg"], denom, value=-lr / bc1)
            if p32 is not p:
                p.copy_(p32)
