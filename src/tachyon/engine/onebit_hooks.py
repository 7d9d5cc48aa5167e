"""What a training loop or the engine calls to train with OneBitAdam / OneBitLamb.

The 1-bit optimizers (`tachyon.engine.optim.onebit`) change who averages what, once
``freeze_step`` steps are done (``optimizer.in_compression_stage``):

- plain data parallelism (a manual loop, or ZeRO stage 0): the gradients are NOT averaged any
  more; each rank steps on its local gradient and the optimizer averages the momentum itself
  with the 1-bit compressed all-reduce. `averages_gradients(optimizer)` says which it is for
  the coming step; `reduce_gradients(optimizer, params)` is the one call a manual loop makes
  between ``backward()`` and ``step()``::

      loss.backward()
      reduce_gradients(optimizer, model.parameters())   # averages during warm-up only
      optimizer.step()

- ZeRO-1/2: a rank holds the optimizer state of one partition only, so it cannot form the full
  momentum. The optimizer then runs with ``reduce_momentum=False`` and the gradient
  reduce-scatter itself goes 1-bit compressed (`OneBitComm`, wrapped around the strategy's
  `DataParallelComm`, the seam it keeps for a gradient compressor): plain during warm-up,
  `tachyon.parallel.compression.CompressedReduceScatter` with error feedback after (one fp32
  worker-error buffer per bucket, i.e. 4 bytes per parameter on every rank, as DeepSpeed's
  1-bit Adam keeps).

`bind_onebit_optimizer(optimizer, zero)` sets all of that up once, right after the engine built
the optimizer over the strategy's flat fp32 masters: the process group, ``reduce_momentum``, the
per-parameter ``segments`` (OneBitLamb's norms and factors, the momentum equalization), the SUM
and MAX reducers over the ranks holding pieces of a parameter, the compressed comm (stages 1/2)
and the strategy's local-gradients switch (``zero.set_local_gradients``: stage 0 skips its
all-reduce once the optimizer averages its momentum itself; stages 1/2 never skip theirs).

Checkpoints: the engine writes the optimizer's tensors itself (`tachyon.engine.checkpoint`), not
its ``state_dict()``; the error buffers are this rank's own, so they belong with the per-rank
files: `error_feedback_state(optimizer)` on save, `load_error_feedback(optimizer, state)` on load.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from tachyon.engine.optim.masks import MaskedGroups
from tachyon.engine.optim.onebit import OneBitOptimizer
from tachyon.engine.zero.comm import DataParallelComm, Pending
from tachyon.parallel.compression import DEFAULT_BLOCK_SIZE, CompressedReduceScatter


def is_onebit(optimizer: object) -> bool:
    """Whether ``optimizer`` is OneBitAdam or OneBitLamb."""
    return isinstance(optimizer, OneBitOptimizer)


def averages_gradients(optimizer: object) -> bool:
    """Whether the gradients of the coming step must be averaged over the data-parallel ranks as
    usual (any optimizer but a 1-bit one past its warm-up that averages its momentum itself)."""
    return not (getattr(optimizer, "in_compression_stage", False) and getattr(optimizer, "reduce_momentum", True))


@torch.no_grad()
def average_gradients(params: Iterable[Tensor], group=None) -> None:
    """``param.grad`` <- its mean over the group, one SUM all-reduce per gradient dtype (the
    gradients are flattened into one buffer per dtype, then copied back). A no-op without an
    initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    size = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            if p.grad.is_sparse:
                raise ValueError("average_gradients: sparse gradients are not supported")
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat.narrow(0, offset, g.numel()).view_as(g))
            offset += g.numel()


def reduce_gradients(optimizer: object, params: Iterable[Tensor], group=None) -> bool:
    """A manual data-parallel loop's gradient reduction: `average_gradients` unless the optimizer
    takes local gradients this step (see the module docstring). Returns whether it averaged."""
    if averages_gradients(optimizer):
        average_gradients(params, group)
        return True
    return False


class OneBitComm:
    """A `DataParallelComm` whose bucket reduce-scatter goes 1-bit compressed once the optimizer
    is past its warm-up; every other collective (and the reduce-scatter before) is the wrapped
    comm's. It serves one ZeRO-1/2 strategy, whose buckets it keys the error buffers by.

    Args:
        comm: the strategy's `DataParallelComm`.
        optimizer: the 1-bit optimizer (``in_compression_stage`` decides).
        buckets: the strategy's `BucketScheduler`: ``buckets.next_index`` is the bucket being
            launched when its reduce-scatter is called, ``buckets.buckets[i].numel`` its size.
        loss_scale: returns the current loss scale (fp16), or None: gradients arrive scaled, so
            the error buffers are kept in the units of the scale they were made with and
            rescaled when it changes (an overflow halves it, growth doubles it).
        block_size: elements per compression scale.
        zero: the ZeRO-1/2 strategy, needed by `pending_errors` / `load_pending_errors`.

    The compressed reduce-scatter returns the SUM the strategy expects (mean times world size),
    so its pre- and post-division work unchanged. It runs synchronously (gloo and NCCL
    all_to_all are blocking here); its ``then`` runs when the strategy waits on it.
    """

    def __init__(self, comm: DataParallelComm, optimizer: OneBitOptimizer, buckets, *,
                 loss_scale: Callable[[], float] | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 zero=None) -> None:
        self.inner = comm
        self.optimizer = optimizer
        self.buckets = buckets
        self.zero = zero
        """The ZeRO-1/2 strategy served (its partition layout and gradient pre-division map the
        bucket errors to and from layout-free pending errors); optional for the rest."""
        self.loss_scale = loss_scale
        self.block_size = block_size
        self._reducers: dict[int, CompressedReduceScatter] = {}
        self._error_scale: float | None = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def compressing(self) -> bool:
        return bool(self.optimizer.in_compression_stage)

    @property
    def has_errors(self) -> bool:
        """Whether any bucket has an error buffer (it was compressed, or buffers were loaded)."""
        return bool(self._reducers)

    def reduce_scatter(self, output: Tensor, tensor: Tensor, *, async_op: bool = False, then=None) -> Pending:
        """As `DataParallelComm.reduce_scatter` (SUM), compressed when `compressing`."""
        if not self.compressing or not (self.inner.enabled or self._reducers):
            return self.inner.reduce_scatter(output, tensor, async_op=async_op, then=then)
        # one rank with buffers loaded from a larger run: the reducer adds them once (exactly)
        index = self.buckets.next_index
        if index >= len(self.buckets.buckets) or self.buckets.buckets[index].numel != tensor.numel():
            raise RuntimeError(
                f"OneBitComm: a reduce-scatter of {tensor.numel()} elements arrived outside a bucket launch "
                f"(bucket {index} of {len(self.buckets.buckets)}); the compressed reduce-scatter only serves the "
                "ZeRO strategy's gradient buckets")
        self._rescale_errors()
        reducer = self._reducer(index, tensor)
        try:
            reducer(tensor, output)
        except RuntimeError as error:
            raise self.inner.error("compressed reduce_scatter", error) from error
        output.mul_(self.inner.world_size)
        pending = Pending(self.inner, "compressed reduce_scatter", None, then)
        if not async_op:
            pending.wait()
        return pending

    def _reducer(self, index: int, tensor: Tensor) -> CompressedReduceScatter:
        reducer = self._reducers.get(index)
        if reducer is None:
            chunk = tensor.numel() // self.inner.world_size
            reducer = CompressedReduceScatter(chunk, group=self.inner.group, block_size=self.block_size,
                                              device=tensor.device)
            self._reducers[index] = reducer
        return reducer

    def _rescale_errors(self) -> None:
        if self.loss_scale is None:
            return
        scale = float(self.loss_scale())
        if self._error_scale is not None and scale != self._error_scale:
            for reducer in self._reducers.values():
                reducer.worker_error.mul_(scale / self._error_scale)
        self._error_scale = scale

    @torch.no_grad()
    def drop_nonfinite_errors(self) -> int:
        """Zero the error-feedback entries that a non-finite gradient made inf or nan (its step
        was skipped: `tachyon.engine.nonfinite`); without this every later step would carry them.
        Returns how many entries were reset (local, no collective)."""
        dropped = 0
        for reducer in self._reducers.values():
            bad = ~torch.isfinite(reducer.worker_error)
            dropped += int(bad.sum())
            reducer.worker_error.masked_fill_(bad, 0.0)
        return dropped

    # ------------------------------------------------------------------ pending error
    def _check_zero(self, what: str) -> None:
        if self.zero is None:
            raise RuntimeError(f"OneBitComm.{what}: built without its ZeRO strategy (zero=...)")

    @torch.no_grad()
    def pending_errors(self) -> list[Tensor]:
        """The gradient still owed to this rank's partition, per param group: fp32 tensors shaped
        like the strategy's masters (this rank's partition of each region), in the units of the
        averaged, unscaled gradient. Collective over the data-parallel group (one fp32
        reduce-scatter per compressed bucket).

        Why this is the quantity to keep: rank j's chunk of a compressed reduce-scatter returns
        ``mean_i C(g_i / pre + e_i)[j] = mean_i g_i[j] / pre + R_j(before) - R_j(after)`` with
        ``R = mean_i e_i`` (module `tachyon.parallel.compression`), and the strategy multiplies it
        by ``pre`` (its pre-division) on its way into the accumulator. ``pre * R / loss_scale``
        is therefore exactly what the ranks have taken from the averaged gradient and not yet
        given back. The individual ``e_i`` depend on the world size (each is a rank's own
        compression history), R does not: it is a value per element of the flat parameters, and
        its piece on a rank's partition moves with the partition to any layout."""
        self._check_zero("pending_errors")
        zero = self.zero
        pending = [torch.zeros_like(master, dtype=torch.float32) for master in zero.masters]
        if not self._reducers:
            return pending
        scale = self._error_scale or 1.0
        n = self.inner.world_size
        for bucket in self.buckets.buckets:
            c = bucket.numel // n
            reducer = self._reducers.get(bucket.index)
            error = reducer.worker_error if reducer is not None else torch.zeros(
                bucket.numel, dtype=torch.float32, device=pending[0].device)
            chunk = torch.empty(c, dtype=torch.float32, device=error.device)
            if self.inner.enabled:
                self.inner.reduce_scatter(chunk, error.clone())
            else:
                chunk.copy_(error)
            at = zero.shards.partition_offset[bucket.index]
            pending[bucket.region.index].narrow(0, at, c).copy_(chunk.mul_(zero.pre_divide / (n * scale)))
        return pending

    @torch.no_grad()
    def load_pending_errors(self, pending: list[Tensor | None]) -> None:
        """Rebuild the bucket error buffers from `pending_errors` saved by a run of any layout
        (this rank's partition of each region; None: nothing owed there). Rank j's worker
        error gets ``n * pending`` on its own chunk of every bucket and zero elsewhere: the mean
        over the n ranks, the only thing the result depends on, is then exactly the saved one,
        and no rank needs another's partition (no communication)."""
        self._check_zero("load_pending_errors")
        zero = self.zero
        self._reducers.clear()
        scale = float(self.loss_scale()) if self.loss_scale is not None else None
        self._error_scale = scale
        if all(p is None for p in pending):
            return
        n, rank = self.inner.world_size, self.inner.rank
        for bucket in self.buckets.buckets:
            owed = pending[bucket.region.index]
            if owed is None:
                continue
            c = bucket.numel // n
            at = zero.shards.partition_offset[bucket.index]
            piece = owed.reshape(-1).narrow(0, at, c).float()
            if not bool(piece.any()):
                continue
            reducer = self._reducer(bucket.index, torch.empty(bucket.numel, device=owed.device))
            reducer.worker_error.view(n, c)[rank].copy_(piece).mul_(n * (scale or 1.0) / zero.pre_divide)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's error buffers per bucket, with the layout they belong to (copies)."""
        return {"world_size": self.inner.world_size, "rank": self.inner.rank, "block_size": self.block_size,
                "bucket_numels": [b.numel for b in self.buckets.buckets], "error_scale": self._error_scale,
                "worker_errors": {i: r.worker_error.clone() for i, r in self._reducers.items()}}

    def matches(self, state: dict | None) -> bool:
        """Whether ``state`` was saved by this rank of a run with the same buckets."""
        layout = (self.inner.world_size, self.inner.rank, self.block_size, [b.numel for b in self.buckets.buckets])
        return bool(state) and (state.get("world_size"), state.get("rank"), state.get("block_size"),
                                state.get("bucket_numels")) == layout

    def load_state_dict(self, state: dict | None) -> None:
        """Restore buffers saved by this rank of a run with the same buckets; otherwise (or with
        None) they restart from zero, with a warning when some were dropped."""
        self._reducers.clear()
        self._error_scale = None
        if not state:
            return
        layout = (self.inner.world_size, self.inner.rank, self.block_size, [b.numel for b in self.buckets.buckets])
        saved = (state.get("world_size"), state.get("rank"), state.get("block_size"), state.get("bucket_numels"))
        if saved != layout:
            warnings.warn(
                f"OneBitComm: the checkpoint's gradient error-feedback buffers belong to rank {saved[1]} of "
                f"{saved[0]} with buckets {saved[3]}; this is rank {layout[1]} of {layout[0]} with buckets "
                f"{layout[3]}, so they restart from zero (at most a few steps' compression error is dropped)",
                stacklevel=2)
            return
        self._error_scale = state.get("error_scale")
        for index, error in state.get("worker_errors", {}).items():
            bucket = self.buckets.buckets[int(index)]
            reducer = self._reducer(int(index), torch.empty(bucket.numel, device=error.device))
            reducer.worker_error.copy_(error)


def bind_masks(optimizer: object, zero) -> None:
    """Give an optimizer that honours ``exp_avg_mask`` (`tachyon.engine.optim.masks.MaskedGroups`)
    the ZeRO strategy's layout of its groups' masks, and lay each mask out once, so that a mask
    that fits no layout is refused while the engine is built. The groups keep the masks as given."""
    if isinstance(optimizer, MaskedGroups) and hasattr(zero, "mask_layout"):
        optimizer.mask_layout = zero.mask_layout
        optimizer.check_masks()


def bind_onebit_optimizer(optimizer: object, zero, *, loss_scale: Callable[[], float] | None = None,
                          tp: object = None) -> bool:
    """Set a 1-bit optimizer up for the ZeRO strategy ``zero`` (see the module docstring); a
    no-op returning False for any other optimizer. Call once, after the optimizer was built over
    ``zero.optimizer_param_groups()`` and before the first backward. ``loss_scale``: returns the
    current fp16 loss scale (ZeRO-1/2 compress scaled gradients). ``tp``: the TPGroup under
    tensor parallelism, over which the replicated parameters are kept equal
    (`OneBitOptimizer._average_replicated`)."""
    if not is_onebit(optimizer):
        return False
    if optimizer._compressor is not None:
        raise RuntimeError("bind_onebit_optimizer: the optimizer already communicated compressed; bind it before "
                           "training")
    comm = zero.comm.inner if isinstance(zero.comm, OneBitComm) else zero.comm
    optimizer.group = comm.group
    optimizer.reduce_momentum = not zero.partitioned_masters
    ours = zero.optimizer_param_groups(with_segments=True)
    if len(ours) != len(optimizer.param_groups):
        raise ValueError(f"bind_onebit_optimizer: the optimizer has {len(optimizer.param_groups)} param groups; "
                         f"the ZeRO strategy {len(ours)} (one per flat master)")
    for group, mine in zip(optimizer.param_groups, ours):
        if group["params"][0] is not mine["params"][0]:
            raise ValueError("bind_onebit_optimizer: the optimizer's params are not the ZeRO strategy's masters")
        group["segments"], group["num_segments"] = mine["segments"], mine["num_segments"]
    optimizer._plans.clear()
    optimizer.norm_reducer = zero.norm_reducer
    if zero.partitioned_masters and comm.enabled:
        optimizer.max_reducer = lambda t: comm.all_reduce(t, op=dist.ReduceOp.MAX)
    else:
        optimizer.max_reducer = None
    if zero.partitioned_masters:
        wrapped = zero.comm if isinstance(zero.comm, OneBitComm) else OneBitComm(
            comm, optimizer, zero.buckets, loss_scale=loss_scale, block_size=optimizer.block_size, zero=zero)
        zero.comm = wrapped
        optimizer.gradient_reducer = wrapped
        if optimizer._saved_gradient_errors is not None:
            wrapped.load_state_dict(optimizer._saved_gradient_errors)
            optimizer._saved_gradient_errors = None
    zero.set_local_gradients(lambda: not averages_gradients(optimizer))
    optimizer.replicated = _replicated_elements(zero, tp) if tp is not None and tp.size > 1 else None
    return True


def _replicated_elements(zero, tp) -> tuple[object, list[Tensor | None]]:
    """(tp, per master: the indices of this rank's master elements that belong to parameters
    held whole on every tensor-parallel rank; None where there are none)."""
    from tachyon.parallel.tensor.shard import shard_spec

    whole = not zero.partitioned_masters or zero.world_size == 1
    per_group: list[list[Tensor]] = [[] for _ in zero.flat.regions]
    for slot, pieces in zip(zero.flat.slots, zero.master_pieces(zero.rank, whole=whole)):
        if shard_spec(slot.param) is None:
            per_group[slot.group] += [torch.arange(at, at + hi - lo) for lo, hi, at in pieces]
    device = zero.flat.buffer.device
    return tp, [torch.cat(parts).to(device) if parts else None for parts in per_group]


PENDING_GRADIENT_ERROR = "onebit_pending_gradient_error"
"""Optimizer state key (ZeRO-1/2): `OneBitComm.pending_errors` while a checkpoint is written."""
PENDING_MOMENTUM_ERROR = "onebit_pending_momentum_error"
"""Optimizer state key (stage 0): `OneBitOptimizer.pending_errors` while a checkpoint is written."""


def stage_pending_errors(optimizer: object) -> bool:
    """Before a checkpoint's tensors are written: put the layout-free pending error of every
    parameter (the mean over the ranks of what compression still owes it, see
    `OneBitComm.pending_errors` and `OneBitOptimizer.pending_errors`) into the optimizer state as
    ``PENDING_GRADIENT_ERROR`` (ZeRO-1/2) or ``PENDING_MOMENTUM_ERROR`` (stage 0), shaped like
    the parameter. The engine's checkpoint then writes it like ``exp_avg``, per logical
    parameter, and reads it back on any (dp, tp, pp) layout. `error_feedback_state` (called
    once the tensors are written) removes it again. Collective over the data-parallel group:
    call it on every rank; returns whether anything was staged (False before compression)."""
    if not is_onebit(optimizer):
        return False
    reducer = optimizer.gradient_reducer
    if reducer is not None:
        if not reducer.has_errors:
            return False
        per_group, key = [[t] for t in reducer.pending_errors()], PENDING_GRADIENT_ERROR
    else:
        per_group, key = optimizer.pending_errors(), PENDING_MOMENTUM_ERROR
        if per_group is None:
            return False
    for group, owed in zip(optimizer.param_groups, per_group):
        if len(owed) != len(group["params"]):
            raise RuntimeError(f"stage_pending_errors: {len(owed)} pending errors for a group of "
                               f"{len(group['params'])} parameters")
        for p, r in zip(group["params"], owed):
            optimizer.state[p][key] = r
    return True


def _take_pending(optimizer: OneBitOptimizer, key: str) -> list[list[Tensor | None]] | None:
    """Remove ``key`` from every parameter's state; per group and parameter, None where absent
    (None overall when no parameter had it)."""
    out = [[optimizer.state[p].pop(key, None) if p in optimizer.state else None for p in group["params"]]
           for group in optimizer.param_groups]
    return out if any(t is not None for owed in out for t in owed) else None


def error_feedback_state(optimizer: object) -> dict | None:
    """This rank's error-feedback buffers (momentum and ZeRO gradient ones) for a checkpoint's
    per-rank file; None for other optimizers. Also removes what `stage_pending_errors` put into
    the optimizer state (call it after the checkpoint's tensors are written)."""
    if not is_onebit(optimizer):
        return None
    _take_pending(optimizer, PENDING_GRADIENT_ERROR)
    _take_pending(optimizer, PENDING_MOMENTUM_ERROR)
    state = optimizer.state_dict()
    return {key: state[key] for key in ("error_feedback", "gradient_error_feedback") if key in state}


def load_error_feedback(optimizer: object, state: dict | None) -> None:
    """Restore the error feedback after the optimizer's tensors were loaded: ``state`` is what
    `error_feedback_state` saved in this rank's file (None where the checkpoint had no file for
    this rank). Buffers saved by this same rank of the same layout are restored as they were
    (the run continues bit for bit); on any other layout the pending errors the checkpoint
    carries in the optimizer state (`stage_pending_errors`) are rebuilt into this layout's
    buffers, which keeps the pending error of every parameter exactly. Without either the
    buffers restart from zero, with a warning. Makes no collective call."""
    if not is_onebit(optimizer):
        return
    state = state or {}
    gradient_pending = _take_pending(optimizer, PENDING_GRADIENT_ERROR)
    momentum_pending = _take_pending(optimizer, PENDING_MOMENTUM_ERROR)
    optimizer._compressor = None
    optimizer._saved_errors = state.get("error_feedback")
    optimizer.load_pending_errors(momentum_pending if optimizer.reduce_momentum else None)
    reducer = optimizer.gradient_reducer
    if momentum_pending is not None and not optimizer.reduce_momentum:
        warnings.warn("load_error_feedback: the checkpoint holds the momentum error of a stage-0 run; this run "
                      "compresses ZeRO gradient buckets, so it is dropped", stacklevel=2)
    if gradient_pending is not None and reducer is None:
        warnings.warn("load_error_feedback: the checkpoint holds the gradient error of a ZeRO-1/2 run; this run "
                      "compresses the momentum (stage 0), so it is dropped", stacklevel=2)
    saved = state.get("gradient_error_feedback")
    if reducer is None:
        optimizer._saved_gradient_errors = saved
    elif not reducer.matches(saved) and gradient_pending is not None:
        reducer.load_pending_errors([owed[0] for owed in gradient_pending])
    else:
        reducer.load_state_dict(saved)


__all__ = [
    "PENDING_GRADIENT_ERROR", "PENDING_MOMENTUM_ERROR", "OneBitComm", "average_gradients", "averages_gradients",
    "bind_masks", "bind_onebit_optimizer", "error_feedback_state", "is_onebit", "load_error_feedback", "reduce_gradients",
    "stage_pending_errors",
]
