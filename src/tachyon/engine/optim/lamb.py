"""LAMB with trust ratios per original parameter, also over flat ZeRO partitions.

    opt = Lamb(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
               max_coeff=10.0, min_coeff=0.01, bias_correction=True)

The update is DeepSpeed's FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu, eps outside the sqrt,
its default ``eps_inside_sqrt=False``), per element in fp32 with t = the step count:

    m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * p            (m, v NOT bias-corrected inside u)
    ratio = ||p|| / ||u|| over the whole original parameter, clamped to [min_coeff, max_coeff];
            1.0 when ||p|| == 0 or ||u|| == 0
    step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)   (lr without bias_correction)
    p = p - (step_size * ratio) * u

(DeepSpeed's grad_scale / max_grad_norm arguments are not here: the engine unscales and clips.)

Flat partitions: a param group may carry ``segments``, an int64 tensor [n_seg, 3] of
(start, length, segment_id) into its single flat tensor, and ``num_segments``, the global number of
original parameters. The squared norms of p and u are computed per segment piece, added into a
fp32 [2, num_segments] buffer (row 0: ||p||^2, row 1: ||u||^2) with index_add_, and that buffer is
passed to ``optimizer.norm_reducer`` (a callable that all-reduces it in place with SUM across the
data-parallel ranks; None = single process) before the ratios are formed. So a parameter split
across ranks gets the same ratio as if it were whole. Elements of the flat tensor outside every
segment are padding: their m and v update, but p does not move. Without ``segments`` each tensor
of the group is one parameter and the reducer is not called for that group. The reducer is a
collective: every rank must step its flat tensor (give it a gradient, zeros if need be) on every
step, or the others wait in the all-reduce.

State per parameter: ``step`` (float32 CPU scalar), ``exp_avg``, ``exp_avg_sq`` (fp32). segments
and num_segments are group entries, so they travel in state_dict() and come back with
load_state_dict().
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from tachyon.engine.optim._state import advance_adam_state, check_adam_hyperparameters, restore_fp32_states

NormReducer = Callable[[Tensor], None]


def segment_runs(rows: list[tuple[int, int, int]], numel: int, gap_slot: int) -> tuple[list[int], list[int]]:
    """Run-length form of a flat tensor of ``numel`` elements whose rows (start, length,
    segment id; sorted, disjoint) belong to segments: (slot per run, run lengths), the runs
    covering the whole tensor, the gaps between and after rows in slot ``gap_slot``."""
    slots, lengths, end = [], [], 0
    for start, length, seg_id in rows:
        if start > end:
            slots.append(gap_slot)
            lengths.append(start - end)
        slots.append(seg_id)
        lengths.append(length)
        end = start + length
    if end < numel:
        slots.append(gap_slot)
        lengths.append(numel - end)
    return slots, lengths


def _check_segments(segments: object, num_segments: object, numel: int) -> list[tuple[int, int, int]]:
    """The segments as (start, length, id) tuples sorted by start, or a ValueError naming the problem."""
    if not isinstance(segments, Tensor) or segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != 3:
        got = f"{segments.dtype} tensor of shape {tuple(segments.shape)}" if isinstance(segments, Tensor) else type(segments).__name__
        raise ValueError(f"Lamb: param group 'segments' must be an int64 tensor [n_seg, 3] of (start, length, segment_id); got {got}")
    if not isinstance(num_segments, int) or isinstance(num_segments, bool) or num_segments < 1:
        raise ValueError(f"Lamb: param group 'num_segments' must be an int >= 1 (the global number of parameters); got {num_segments!r}")
    rows = sorted(tuple(int(x) for x in row) for row in segments.cpu().tolist())
    end = 0
    for start, length, seg_id in rows:
        if start < 0 or length < 1 or start + length > numel:
            raise ValueError(f"Lamb: segment (start={start}, length={length}) does not lie inside the flat tensor of {numel} elements (lengths must be >= 1)")
        if not 0 <= seg_id < num_segments:
            raise ValueError(f"Lamb: segment_id {seg_id} is outside [0, num_segments={num_segments})")
        if start < end:
            raise ValueError(f"Lamb: segment starting at {start} overlaps the previous one, which ends at {end}")
        end = start + length
    return rows


def lamb_update(state: dict, p: Tensor, group: dict) -> tuple[int, Tensor, Tensor]:
    """Advance Adam's moments of ``p`` (``state``) with its gradient; returns (the step count, p
    as fp32 (itself when fp32), LAMB's update m / (sqrt(v) + eps) + weight_decay * p)."""
    beta1, beta2 = group["betas"]
    t = advance_adam_state(state, p)
    g = p.grad.float()
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    p32 = p if p.dtype == torch.float32 else p.float()
    u = m / v.sqrt().add_(group["eps"])
    if group["weight_decay"] != 0.0:
        u.add_(p32, alpha=group["weight_decay"])
    return t, p32, u


def lamb_step_size(group: dict, t: int) -> float:
    """lr, bias-corrected for step ``t`` when the group asks for it."""
    if not group["bias_correction"]:
        return group["lr"]
    beta1, beta2 = group["betas"]
    return group["lr"] * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)


class Lamb(torch.optim.Optimizer):
    """LAMB (DeepSpeed FusedLamb semantics) with per-parameter trust ratios, flat partitions included.

    ``norm_reducer``: see the module docstring; may also be set later as ``optimizer.norm_reducer``.
    """

    def __init__(
        self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
        bias_correction: bool = True, *, norm_reducer: NormReducer | None = None,
    ) -> None:
        check_adam_hyperparameters("Lamb", lr, betas, eps, weight_decay)
        if not (0 <= min_coeff <= max_coeff):
            raise ValueError(f"Lamb: need 0 <= min_coeff <= max_coeff; got min_coeff={min_coeff!r}, max_coeff={max_coeff!r}")
        self.norm_reducer = norm_reducer
        self._pieces_cache: dict[int, tuple] = {}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "segments" in group:
            if len(group["params"]) != 1:
                raise ValueError(f"Lamb: a param group with 'segments' must hold exactly one (flat) tensor; got {len(group['params'])}")
            _check_segments(group["segments"], group.get("num_segments"), group["params"][0].numel())
            if not group["params"][0].is_contiguous():
                raise ValueError("Lamb: the flat tensor of a param group with 'segments' must be contiguous")
        elif "num_segments" in group:
            raise ValueError("Lamb: param group has 'num_segments' but no 'segments'")

    def _segment_plan(self, group: dict) -> tuple[list[tuple[int, int, int]], Tensor, Tensor, Tensor]:
        """(rows sorted by start, segment id per row, slot per run, run lengths) for the group's
        flat tensor, cached. Runs cover the flat tensor: each row, plus padding gaps (slot
        num_segments, which gets coefficient 0)."""
        segments = group["segments"]
        cached = self._pieces_cache.get(id(group))
        if cached is None or cached[0] is not segments:
            flat = group["params"][0]
            n = group.get("num_segments")
            rows = _check_segments(segments, n, flat.numel())
            slots, lengths = segment_runs(rows, flat.numel(), n)
            as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=flat.device)  # noqa: E731
            cached = (segments, rows, as_tensor([r[2] for r in rows]), as_tensor(slots), as_tensor(lengths))
            self._pieces_cache[id(group)] = cached
        return cached[1:]

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB update of every parameter with a gradient; returns closure() when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            p32s, updates, step_sizes = [], [], []
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("Lamb: sparse gradients are not supported")
                t, p32, u = lamb_update(self.state[p], p, group)
                p32s.append(p32)
                updates.append(u)
                step_sizes.append(lamb_step_size(group, t))
            if "segments" in group:
                self._step_segments(group, p32s[0], updates[0], step_sizes[0])
            else:
                self._step_whole(group, p32s, updates, step_sizes)
            for p, p32 in zip(params, p32s):
                if p32 is not p:
                    p.copy_(p32)
        return loss

    def _ratios(self, group: dict, sq_norms: Tensor) -> Tensor:
        """sq_norms: fp32 [2, n] (||p||^2, ||u||^2) -> clamped trust ratios [n] (1 where a norm is 0)."""
        w, u = sq_norms[0].sqrt(), sq_norms[1].sqrt()
        ratio = (w / u).clamp(group["min_coeff"], group["max_coeff"])
        return torch.where((w > 0) & (u > 0), ratio, torch.ones_like(ratio))

    def _step_whole(self, group: dict, p32s: list[Tensor], updates: list[Tensor], step_sizes: list[float]) -> None:
        w_norms = torch._foreach_norm([p.reshape(-1) for p in p32s])
        u_norms = torch._foreach_norm([u.reshape(-1) for u in updates])
        sq = torch.stack([torch.stack(w_norms), torch.stack(u_norms)]).float().square()
        ratios = self._ratios(group, sq)
        for i, (p32, u) in enumerate(zip(p32s, updates)):
            p32.sub_(u.mul_(ratios[i] * step_sizes[i]))

    def _step_segments(self, group: dict, flat: Tensor, update: Tensor, step_size: float) -> None:
        rows, ids, run_slots, run_lengths = self._segment_plan(group)
        n = group["num_segments"]
        flat1, upd1 = flat.reshape(-1), update.reshape(-1)
        sq = torch.zeros(2, n, dtype=torch.float32, device=flat.device)
        if rows:  # a partition of padding only still joins the reduction below
            w_norms = torch._foreach_norm([flat1.narrow(0, s, ln) for s, ln, _ in rows])
            u_norms = torch._foreach_norm([upd1.narrow(0, s, ln) for s, ln, _ in rows])
            sq[0].index_add_(0, ids, torch.stack(w_norms).float().square())
            sq[1].index_add_(0, ids, torch.stack(u_norms).float().square())
        if self.norm_reducer is not None:
            self.norm_reducer(sq)
        coeff = torch.cat([self._ratios(group, sq) * step_size, sq.new_zeros(1)])  # slot n: padding
        per_element = torch.repeat_interleave(coeff[run_slots], run_lengths, output_size=flat1.numel())
        flat1.sub_(upd1.mul_(per_element))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (segments come back as group entries), keeping the states fp32."""
        super().load_state_dict(state_dict)
        self._pieces_cache.clear()
        restore_fp32_states(self, state_dict, ("exp_avg", "exp_avg_sq"))
