"""Delayed-scaling state: one :class:`ScalingState` per tensor role of each FP8 GEMM.

A GEMM ``out = x @ w.T`` has three FP8 operands over a training step: its input x and weight w
(forward, E4M3) and the gradient of its output (backward, E5M2 under Format.HYBRID). Each has

    amax_history [amax_history_len] fp32   newest first: [0] is the step in progress,
                                           [i] the amax recorded i steps ago
    scale        fp32 scalar               multiplies the tensor before the cast to FP8
    scale_inv    fp32 scalar               1 / scale, multiplies the FP8 GEMM's result back

A step casts with the current ``scale`` (computed from steps up to the previous one) and records
its tensor's amax into ``amax_history[0]`` (a running max, so a module called twice in one step
records the larger amax). :func:`update_scales` then turns history into a new scale and rolls
the history so that [0] is a fresh zero slot. Everything stays on the tensors' device as 0-dim
tensors: no host synchronization anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tachyon.fp8.recipe import DelayedScaling
from tachyon.kernels.fp8_cast.reference import update_amax

ROLES = ("input", "weight", "grad_output")
_KEYS = ("amax_history", "scale", "scale_inv")


class ScalingState:
    """amax history, scale and scale_inv of one tensor role (see the module docstring).

    ``backward`` marks the grad_output role: its FP8 max is the recipe's backward format's max.
    """

    def __init__(self, amax_history_len: int = 16, *, backward: bool = False, device: torch.device | str | None = None) -> None:
        # on CPU unless told: a model built under a meta-device context (Hugging Face's
        # from_pretrained) still has a state that state_dict() can encode; the first FP8 forward
        # moves it to the data's device
        device = torch.device("cpu") if device is None else device
        self.backward = backward
        self.amax_history = torch.zeros(amax_history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.scale_inv = torch.ones((), dtype=torch.float32, device=device)

    def __repr__(self) -> str:
        return (f"ScalingState(backward={self.backward}, scale={self.scale.item():.6g}, "
                f"amax_history={self.amax_history.tolist()})")

    def fp8_max(self, recipe: DelayedScaling) -> float:
        return recipe.backward_max if self.backward else recipe.forward_max

    def prepare(self, amax_history_len: int, device: torch.device) -> None:
        """Follow the data's device and the recipe's history length (keeping the newest entries)."""
        if self.amax_history.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)
            self.scale_inv = self.scale_inv.to(device)
        n = self.amax_history.numel()
        if n != amax_history_len:
            history = torch.zeros(amax_history_len, dtype=torch.float32, device=device)
            keep = min(n, amax_history_len)
            history[:keep] = self.amax_history[:keep]
            self.amax_history = history

    @torch.no_grad()
    def record(self, tensor: torch.Tensor) -> None:
        """amax_history[0] = max(amax_history[0], max |tensor|) (NaN/inf propagate into the history)."""
        update_amax(self.amax_history[0], tensor)  # in place on the view; NaN propagates

    @torch.no_grad()
    def compute_amax(self, recipe: DelayedScaling) -> torch.Tensor:
        """The amax the next scale is computed from: max / most recent / the recipe's callable."""
        algo = recipe.amax_compute_algo
        if algo == "max":
            return self.amax_history.amax()
        if algo == "most_recent":
            return self.amax_history[0].clone()
        amax = algo(self.amax_history.clone())
        if not isinstance(amax, torch.Tensor) or amax.numel() != 1:
            raise ValueError(f"amax_compute_algo {algo!r} must return a tensor with one element; got {amax!r}")
        return amax.reshape(()).to(device=self.amax_history.device, dtype=torch.float32)

    @torch.no_grad()
    def update(self, recipe: DelayedScaling) -> None:
        """New scale from the history, then roll the history. Assumes history[0] is already reduced."""
        scale, scale_inv = _new_scales(self.compute_amax(recipe), self.scale, self.fp8_max(recipe), recipe.margin)
        self.scale.copy_(scale)
        self.scale_inv.copy_(scale_inv)
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors (cloned, on CPU): safe for torch.load(weights_only=True)."""
        return {k: getattr(self, k).detach().clone().cpu() for k in _KEYS}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [k for k in _KEYS if k not in state]
        if missing:
            raise ValueError(f"FP8 scaling state is missing {missing}; it needs {list(_KEYS)}")
        device = self.amax_history.device
        history = torch.as_tensor(state["amax_history"], dtype=torch.float32).reshape(-1)
        if history.numel() < 1:
            raise ValueError("FP8 scaling state: amax_history must have at least one entry")
        self.amax_history = history.clone().to(device)
        self.scale = torch.as_tensor(state["scale"], dtype=torch.float32).reshape(()).clone().to(device)
        self.scale_inv = torch.as_tensor(state["scale_inv"], dtype=torch.float32).reshape(()).clone().to(device)


class CachedWeight:
    """A GEMM's FP8 weight kept across the micro-batches of one step (``is_first_microbatch``).

    Per-tensor recipes (delayed, current scaling): data [out_features, in_features] in the
    forward FP8 dtype; scale_inv: fp32 0-dim, the 1 / scale ``data`` was cast with (so a later
    scale update cannot desynchronize the pair); data_t: ``data.T`` contiguous where the FP8 GEMMs
    take transposed operands (torch._scaled_mm), else None. Block recipes: data, the weight
    quantized for the forward GEMM, and data_t, for the input-gradient GEMM (both
    tachyon.fp8.quantize.BlockQuantized); scale_inv None. kind: the recipe's short name.
    """

    __slots__ = ("data", "data_t", "kind", "scale_inv")

    def __init__(self, data, scale_inv: torch.Tensor | None, data_t=None, kind: str = "delayed") -> None:
        self.data, self.scale_inv, self.data_t, self.kind = data, scale_inv, data_t, kind


class GemmScaling:
    """The three :class:`ScalingState` of one GEMM: ``input``, ``weight``, ``grad_output``, and
    ``weight_cache``: the FP8 weight cached by ``is_first_microbatch=True`` (None until then;
    never part of the state_dict)."""

    def __init__(self, amax_history_len: int = 16, device: torch.device | str | None = None) -> None:
        self.input = ScalingState(amax_history_len, device=device)
        self.weight = ScalingState(amax_history_len, device=device)
        self.grad_output = ScalingState(amax_history_len, backward=True, device=device)
        self.weight_cache: CachedWeight | None = None
        self.ran_fp8 = False  # set by the first FP8 forward (to detect an FP8-less recompute)

    def cached_weight(self, weight: torch.Tensor, fp8_dtype: torch.dtype, kind: str = "delayed") -> CachedWeight:
        """The cached FP8 weight for ``weight`` [N, K] under recipe ``kind``; ValueError when there
        is none that fits."""
        cache = self.weight_cache
        if cache is None:
            raise ValueError(
                "is_first_microbatch=False, but this GEMM has no cached FP8 weight yet: pass "
                "is_first_microbatch=True on the first micro-batch of each step (inside an enabled "
                "fp8_autocast) to cast and cache the weight, then False on the following ones"
            )
        if cache.kind != kind:
            raise ValueError(
                f"is_first_microbatch=False: the cached FP8 weight was cast under the {cache.kind!r} recipe and this "
                f"call runs {kind!r}; pass is_first_microbatch=True to cast and cache it again"
            )
        if cache.data.shape != weight.shape or cache.data.dtype != fp8_dtype or cache.data.device != weight.device:
            raise ValueError(
                f"is_first_microbatch=False: the cached FP8 weight ({cache.data.dtype}, {tuple(cache.data.shape)}, "
                f"{cache.data.device}) does not fit this call's weight ({fp8_dtype}, {tuple(weight.shape)}, "
                f"{weight.device}); pass is_first_microbatch=True to cast and cache it again"
            )
        return cache

    def __repr__(self) -> str:
        return f"GemmScaling(input={self.input!r}, weight={self.weight!r}, grad_output={self.grad_output!r})"

    def prepare(self, amax_history_len: int, device: torch.device) -> None:
        for role in ROLES:
            getattr(self, role).prepare(amax_history_len, device)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {role: getattr(self, role).state_dict() for role in ROLES}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        unknown = sorted(set(state) - set(ROLES))
        if unknown:
            raise ValueError(f"FP8 GEMM state has unknown roles {unknown}; allowed: {list(ROLES)}")
        for role in ROLES:
            if role in state:
                getattr(self, role).load_state_dict(state[role])


@torch.no_grad()
def reduce_amax(states: list[ScalingState], group) -> None:
    """All-reduce (MAX) the in-progress amax (history[0]) of ``states`` over ``group``, in one call.

    Reducing the newest slot (rather than the computed amax) keeps every rank's whole history,
    and so every later scale, identical.
    """
    import torch.distributed as dist

    if not states:
        return
    current = torch.stack([s.amax_history[0] for s in states])
    if dist.get_backend(group) == "nccl" and not current.is_cuda:
        current = current.cuda()
    dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
    for s, value in zip(states, current.to(states[0].amax_history.device)):
        s.amax_history[0] = value


def update_scales(items: Iterable[tuple[ScalingState, DelayedScaling, object]]) -> None:
    """Reduce (where a group is given and the recipe says reduce_amax) and update each state.

    items: (state, recipe, fp8_group or None). States sharing a group are reduced in one
    all-reduce.
    """
    items = list(items)
    by_group: dict[int, tuple[object, list[ScalingState]]] = {}
    for state, recipe, group in items:
        if group is not None and recipe.reduce_amax:
            by_group.setdefault(id(group), (group, []))[1].append(state)
    for group, states in by_group.values():
        reduce_amax(states, group)
    together: dict[tuple, tuple[DelayedScaling, list[ScalingState]]] = {}
    for state, recipe, _ in items:
        if recipe.amax_compute_algo in ("max", "most_recent"):
            key = (id(recipe), state.backward, state.amax_history.numel(), state.amax_history.device)
            together.setdefault(key, (recipe, []))[1].append(state)
        else:  # a callable takes one history at a time
            state.update(recipe)
    for recipe, states in together.values():
        if len(states) == 1:
            states[0].update(recipe)
        else:
            _update_together(states, recipe)


def _new_scales(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) from amax (elementwise): fp8_max / amax / 2**margin where that is a
    positive finite number, else the old scale kept (amax 0, inf or NaN, or so small that the
    scale overflows). ``fp8_max / amax`` is what torch computes for a float over a tensor,
    reciprocal then multiply; positive and below inf is the same test as amax and the candidate
    both finite and positive (NaN fails both comparisons), in 3 ops rather than 13."""
    candidate = amax.reciprocal() * fp8_max
    if margin:
        candidate = candidate / (2.0 ** margin)
    scale = torch.where((candidate > 0) & (candidate < float("inf")), candidate, scale)
    return scale, scale.reciprocal()


@torch.no_grad()
def _update_together(states: list[ScalingState], recipe: DelayedScaling) -> None:
    """:meth:`ScalingState.update` for several states of one recipe, role, history length and
    device: the same elementwise ops on their stacked histories and scales, so the same values bit
    for bit, in about 16 ops for all of them instead of about 14 per state (a TransformerLayer
    under fp8_autocast updates 8 states each time the context exits: kernel launches whose host
    time a GPU otherwise waits on)."""
    history = torch.stack([s.amax_history for s in states])
    amax = history.amax(dim=1) if recipe.amax_compute_algo == "max" else history[:, 0]
    scale, scale_inv = _new_scales(amax, torch.stack([s.scale for s in states]), states[0].fp8_max(recipe),
                                   recipe.margin)
    history = torch.roll(history, 1, dims=1)
    history[:, 0] = 0.0
    torch._foreach_copy_([s.scale for s in states], list(scale.unbind(0)))
    torch._foreach_copy_([s.scale_inv for s in states], list(scale_inv.unbind(0)))
    torch._foreach_copy_([s.amax_history for s in states], list(history.unbind(0)))


__all__ = ["ROLES", "CachedWeight", "GemmScaling", "ScalingState", "reduce_amax", "update_scales"]
