"""What OneBitAdam and OneBitLamb share: the two stages, the compressed momentum, the state.

1-bit Adam (Tang et al. 2021) and 1-bit LAMB (Li et al. 2021) run in two stages:

- warm-up, the first ``freeze_step`` steps: the plain optimizer (Adam / LAMB) on gradients the
  caller has averaged over the data-parallel group as usual.
- compression, every step after: the variance ``exp_avg_sq`` is frozen (LAMB: also its per-
  parameter trust ratios, see onebit_lamb.py). ``step()`` then takes each rank's LOCAL gradient
  (the caller must NOT average it), updates the local momentum
  ``m_i = beta1 * m + (1 - beta1) * g_i`` and averages the momenta with the 1-bit compressed
  all-reduce of `tachyon.parallel.compression` (sign bits + one scale per block, error feedback
  on both sides): 1/32 of the bytes of an fp32 gradient all-reduce. Since the variance no
  longer moves, averaging the momentum is averaging the update.

``in_compression_stage`` (DeepSpeed: ``adam_freeze_key`` / ``lamb_freeze_key``) says which kind
of gradient the NEXT step needs: the caller averages gradients while it is False and stops once
it is True. Every rank calls ``step()`` equally often, so every rank switches at the same step.

The momenta of every parameter (all groups) are communicated as ONE flat fp32 buffer: the
``exp_avg`` states are views into it (one all_to_all and one all_gather per step; DeepSpeed's
1-bit Adam makes two collectives per parameter). Parameters of very different momentum
magnitudes share that buffer, so at the first compressed step each parameter gets
``scaling_coeff = mean_k(rms_k) / rms_k`` (rms_k: root mean square of parameter k's momentum
after the warm-up, the same on every rank),
DeepSpeed 1-bit LAMB's equalization, here for both optimizers: momenta are multiplied by it before
the all-reduce and divided after.

Elements whose frozen variance is exactly zero (no nonzero gradient during the whole warm-up:
an embedding row of a token never seen, padding) keep a zero momentum after freeze_step. 1-bit
compression cannot send an exact zero (every element goes out as +-scale), and that noise divided
by sqrt(0) + eps would throw such elements far away; DeepSpeed leaves this to a user-provided
``exp_avg_mask``, which is still honoured on top.

``reduce_momentum=False`` is the mode for ZeRO-1/2 partitions (each rank holds one partition of
the parameters and states, so it cannot form the full local momentum): ``step()`` then
communicates nothing and expects gradients the caller has averaged in BOTH stages; after
freeze_step the caller's reduce-scatter runs compressed
(`tachyon.parallel.compression.CompressedReduceScatter`: rank j receives
``mean_i C(g_i + e_i)[chunk j]`` and adds the shared ``beta1 * m_j`` itself by updating its
momentum). See docs/onebit.md.

Parameter groups are ordinary tensors, or one flat tensor with ``segments`` / ``num_segments``
(the ZeRO layout, see tachyon.engine.optim.lamb): per-parameter quantities (scaling
coefficients, LAMB's norms) are then per segment. ``norm_reducer`` (SUM) and ``max_reducer``
(MAX) all-reduce per-segment values in place across ranks holding pieces of the same parameter
(partitioned flat tensors; None = nothing to reduce).

State per tensor (fp32 whatever the parameter dtype): ``step``, ``exp_avg``, ``exp_avg_sq`` (as
torch.optim.AdamW), ``variance_step`` (int: how many updates the frozen variance had); per group,
on its first tensor: ``scaling_coeff`` [num_segments]. ``state_dict()`` adds
``error_feedback``: this rank's error buffers and the layout they belong to
(`tachyon.parallel.compression.CompressedAllReduce.state_dict`). ``load_state_dict`` restores
them when saved by the same rank of a run with the same world size and parameters; otherwise
the error buffers restart from zero (a warning says so: what they held, at most a few steps'
compression error, is dropped once). `reshard_onebit_state_dicts` maps the error buffers of all
ranks onto another world size exactly (the residual they owe the average is kept). With ZeRO the
per-bucket gradient error buffers of the engine's compressed reduce-scatter
(``gradient_reducer``, `tachyon.engine.onebit_hooks.OneBitComm`) travel as
``gradient_error_feedback``, restored on the same layout only. Through the engine's checkpoint
both kinds also travel as a layout-free pending error per parameter (`pending_errors`,
`tachyon.engine.onebit_hooks.stage_pending_errors`), which rebuilds them exactly, in the sense
of the residual the ranks owe, on any world size (docs/onebit.md, "Checkpoints").
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from tachyon.engine.optim._state import advance_adam_state, check_adam_hyperparameters, restore_fp32_states
from tachyon.engine.optim.lamb import _check_segments, segment_runs
from tachyon.engine.optim.masks import MaskedGroups
from tachyon.parallel.compression import (
    DEFAULT_BLOCK_SIZE,
    CompressedAllReduce,
    all_gather_into,
    reshard_error_feedback,
)

logger = logging.getLogger(__name__)

COMM_BACKENDS = ("nccl", "gloo")
"""Accepted ``comm_backend_name`` values. Either means torch.distributed collectives on the data-
parallel group's own backend (NCCL on GPUs, gloo on CPU). DeepSpeed's "mpi" and "hccl" backends
are not available."""

FP32_STATES = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "scaling_coeff", "lamb_coeff_freeze", "last_factor")


@dataclass
class SegmentPlan:
    """Which original parameter every element of a group's tensors belongs to.

    rows[i]: (start, length, segment id) pieces of tensor i (flattened); runs[i]: (slot per run,
    run lengths) covering tensor i completely, padding gaps in slot ``num_segments``; whole[i]:
    the segment id when tensor i is exactly one segment (ordinary parameters), else None.
    """

    rows: list[list[tuple[int, int, int]]]
    ids: Tensor
    runs: list[tuple[Tensor, Tensor]]
    whole: list[int | None]
    sizes: list[int]
    shapes: list[torch.Size]
    num_segments: int
    key: tuple

    def _pieces(self, tensors: list[Tensor | None]) -> tuple[list[Tensor], Tensor]:
        """The pieces of the given tensors (None: a tensor left out) and their segment ids."""
        pieces = [t.reshape(-1).narrow(0, s, n) for t, rows in zip(tensors, self.rows) if t is not None
                  for s, n, _ in rows]
        if all(t is not None for t in tensors):
            return pieces, self.ids
        ids = [seg for t, rows in zip(tensors, self.rows) if t is not None for _, _, seg in rows]
        return pieces, torch.tensor(ids, dtype=torch.int64, device=self.ids.device)

    def sums(self, tensors: list[Tensor | None], reducer=None) -> Tensor:
        """fp32 [num_segments]: per segment, the sum of squares of ``tensors`` (one per tensor of
        the group, None = left out), all-reduced in place with ``reducer`` when given."""
        out = torch.zeros(self.num_segments, dtype=torch.float32, device=self.ids.device)
        pieces, ids = self._pieces(tensors)
        if pieces:
            out.index_add_(0, ids, torch.stack(torch._foreach_norm(pieces)).float().square())
        if reducer is not None:
            reducer(out)
        return out

    def maxima(self, tensors: list[Tensor | None], reducer=None) -> Tensor:
        """fp32 [num_segments]: per segment the largest element (-inf where it has none here),
        all-reduced in place with ``reducer`` (a MAX) when given."""
        out = torch.full((self.num_segments,), float("-inf"), dtype=torch.float32, device=self.ids.device)
        pieces, ids = self._pieces(tensors)
        if pieces:
            foreach_max = getattr(torch, "_foreach_max", None)  # torch >= 2.5
            values = foreach_max(pieces) if foreach_max is not None else [p.max() for p in pieces]
            out.scatter_reduce_(0, ids, torch.stack(list(values)).float(), reduce="amax")
        if reducer is not None:
            reducer(out)
        return out

    def numels(self) -> Tensor:
        """fp32 [num_segments]: elements of each segment held here."""
        out = torch.zeros(self.num_segments, dtype=torch.float32, device=self.ids.device)
        lengths = [float(n) for rows in self.rows for _, n, _ in rows]
        if lengths:
            out.index_add_(0, self.ids, torch.tensor(lengths, device=self.ids.device))
        return out

    def expand(self, values: Tensor, i: int, pad: float) -> Tensor:
        """Per-segment ``values`` [num_segments] as a factor for tensor i: a 0-d tensor when
        the tensor is one segment, else one value per element (``pad`` on padding) in the
        tensor's shape."""
        if self.whole[i] is not None:
            return values[self.whole[i]]
        slots, lengths = self.runs[i]
        extended = torch.cat([values, values.new_full((1,), pad)])
        return torch.repeat_interleave(extended[slots], lengths, output_size=self.sizes[i]).view(self.shapes[i])


def _plan_for(group: dict) -> SegmentPlan:
    params = group["params"]
    device = params[0].device
    if "segments" in group:
        if len(params) != 1:
            raise ValueError(f"a param group with 'segments' must hold exactly one (flat) tensor; got {len(params)}")
        n = group.get("num_segments")
        rows = [_check_segments(group["segments"], n, params[0].numel())]
        whole: list[int | None] = [None]
    else:
        if "num_segments" in group:
            raise ValueError("param group has 'num_segments' but no 'segments'")
        n = len(params)
        rows = [[(0, p.numel(), i)] if p.numel() else [] for i, p in enumerate(params)]
        whole = list(range(n))
    runs = []
    for t, tensor_rows in zip(params, rows):
        slots, lengths = segment_runs(tensor_rows, t.numel(), n)
        runs.append((torch.tensor(slots, dtype=torch.int64, device=device),
                     torch.tensor(lengths, dtype=torch.int64, device=device)))
    ids = torch.tensor([seg for tensor_rows in rows for _, _, seg in tensor_rows], dtype=torch.int64, device=device)
    key = (tuple(id(p) for p in params), id(group.get("segments")))
    return SegmentPlan(rows, ids, runs, whole, [p.numel() for p in params], [p.shape for p in params], n, key)


def check_onebit_arguments(name: str, *, lr, betas, eps, weight_decay, freeze_step, eps_inside_sqrt,
                           max_grad_norm, amsgrad, cuda_aware, comm_backend_name, block_size) -> None:
    """ValueError naming the first argument outside what the 1-bit optimizers support."""
    check_adam_hyperparameters(name, lr, betas, eps, weight_decay)
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(f"{name}: freeze_step must be an int >= 1 (the number of uncompressed warm-up steps "
                         f"that fill the variance before it is frozen); got {freeze_step!r}")
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (1-bit optimizers freeze the variance); use False")
    if eps_inside_sqrt:
        raise ValueError(f"{name}: eps_inside_sqrt=True is not supported (DeepSpeed's 1-bit optimizers accept "
                         "and ignore it); use False: eps is added to sqrt(exp_avg_sq)")
    if max_grad_norm:
        raise ValueError(f"{name}: max_grad_norm={max_grad_norm!r} is not supported (DeepSpeed ignores it); clip "
                         "before step() (the engine's gradient_clipping); use 0")
    if not isinstance(cuda_aware, bool):
        raise ValueError(f"{name}: cuda_aware must be a bool; got {cuda_aware!r}")
    if comm_backend_name not in COMM_BACKENDS:
        raise ValueError(f"{name}: comm_backend_name={comm_backend_name!r} is not supported; allowed: "
                         f"{', '.join(COMM_BACKENDS)} (both run torch.distributed collectives on the group's backend)")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 32:
        raise ValueError(f"{name}: block_size must be an int >= 32 (elements per compression scale); "
                         f"got {block_size!r}")


class OneBitOptimizer(MaskedGroups, torch.optim.Optimizer):
    """Base of OneBitAdam and OneBitLamb (see the module docstring). Subclasses implement
    ``_warmup_group(group, plan)`` and ``_compressed_group(group, plan, previous_momenta)``."""

    keeps_previous_momentum = False
    """LAMB reconstructs the averaged gradient from the momentum before and after the step."""

    def __init__(self, params, defaults: dict, *, freeze_step: int, cuda_aware: bool, comm_backend_name: str,
                 group=None, block_size: int = DEFAULT_BLOCK_SIZE, reduce_momentum: bool = True) -> None:
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.cuda_aware = cuda_aware  # an MPI setting in DeepSpeed; torch.distributed needs none
        self.comm_backend_name = comm_backend_name
        self.group = group
        self.block_size = block_size
        self.reduce_momentum = bool(reduce_momentum)
        self.norm_reducer = None
        self.max_reducer = None
        self._plans: dict[int, SegmentPlan] = {}
        self._compressor: CompressedAllReduce | None = None
        self._flat: tuple[Tensor, list[Tensor]] | None = None
        self._saved_errors: dict | None = None
        self._saved_pending: list[Tensor | None] | None = None
        self.gradient_reducer = None
        """ZeRO-1/2: the engine's compressed gradient reduce-scatter
        (`tachyon.engine.onebit_hooks.OneBitGradientReducer`), whose error buffers travel in
        this optimizer's state dict as ``gradient_error_feedback``."""
        self._saved_gradient_errors: dict | None = None
        self.replicated: tuple[object, list[Tensor | None]] | None = None
        """Tensor parallelism: (TPGroup, per param group the master elements of parameters every
        tensor-parallel rank holds whole), set by `tachyon.engine.onebit_hooks.bind_onebit_optimizer`;
        see `_average_replicated`."""

    # ------------------------------------------------------------------ stage
    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken so far (the largest per-tensor ``step``)."""
        steps = [int(s["step"]) for s in self.state.values() if "step" in s]
        return max(steps, default=0)

    @property
    def in_compression_stage(self) -> bool:
        """True once ``freeze_step`` steps are done: the next ``step()`` takes LOCAL gradients
        (with ``reduce_momentum``; averaged ones otherwise) and keeps the variance frozen."""
        return self.steps_taken >= self.freeze_step

    def plan(self, group: dict) -> SegmentPlan:
        plan = self._plans.get(id(group))
        if plan is None or plan.key != (tuple(id(p) for p in group["params"]), id(group.get("segments"))):
            plan = self._plans[id(group)] = _plan_for(group)
        return plan

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One update (see the module docstring for which gradients it expects); returns closure()."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.in_compression_stage
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__}: sparse gradients are not supported")
        if not compressing:
            for group in self.param_groups:
                if any(p.grad is not None for p in group["params"]):
                    self._warmup_group(group, self.plan(group))
            return loss
        self._compressed_step()
        return loss

    def _compressed_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    raise RuntimeError(f"{type(self).__name__}: a parameter of shape {tuple(p.shape)} got no gradient "
                                       "during the warm-up, so it has no variance to freeze; give every "
                                       "parameter gradients before freeze_step, or leave it out of the optimizer")
        if self.reduce_momentum and any("scaling_coeff" not in self.state[g["params"][0]] for g in self.param_groups):
            # from the momentum of the last warm-up step, identical on every rank (DeepSpeed 1-bit
            # LAMB does the same): computed from this step's LOCAL momenta the ranks would scale
            # differently and drift apart
            self._set_scaling_coefficients()
        previous: list[list[Tensor]] = []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            kept = []
            for p in group["params"]:
                state = self.state[p]
                t = advance_adam_state(state, p)
                if "variance_step" not in state:
                    state["variance_step"] = t - 1
                m = state["exp_avg"]
                if self.keeps_previous_momentum:
                    kept.append(m.clone())
                m.mul_(beta1)
                if p.grad is not None:  # a parameter without a gradient here contributes zero
                    m.add_(p.grad.float(), alpha=1.0 - beta1)
            previous.append(kept)
        if self.reduce_momentum:
            self._all_reduce_momentum()
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                state = self.state[p]
                # never-trained elements stay still (see the module docstring)
                state["exp_avg"].masked_fill_(state["exp_avg_sq"] == 0, 0.0)
                mask = self.group_mask(index, group, p)
                if mask is not None:
                    state["exp_avg"].mul_(mask)
        for group, kept in zip(self.param_groups, previous):
            self._compressed_group(group, self.plan(group), kept)
        self._average_replicated()

    def _average_replicated(self) -> None:
        """Keep the replicated parameters equal on the tensor-parallel ranks. Their gradients are
        equal there, but each rank compresses its own flat buffer, where they share scaling
        blocks with its tensor-parallel shards, so the ranks' reconstructions of their momentum
        differ. After each compressed step the replicated elements of the master and of the
        momentum are averaged over the tensor-parallel group (one all-reduce of 2x their fp32
        bytes): the same update as if every rank had applied the mean of the reconstructions."""
        if self.replicated is None:
            return
        tp, indices = self.replicated
        for group, idx in zip(self.param_groups, indices):
            if idx is None:
                continue
            for p in group["params"]:
                flat, momentum = p.data.view(-1), self.state[p]["exp_avg"].view(-1)
                both = torch.cat([flat.index_select(0, idx).float(), momentum.index_select(0, idx)])
                dist.all_reduce(both, group=tp.group)
                both.div_(tp.size)
                flat.index_copy_(0, idx, both[:idx.numel()].to(flat.dtype))
                momentum.index_copy_(0, idx, both[idx.numel():])

    # ------------------------------------------------------------------ communication
    def _momenta(self) -> list[Tensor]:
        return [self.state[p]["exp_avg"] for group in self.param_groups for p in group["params"]]

    def _flat_momentum(self) -> Tensor:
        """The flat fp32 buffer every ``exp_avg`` is a view of (built, or rebuilt after a load)."""
        momenta = self._momenta()
        if self._flat is not None and len(self._flat[1]) == len(momenta) and all(
                a is b for a, b in zip(self._flat[1], momenta)):
            return self._flat[0]
        devices = {m.device for m in momenta}
        if len(devices) != 1:
            raise ValueError(f"{type(self).__name__}: all parameters must be on one device to share the compressed "
                             f"all-reduce; got {sorted(map(str, devices))}")
        flat = torch.cat([m.reshape(-1) for m in momenta])
        views, offset = [], 0
        for group in self.param_groups:
            for p in group["params"]:
                view = flat.narrow(0, offset, p.numel()).view(p.shape)
                self.state[p]["exp_avg"] = view
                views.append(view)
                offset += p.numel()
        self._flat = (flat, views)
        return flat

    def _all_reduce_momentum(self) -> None:
        flat = self._flat_momentum()
        scales = [self._scale_factors(group) for group in self.param_groups]
        for group, factors in zip(self.param_groups, scales):
            for p, f in zip(group["params"], factors):
                self.state[p]["exp_avg"].mul_(f)
        if self._compressor is None:
            self._compressor = CompressedAllReduce(flat.numel(), group=self.group, block_size=self.block_size,
                                                   device=flat.device)
            self._restore_errors(scales)
        self._compressor(flat)
        for group, factors in zip(self.param_groups, scales):
            for p, f in zip(group["params"], factors):
                self.state[p]["exp_avg"].div_(f)

    def _set_scaling_coefficients(self) -> None:
        """scaling_coeff per segment = mean over all parameters of rms(momentum) / own rms."""
        rms = []
        for group in self.param_groups:
            plan = self.plan(group)
            momenta = [self.state[p]["exp_avg"] for p in group["params"]]
            rms.append((plan.sums(momenta) / plan.numels().clamp(min=1)).sqrt())
        everything = torch.cat(rms)
        united = everything.mean() if everything.numel() else everything.new_tensor(1.0)
        for group, values in zip(self.param_groups, rms):
            coeff = torch.where(values > 0, united / values, torch.ones_like(values))
            self.state[group["params"][0]]["scaling_coeff"] = coeff

    def _scale_factors(self, group: dict) -> list[Tensor]:
        plan = self.plan(group)
        coeff = self.state[group["params"][0]]["scaling_coeff"]
        return [plan.expand(coeff, i, 1.0) for i in range(len(group["params"]))]

    def _restore_errors(self, scales: list[list[Tensor]]) -> None:
        saved, self._saved_errors = self._saved_errors, None
        pending, self._saved_pending = self._saved_pending, None
        if saved is not None and self._compressor.matches(saved):
            self._compressor.load_state_dict(saved)  # the same rank and layout: bit for bit
            return
        if pending is not None:
            # another layout: every rank's worker error is the residual R (their mean is then
            # R, exactly), the server errors zero; R goes back into the equalized units
            flat_owed = []
            for group, factors, owed in zip(self.param_groups, scales, pending):
                for p, f, r in zip(group["params"], factors, owed):
                    r = torch.zeros(p.shape, dtype=torch.float32, device=p.device) if r is None else r
                    flat_owed.append((r.to(device=p.device, dtype=torch.float32) * f).reshape(-1))
            n = self._compressor.layout.numel
            self._compressor.worker_error.zero_()
            self._compressor.server_error.zero_()
            self._compressor.worker_error[:n].copy_(torch.cat(flat_owed))
            return
        if saved is None:
            return
        warnings.warn(
            f"{type(self).__name__}: the checkpoint's error-feedback buffers belong to rank {saved.get('rank')} of "
            f"{saved.get('world_size')} ({saved.get('numel')} elements); this is rank {self._compressor.rank} of "
            f"{self._compressor.world_size} ({self._compressor.layout.numel} elements), so they restart from zero. "
            "To keep them, map the checkpoints with tachyon.engine.optim.reshard_onebit_state_dicts",
            stacklevel=3)

    @torch.no_grad()
    def pending_errors(self) -> list[list[Tensor]] | None:
        """The momentum the ranks have taken from the exact average and not yet given back, per
        group and parameter (fp32, shaped like the parameter, identical on every rank), or None
        before the first compressed step. Collective over ``group`` (one fp32 all-reduce of the
        worker errors and one all-gather of the server errors).

        With R = mean_i worker_error_i + concat_j server_error_j, every compressed all-reduce
        returns ``mean_i m_i + R_before - R_after`` (`tachyon.parallel.compression`): R alone,
        not the individual buffers, is what the next steps will pay out, and it is a value per
        element of the momentum, whatever the world size. It is returned divided by the
        per-parameter equalization (``scaling_coeff``), i.e. in momentum units. Loaded and not yet
        used (`load_pending_errors`), it is returned as loaded, without communicating."""
        if not self.reduce_momentum:
            return None
        if self._compressor is None:
            if self._saved_pending is None:
                return None
            return [[r.float().clone() if r is not None else torch.zeros(p.shape, device=p.device)
                     for p, r in zip(group["params"], owed)]
                    for group, owed in zip(self.param_groups, self._saved_pending)]
        comp = self._compressor
        n, numel = comp.world_size, comp.layout.numel
        worker = comp.worker_error.clone()
        server = comp.server_error
        if n > 1:
            dist.all_reduce(worker, group=self.group)
            worker.div_(n)
            gathered = torch.empty(n * server.numel(), dtype=server.dtype, device=server.device)
            all_gather_into(gathered, server, self.group)
            server = gathered
        residual = worker[:numel].add_(server[:numel])
        out, offset = [], 0
        for group in self.param_groups:
            owed = []
            for p, f in zip(group["params"], self._scale_factors(group)):
                owed.append(residual.narrow(0, offset, p.numel()).view(p.shape).div(f))
                offset += p.numel()
            out.append(owed)
        return out

    def load_pending_errors(self, pending: list[list[Tensor | None]] | None) -> None:
        """Restore the momentum error from `pending_errors` saved by a run of any world size; it
        takes effect at the next compressed step (unless a state of this same rank and layout
        was loaded as well: that one is exact and wins)."""
        self._compressor = None
        if pending is not None and len(pending) != len(self.param_groups):
            raise ValueError(f"{type(self).__name__}.load_pending_errors: {len(pending)} groups for "
                             f"{len(self.param_groups)} param groups")
        self._saved_pending = pending

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """torch's state dict plus ``error_feedback`` (this rank's buffers), once compressing."""
        state = super().state_dict()
        if self._compressor is not None:
            state["error_feedback"] = self._compressor.state_dict()
        elif self._saved_errors is not None:
            state["error_feedback"] = self._saved_errors
        if self.gradient_reducer is not None:
            state["gradient_error_feedback"] = self.gradient_reducer.state_dict()
        elif self._saved_gradient_errors is not None:
            state["gradient_error_feedback"] = self._saved_gradient_errors
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (states kept fp32; the current ``exp_avg_mask`` of each group kept, as
        DeepSpeed does), then the error buffers (see the module docstring for when they are
        dropped). Works on any world size: momentum and frozen states are the same on every rank."""
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [dict(g) for g in state_dict["param_groups"]]
        for saved, mask in zip(state_dict["param_groups"], masks):
            saved.pop("exp_avg_mask", None)
            if mask is not None:
                saved["exp_avg_mask"] = mask
        super().load_state_dict(state_dict)
        restore_fp32_states(self, state_dict, FP32_STATES)
        self._flat = None
        self._compressor = None
        self._plans.clear()
        self._saved_errors = state_dict.get("error_feedback")
        self._saved_pending = None
        self._saved_gradient_errors = state_dict.get("gradient_error_feedback")
        if self.gradient_reducer is not None:
            self.gradient_reducer.load_state_dict(self._saved_gradient_errors)
            self._saved_gradient_errors = None

    # subclasses
    def _warmup_group(self, group: dict, plan: SegmentPlan) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _compressed_group(self, group: dict, plan: SegmentPlan, previous: list[Tensor]) -> None:  # pragma: no cover
        raise NotImplementedError



def reshard_onebit_state_dicts(state_dicts: list[dict], world_size: int) -> list[dict]:
    """State dicts of every rank of a 1-bit run (rank order) -> ``world_size`` state dicts whose
    error-feedback buffers are resharded with `tachyon.parallel.compression.reshard_error_feedback`
    (the total residual is kept exactly); the rest is rank 0's (identical on every rank). On another
    world size the ZeRO ``gradient_error_feedback`` is left out (its bucket layout changes)."""
    if not state_dicts:
        raise ValueError("reshard_onebit_state_dicts: give the state dicts of every rank of one run; got none")
    if world_size == len(state_dicts):
        return [dict(sd) for sd in state_dicts]
    errors = [sd.get("error_feedback") for sd in state_dicts]
    # the ZeRO gradient error buffers (one per bucket) follow bucket boundaries that change with
    # the world size: they are left out and restart from zero
    base = {k: v for k, v in state_dicts[0].items() if k not in ("error_feedback", "gradient_error_feedback")}
    if all(e is None for e in errors):
        return [dict(base) for _ in range(world_size)]
    if any(e is None for e in errors):
        raise ValueError("reshard_onebit_state_dicts: some state dicts have error_feedback and some do not; "
                         "give the state dicts of every rank of one run")
    return [dict(base, error_feedback=e) for e in reshard_error_feedback(errors, world_size)]
