"""OneBitLamb: 1-bit LAMB (Li et al. 2021, arXiv 2104.06069) on torch.distributed.

    opt = OneBitLamb(params, lr=1e-3, freeze_step=1000, max_coeff=10.0, min_coeff=0.01,
                     coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1)

Same two stages and the same use as OneBitAdam (`tachyon.engine.optim.onebit`). Per element in
fp32, t the step count, k the original parameter the element belongs to:

    warm-up (t <= freeze_step), g the averaged gradient -- tachyon's Lamb (DeepSpeed FusedLamb):
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        u = m / (sqrt(v) + eps) + weight_decay * p
        ratio_k = clamp(||p_k|| / ||u_k||, min_coeff, max_coeff)    (1 where a norm is 0)
        p = p - step_size(t) * ratio_k * u
        lamb_coeff_freeze_k = coeff_beta * lamb_coeff_freeze_k + (1 - coeff_beta) * ratio_k
                                                                     (where both norms are > 0)
        at t == freeze_step: v_fresh = v
    compression (t > freeze_step), the momentum averaged compressed as in 1-bit Adam:
        g~ = (m - beta1 * m_previous) / (1 - beta1)                  (the averaged gradient it implies)
        v_fresh = beta2 * v_fresh + (1 - beta2) * g~ * g~            (v stays frozen)
        u' = m / (sqrt(v) + eps);   u = u' + weight_decay * p
        factor_k = max over k of (sqrt(v) + eps) / (sqrt(v_fresh) + eps)
        with weight decay: r = min(1, ||u'_k|| / ||u_k||), factor_k = factor_k * r + (1 - r)
        factor_k clamped to [factor_min, factor_max], then to last_factor_k * (1 -+ factor_threshold)
        p = p - step_size(t) * lamb_coeff_freeze_k * factor_k * u

step_size(t) = lr * sqrt(1 - beta2**t) / (1 - beta1**t) with ``bias_correction``, else lr, in
both stages. (Unlike Adam's, LAMB's update does not depend on the scale of v: the trust ratio
undoes it. So sqrt(1 - beta2**t) is a schedule factor, continued as LAMB would continue it; the
frozen coefficient absorbed v's scale at freeze_step. Freezing it at freeze_step instead made the
loss of the test problem in tests/engine/test_onebit_lamb.py 4.8% worse than LAMB's, against
2.8% this way, on one process.) The frozen coefficient is DeepSpeed's
``lamb_coeff_freeze`` (an exponential average started at 0, so pick 1 / (1 - coeff_beta) <=
freeze_step) and the factor follows how far the fresh variance has drifted from the frozen one,
DeepSpeed's logic and defaults (factor_max 4, factor_min 0.5, factor_threshold 0.1). DeepSpeed's
OnebitLamb never applies bias correction (``bias_correction=False`` gives its update) and spends its
first step() on set-up; here every step updates. ``get_lamb_coeffs()``: the coefficients
(ratio or frozen coefficient times factor) of the last step, per parameter.

State beyond OneBitAdam's: ``exp_avg_sq_fresh`` per tensor (fp32, the parameter's shape) and, per
group on its first tensor, ``lamb_coeff_freeze`` and ``last_factor`` (fp32 [num_segments]).
Flat partitions (``segments``): norms are reduced with ``norm_reducer`` (SUM) and the factor's
maximum with ``max_reducer`` (MAX), so a parameter split across ranks gets the coefficient it would
get whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tachyon.engine.optim.lamb import lamb_step_size, lamb_update
from tachyon.engine.optim.onebit import OneBitOptimizer, SegmentPlan, check_onebit_arguments
from tachyon.parallel.compression import DEFAULT_BLOCK_SIZE


def _check_lamb_arguments(max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold) -> None:
    for name, value in (("max_coeff", max_coeff), ("min_coeff", min_coeff), ("factor_max", factor_max),
                        ("factor_min", factor_min), ("factor_threshold", factor_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"OneBitLamb: {name} must be a number >= 0; got {value!r}")
    if min_coeff > max_coeff:
        raise ValueError(f"OneBitLamb: need min_coeff <= max_coeff; got min_coeff={min_coeff!r}, "
                         f"max_coeff={max_coeff!r}")
    if factor_min > factor_max:
        raise ValueError(f"OneBitLamb: need factor_min <= factor_max; got factor_min={factor_min!r}, "
                         f"factor_max={factor_max!r}")
    if isinstance(coeff_beta, bool) or not isinstance(coeff_beta, (int, float)) or not 0 <= coeff_beta < 1:
        raise ValueError(f"OneBitLamb: coeff_beta must be a number in [0, 1); got {coeff_beta!r}")


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB (see the module docstring). Params fp32, fp16 or bf16 (states fp32); grads fp32,
    fp16 or bf16."""

    keeps_previous_momentum = True

    def __init__(
        self, params, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
        bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
        max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
        comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
        factor_min: float = 0.5, factor_threshold: float = 0.1, *,
        group=None, block_size: int = DEFAULT_BLOCK_SIZE, reduce_momentum: bool = True,
    ) -> None:
        del deepspeed  # DeepSpeed's engine handle; tachyon passes the process group instead
        check_onebit_arguments("OneBitLamb", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               freeze_step=freeze_step, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm,
                               amsgrad=amsgrad, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
                               block_size=block_size)
        _check_lamb_arguments(max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold)
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold
        self.lamb_coeffs: list[Tensor] = []
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, freeze_step=freeze_step, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group, block_size=block_size,
                         reduce_momentum=reduce_momentum)

    @property
    def lamb_freeze_key(self) -> bool:
        """DeepSpeed's name for `in_compression_stage`."""
        return self.in_compression_stage

    def get_lamb_coeffs(self) -> list[float]:
        """The per-parameter coefficients of the last step, a new list (DeepSpeed's accessor; its
        ``lamb_coeffs`` attribute holds them until the next step; synchronizes)."""
        return [float(x) for c in self.lamb_coeffs for x in torch.as_tensor(c).reshape(-1).tolist()]

    def step(self, closure=None):
        self.lamb_coeffs = []
        return super().step(closure)

    def _group_vector(self, group: dict, plan: SegmentPlan, key: str, fill: float) -> Tensor:
        state = self.state[group["params"][0]]
        if key not in state:
            state[key] = torch.full((plan.num_segments,), fill, dtype=torch.float32, device=plan.ids.device)
        return state[key]

    def _warmup_group(self, group: dict, plan: SegmentPlan) -> None:
        p32s: list[Tensor | None] = []
        updates: list[Tensor | None] = []
        steps: list[int] = []
        for p in group["params"]:
            if p.grad is None:
                p32s.append(None)
                updates.append(None)
                steps.append(0)
                continue
            state = self.state[p]
            t, p32, u = lamb_update(state, p, group)
            if t == self.freeze_step:
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            p32s.append(p32)
            updates.append(u)
            steps.append(t)
        w_sq, u_sq = plan.sums(p32s, self.norm_reducer), plan.sums(updates, self.norm_reducer)
        both = (w_sq > 0) & (u_sq > 0)
        ratio = (w_sq.sqrt() / u_sq.sqrt()).clamp(group["min_coeff"], group["max_coeff"])
        ratio = torch.where(both, ratio, torch.ones_like(ratio))
        frozen = self._group_vector(group, plan, "lamb_coeff_freeze", 0.0)
        frozen.copy_(torch.where(both, self.coeff_beta * frozen + (1.0 - self.coeff_beta) * ratio, frozen))
        self.lamb_coeffs.append(ratio)
        for i, (p, p32, u, t) in enumerate(zip(group["params"], p32s, updates, steps)):
            if u is None:
                continue
            coeff = plan.expand(ratio, i, 0.0) * lamb_step_size(group, t)
            p32.sub_(u.mul_(coeff))
            if p32 is not p:
                p.copy_(p32)

    def _compressed_group(self, group: dict, plan: SegmentPlan, previous: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        p32s, prelims, updates, drift = [], [], [], []
        for p, m_previous in zip(group["params"], previous):
            state = self.state[p]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if "exp_avg_sq_fresh" not in state:  # a parameter with fewer warm-up updates than freeze_step
                state["exp_avg_sq_fresh"] = v.clone()
            fresh = state["exp_avg_sq_fresh"]
            implied = m_previous.mul_(-beta1).add_(m).div_(1.0 - beta1)
            fresh.mul_(beta2).addcmul_(implied, implied, value=1.0 - beta2)
            del implied
            denom = v.sqrt().add_(eps)
            prelim = m / denom
            p32 = p if p.dtype == torch.float32 else p.float()
            update = prelim.add(p32, alpha=weight_decay) if weight_decay != 0.0 else prelim
            drift.append(denom.div_(fresh.sqrt().add_(eps)))
            p32s.append(p32)
            prelims.append(prelim)
            updates.append(update)
        factor = plan.maxima(drift, self.max_reducer)
        del drift
        if weight_decay != 0.0:
            u_sq, prelim_sq = plan.sums(updates, self.norm_reducer), plan.sums(prelims, self.norm_reducer)
            kept = torch.where(u_sq > 0, (prelim_sq.sqrt() / u_sq.sqrt()).clamp(max=1.0), torch.ones_like(u_sq))
            factor = factor * kept + (1.0 - kept)
        last = self._group_vector(group, plan, "last_factor", 1.0)
        factor = factor.clamp(self.factor_min, self.factor_max)
        factor = torch.minimum(torch.maximum(factor, last * (1.0 - self.factor_threshold)),
                               last * (1.0 + self.factor_threshold))
        last.copy_(factor)
        coeff = self._group_vector(group, plan, "lamb_coeff_freeze", 0.0) * factor
        self.lamb_coeffs.append(coeff)
        for i, (p, p32, update) in enumerate(zip(group["params"], p32s, updates)):
            state = self.state[p]
            step_size = lamb_step_size(group, int(state["step"]))
            p32.sub_(update.mul_(plan.expand(coeff, i, 0.0) * step_size))
            if p32 is not p:
                p.copy_(p32)
