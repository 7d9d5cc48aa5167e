"""`ZeroStrategy`: what ZeRO stages 0, 1 and 2 share (the flat layout, buckets, fp32 masters,
the optimizer's param groups, the step and the memory breakdown). The stages and their data
flow: `tachyon.engine.zero.stages`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from .buckets import Bucket, BucketScheduler, cut_buckets
from .comm import DataParallelComm, Pending
from .layout import FlatParameters, GroupRegion
from .offload import OffloadPlan, host_empty, host_zeros, offloaded_bytes, pinned_bytes
from .shards import Shards

_OWNER: dict[int, weakref.ref] = {}
"""id(parameter) -> (weak reference to) the strategy whose hooks it carries: a model given to
initialize() twice must not keep feeding the first engine's buffers. A live strategy holds its
parameters, so an id cannot be reused while its entry is alive."""


class ZeroStrategy:
    """Base of the three stages. See `tachyon.engine.zero.stages` for the data flow.

    Args:
        param_groups: torch-optimizer-style groups over the model's parameters (model dtype).
        model_dtype, grad_accum_dtype: from the precision object.
        comm: the data-parallel collectives.
        device: where the buffers live.
        reduce_bucket_size: elements per gradient bucket (DeepSpeed's key); a bucket buffer never
            holds more bytes than this many model-dtype elements, so with a wider ``comm_dtype``
            a bucket holds fewer elements.
        allgather_bucket_size: accepted for DeepSpeed configs; the all-gather needs no buffer.
        overlap_comm: keep bucket reductions in flight during backward (two bucket buffers).
        comm_dtype: dtype gradients are reduced in (None: the model dtype, DeepSpeed's default).
        gradient_predivide_factor, prescale_gradients: see `tachyon.engine.zero.stages`.
        offload: ZeRO-Offload (`tachyon.engine.zero.offload`): masters, optimizer states and an
            fp32 gradient accumulator on the host (stages 1 and 2).
    """

    stage: int = -1
    partitioned_masters: bool = False

    def __init__(
        self,
        param_groups: list[dict],
        *,
        model_dtype: torch.dtype,
        grad_accum_dtype: torch.dtype,
        comm: DataParallelComm,
        device: torch.device,
        reduce_bucket_size: int = 500_000_000,
        allgather_bucket_size: int = 500_000_000,
        overlap_comm: bool = False,
        comm_dtype: torch.dtype | None = None,
        gradient_predivide_factor: float = 1.0,
        prescale_gradients: bool = False,
        offload: OffloadPlan | None = None,
    ):
        for name, value in (("reduce_bucket_size", reduce_bucket_size), ("allgather_bucket_size", allgather_bucket_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"zero_optimization.{name} should be a positive number of elements; got {value!r}")
        self.comm = comm
        self.world_size, self.rank = comm.world_size, comm.rank
        self.offload = offload or OffloadPlan()
        if self.offload.optimizer and not self.partitioned_masters:
            raise ValueError("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (stage 0 keeps no partition "
                             "to offload)")
        if self.offload.optimizer:  # gradients accumulate in fp32 on the host (DeepSpeed's ZeRO-Offload)
            grad_accum_dtype = torch.float32
        self.model_dtype, self.grad_accum_dtype = model_dtype, grad_accum_dtype
        self.comm_dtype = comm_dtype or model_dtype
        self.allgather_bucket_size = allgather_bucket_size
        self.pre_divide = float(self.world_size) if prescale_gradients else float(gradient_predivide_factor)
        self.post_divide = self.world_size / self.pre_divide
        self.flat = FlatParameters(param_groups, model_dtype, device, self.world_size)
        self.bucket_numel = max(1, reduce_bucket_size * model_dtype.itemsize // self.comm_dtype.itemsize)
        buckets = cut_buckets(self.flat, self.bucket_numel)
        self.shards = Shards(self.flat, buckets)
        self.buckets = BucketScheduler(buckets, self._launch, overlap_comm)
        self._master_alias = [self._can_alias(region) for region in self.flat.regions]
        self.masters = [self._make_master(region) for region in self.flat.regions]
        self._accumulator: torch.Tensor | None = None
        self._exposed: dict[int, torch.Tensor] = {}
        """id(param) -> the view of the accumulator left in ``param.grad`` (stage 0)."""
        self._slot_of = {id(slot.param): slot for slot in self.flat.slots}
        self._reducing = False
        for key in [k for k, ref in _OWNER.items() if ref() is None]:  # engines gone since
            del _OWNER[key]
        for slot in self.flat.slots:
            ref = _OWNER.get(id(slot.param))
            previous = ref() if ref is not None else None
            if previous is not None and previous is not self:
                previous.release()
            _OWNER[id(slot.param)] = weakref.ref(self)
        self._local_gradients: Callable[[], bool] | None = None
        self._model_parallel_sum: Callable[[torch.Tensor], object] | None = None
        self._duplicates: set[int] = set()
        self._counted: list[list[tuple[int, int]]] | None = None
        self._hooks: list = []
        self._register_hooks()

    def _register_hooks(self) -> None:
        self._hooks = [slot.param.register_post_accumulate_grad_hook(self._on_grad) for slot in self.flat.slots]

    def release(self) -> None:
        """Remove this strategy's gradient hooks (the parameters stay views of its buffer)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def set_model_parallel(self, sum_: Callable[[torch.Tensor], object], duplicates: set[int]) -> None:
        """The model is split over other ranks too (tensor / pipeline parallelism): ``sum_`` SUM
        all-reduces a fp32 tensor in place over them, and ``duplicates`` holds ``id()`` of the
        parameters whose gradient another rank counts already (a replicated parameter on a
        tensor-parallel rank other than 0, a tied weight's copy on a later pipeline stage).
        `grad_norm` then counts every parameter of the whole model exactly once."""
        self._model_parallel_sum, self._duplicates, self._counted = sum_, set(duplicates), None

    def set_local_gradients(self, predicate: Callable[[], bool]) -> None:
        """When ``predicate()`` is True at a boundary backward, skip the data-parallel reduction:
        the optimizer gets this rank's own (accumulated, unaveraged) gradient and communicates it
        itself, compressed (1-bit Adam / LAMB past their warm-up: the optimizer's
        ``in_compression_stage``). Stage 0 only: at stages 1/2 a rank owns one partition of the
        masters and needs every rank's gradient for it (RuntimeError at that backward; a 1-bit
        optimizer there reduces compressed through the buckets instead and sets a predicate
        that stays False)."""
        self._local_gradients = predicate

    # ------------------------------------------------------------------ masters
    def _master_start(self, region: GroupRegion) -> int | None:
        """Flat offset where this rank's master of ``region`` is a contiguous range (None: not)."""
        if not self.partitioned_masters:
            return region.start
        return self.shards.contiguous_start(region, self.rank)

    def _can_alias(self, region: GroupRegion) -> bool:
        return self.model_dtype == torch.float32 and self._master_start(region) is not None and not self.offload.optimizer

    def _master_numel(self, region: GroupRegion) -> int:
        return region.part if self.partitioned_masters else region.numel

    def _make_master(self, region: GroupRegion) -> torch.Tensor:
        numel = self._master_numel(region)
        if self._master_alias[region.index]:
            master = self.flat.buffer.narrow(0, self._master_start(region), numel).detach()
        elif self.partitioned_masters:
            master = host_empty(numel, torch.float32, self.offload) if self.offload.optimizer else \
                torch.empty(numel, dtype=torch.float32, device=self.flat.buffer.device)
            self.shards.flat_to_partition(self.flat.buffer, master, region, self.rank)
        else:
            master = self.flat.buffer.narrow(0, region.start, numel).detach().to(torch.float32, copy=True)
        return master.requires_grad_(True)

    @property
    def device(self) -> torch.device:
        """Where the model buffer and the masters live."""
        return self.flat.buffer.device

    def master_index(self, slot) -> int:
        """Index in ``masters`` of the master holding ``slot``'s elements (one master per param
        group at stages 0-2; one per parameter at stage 3)."""
        return slot.group

    def group_masters(self, group: int) -> list[torch.Tensor]:
        """The masters of optimizer param group ``group``."""
        return [self.masters[group]]

    def optimizer_param_groups(self, *, with_segments: bool = True) -> list[dict]:
        """One group per region: ``params = [flat fp32 master]``, the original hyperparameters,
        and (``with_segments``) ``segments`` (int64 [n_seg, 3]: start, length, parameter index) /
        ``num_segments`` describing which original parameters the master holds (LAMB's
        per-parameter norms; 24 bytes per parameter piece, which other optimizers can do without).
        A group's ``exp_avg_mask`` (1-bit Adam / LAMB / 0/1 Adam) stays as given: the optimizer
        lays it out as the master through :meth:`mask_layout` (`tachyon.engine.optim.masks`)."""
        groups = []
        for region, master in zip(self.flat.regions, self.masters):
            group = dict(region.options)
            group["params"] = [master]
            if not with_segments:
                groups.append(group)
                continue
            if self.partitioned_masters:
                segments = self.shards.segments(region, self.rank)
            else:
                rows = [(s.offset - region.start, s.numel, s.index_in_group) for s in region.slots if s.numel]
                segments = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
            group["segments"] = segments.to(master.device)
            group["num_segments"] = len(region.slots)
            groups.append(group)
        return groups

    def mask_layout(self, index: int, mask: torch.Tensor) -> torch.Tensor:
        """Param group ``index``'s ``exp_avg_mask`` (given for its model parameters) laid out as
        this rank's master of the group (the optimizers' ``mask_layout``)."""
        return self._flat_mask(self.flat.regions[index], self.masters[index], mask)

    def _flat_mask(self, region: GroupRegion, master: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` laid out as this rank's ``master``: each parameter's mask (:func:`_masks_per_param`)
        at its master offsets, 0 in the padding."""
        out = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
        for slot, full in zip(region.slots, _masks_per_param(region, mask)):
            full = full.reshape(-1).to(device=master.device, dtype=torch.float32)
            if self.partitioned_masters:
                for lo, hi, at in self.shards.partition_pieces(slot, self.rank):
                    out[at:at + hi - lo] = full[lo:hi]
            elif slot.numel:
                at = slot.offset - region.start
                out[at:at + slot.numel] = full
        return out.view_as(master)

    def master_pieces(self, rank: int, *, whole: bool = False) -> list[list[tuple[int, int, int]]]:
        """Per slot (``flat.slots`` order): the parameter's elements in ``rank``'s master as
        (lo, hi, master offset), lo/hi parameter-relative. ``whole``: every element (stage 0, or
        one process, where the master is the whole region). Otherwise ``rank``'s share: its
        partition at stages 1/2; at stage 0, where every rank holds everything, the same split
        (so a checkpoint writes each element once), with offsets into the whole master."""
        if whole and self.partitioned_masters and self.world_size > 1:
            raise ValueError(f"stage {self.stage} on {self.world_size} ranks holds partitions; whole=True needs stage 0 or one rank")
        out = []
        for slot in self.flat.slots:
            if whole:
                start = self.flat.regions[slot.group].start
                out.append([(0, slot.numel, slot.offset - start)] if slot.numel else [])
            elif self.partitioned_masters:
                out.append(self.shards.partition_pieces(slot, rank))
            else:
                out.append(self.shards.region_pieces(slot, rank))
        return out

    def norm_reducer(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM all-reduce of a fp32 tensor over the ranks that share a parameter's pieces (a host
        tensor, with offload, travels through the training device: NCCL reduces device memory)."""
        if self.partitioned_masters:
            if tensor.device != self.device:
                tensor.copy_(self.comm.sum_(tensor.to(self.device)))
            else:
                self.comm.sum_(tensor)
        return tensor

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside the block gradients accumulate in ``param.grad`` as plain autograd leaves them
        (the per-parameter hooks are removed, and registered again after): a pipeline schedule
        runs the backward of many micro-batches interleaved with forwards, sums tied weights'
        gradients and divides by the micro-batch count on ``param.grad`` itself.
        `reduce_param_grads` then reduces them."""
        hooked = bool(self._hooks)  # a strategy released for a newer engine stays released
        self.release()
        try:
            yield
        finally:
            if hooked:
                self._register_hooks()

    def reduce_param_grads(self) -> None:
        """The boundary reduction of gradients accumulated in ``param.grad`` (see `deferred`):
        every parameter goes through the same path its hook takes on a boundary backward, in
        reverse layout order (backward's order, so buckets launch one after the other)."""
        self.begin_backward(True)
        for slot in reversed(self.flat.slots):
            self._on_grad(slot.param)
        self.end_backward()

    def begin_backward(self, boundary: bool) -> None:
        """Called before ``loss.backward()``; ``boundary``: last micro-step of the batch."""
        local = boundary and self._local_gradients is not None and self._local_gradients()
        if local and self.partitioned_masters:
            raise RuntimeError(
                f"the optimizer asks for this rank's own gradient (in its compression stage it averages compressed "
                f"gradients itself) but ZeRO stage {self.stage} partitions the masters over the data-parallel ranks, "
                "which needs every rank's gradient reduced to its owner: use zero_optimization.stage 0, or reduce "
                "through the strategy's buckets (the 1-bit optimizers' compressed reduce-scatter)"
            )
        self._reducing = self._reduces(boundary) and not local
        self.buckets.reset()

    def end_backward(self) -> None:
        """Called after ``loss.backward()``: flush unlaunched buckets and wait for all."""
        if self._reducing:
            self.buckets.finish()
        self._reducing = False

    def _reduces(self, boundary: bool) -> bool:
        return boundary

    def _on_grad(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def _launch(self, bucket: Bucket) -> list[Pending]:
        raise NotImplementedError

    # ------------------------------------------------------------------ accumulator
    def _accumulator_numel(self) -> int:
        raise NotImplementedError

    def _accumulator_views(self, acc: torch.Tensor) -> list[torch.Tensor]:
        """Per region, the part of ``acc`` laid out like that region's master."""
        raise NotImplementedError

    def accumulator(self) -> torch.Tensor:
        """The gradient accumulator (``grad_accum_dtype``), allocated (zeros) on first use."""
        if self._accumulator is None:
            if self.offload.optimizer:
                self._accumulator = host_zeros(self._accumulator_numel(), self.grad_accum_dtype, self.offload)
            else:
                self._accumulator = torch.zeros(self._accumulator_numel(), dtype=self.grad_accum_dtype,
                                                device=self.flat.buffer.device)
        return self._accumulator

    def _accumulate(self, start: int, chunk: torch.Tensor) -> None:
        """Add a reduced gradient ``chunk`` into the accumulator at ``start`` (moved to the host
        first with offload: each bucket's chunk as soon as its reduction completes)."""
        piece = self.accumulator().narrow(0, start, chunk.numel())
        piece.add_(chunk if chunk.device == piece.device else chunk.to(piece.device, dtype=piece.dtype))

    # ------------------------------------------------------------------ step
    def master_grads(self) -> list[torch.Tensor]:
        """Sets and returns ``master.grad`` (fp32, same shape as the master) for every group,
        from the reduced (averaged) gradients. Call after the boundary backward. An fp32
        accumulator is the master gradient itself; any other is converted and then freed, so
        the optimizer step holds one copy of the gradient partition."""
        acc = self.accumulator()
        grads = []
        for master, view in zip(self.masters, self._accumulator_views(acc)):
            master.grad = view if view.dtype == torch.float32 else view.to(torch.float32)
            grads.append(master.grad)
        if acc.dtype != torch.float32:
            self._accumulator = None
        return grads

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of the averaged gradient (a 0-dim fp32 tensor): local squared
        norms, SUM all-reduced over the data-parallel ranks when masters are partitioned, and
        over the model-parallel ranks (`set_model_parallel`) with each parameter counted once."""
        device = self.flat.buffer.device
        counted = self._counted_ranges()
        pieces = [g.narrow(0, at, n) for g, ranges in zip(grads, counted) for at, n in ranges]
        squares = [torch.linalg.vector_norm(p, dtype=torch.float32).square() for p in pieces]
        total = torch.stack(squares).sum().reshape(1) if squares else torch.zeros(1, device=device)
        total = total.to(device)  # host pieces with offload: reduced on the training device
        self.norm_reducer(total)
        if self._model_parallel_sum is not None:
            self._model_parallel_sum(total)
        return total.sqrt().reshape(())

    def _counted_ranges(self) -> list[list[tuple[int, int]]]:
        """Per region, (offset, length) ranges of this rank's master whose gradient counts in
        the norm: all of it, minus the pieces of `set_model_parallel`'s duplicates."""
        if self._counted is None:
            skip: list[list[tuple[int, int]]] = [[] for _ in self.masters]
            if self._duplicates:
                per_slot = self.master_pieces(self.rank, whole=not self.partitioned_masters)
                for slot, pieces in zip(self.flat.slots, per_slot):
                    if id(slot.param) in self._duplicates:
                        skip[slot.group] += [(at, hi - lo) for lo, hi, at in pieces]
            self._counted = []
            for master, dup in zip(self.masters, skip):
                ranges, at = [], 0
                for start, n in sorted(dup):
                    if start > at:
                        ranges.append((at, start - at))
                    at = max(at, start + n)
                if at < master.numel():
                    ranges.append((at, master.numel() - at))
                self._counted.append(ranges)
        return self._counted

    @torch.no_grad()
    def after_step(self) -> None:
        """Write the updated masters into the model buffer and all-gather the partitions."""
        for region, master, alias in zip(self.flat.regions, self.masters, self._master_alias):
            if alias:
                continue
            if self.partitioned_masters:
                self.shards.partition_to_flat(master, self.flat.buffer, region, self.rank)
            else:
                self.flat.buffer.narrow(0, region.start, region.numel).copy_(master)
        if self.partitioned_masters and self.world_size > 1:
            self._all_gather()

    def _all_gather(self) -> None:
        """One in-place ``all_gather_into`` per bucket: every rank's chunk into the model buffer."""
        pending = []
        for bucket in self.buckets.buckets:
            out = self.flat.buffer.narrow(0, bucket.begin, bucket.numel)
            c = bucket.chunk(self.world_size)
            pending.append(self.comm.all_gather_into(out, out.narrow(0, self.rank * c, c), async_op=True))
        for p in pending:
            p.wait()

    def zero_grad(self) -> None:
        """Drop the accumulator, the master gradients and any ``param.grad`` (after a step, taken
        or skipped); the next reduction allocates a fresh accumulator."""
        for master in self.masters:
            master.grad = None
        self._accumulator = None
        self._exposed = {}
        for slot in self.flat.slots:
            slot.param.grad = None

    def _bucket_buffers(self) -> list[torch.Tensor]:
        return []

    # ------------------------------------------------------------------ memory
    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes this rank holds now, from the tensors actually allocated (each storage once).

        parameters: the flat model buffer plus frozen parameters; gradients: the accumulator,
        any live ``param.grad`` and fp32 master gradients that are not the accumulator itself;
        master_weights: fp32 masters that do not alias the model; optimizer_states: tensors in
        the optimizer state of the masters; buckets: bucket buffers alive now (only during a
        reducing backward). ``model_states`` is the sum of the first four.
        """
        seen: set[int] = set()

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes():
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = nbytes([self.flat.buffer, *self.flat.frozen])
        masters = nbytes(m for m in self.masters)
        grads = nbytes([t for t in [self._accumulator] if t is not None]
                       + [s.param.grad for s in self.flat.slots if s.param.grad is not None]
                       + [m.grad for m in self.masters if m.grad is not None])
        states = 0
        if optimizer is not None:
            states = nbytes(v for m in self.masters for v in optimizer.state.get(m, {}).values() if torch.is_tensor(v))
        out = {"parameters": params, "gradients": grads, "master_weights": masters, "optimizer_states": states}
        out["model_states"] = sum(out.values())
        out["buckets"] = nbytes(self._bucket_buffers())
        if self.offload.any:  # bytes per placement: the offloaded states, and how many of them are pinned
            host = [*self.masters, self._accumulator, *(m.grad for m in self.masters)]
            if optimizer is not None:
                host += [v for m in self.masters for v in optimizer.state.get(m, {}).values() if torch.is_tensor(v)]
            out["offloaded"] = offloaded_bytes(host)
            out["pinned"] = pinned_bytes(host)
        return out


def _masks_per_param(region: GroupRegion, mask: torch.Tensor) -> list[torch.Tensor]:
    """A param group's ``exp_avg_mask`` for each of its parameters: ``mask`` broadcast to each (as
    DeepSpeed applies a group's mask to every parameter of the group), or, where that fails, a 1-D
    mask with as many elements as the group's parameters together cut into consecutive pieces, one
    per parameter in the group's order (the flattened group DeepSpeed's fp16 optimizer masks:
    scripts written for it give their masks flattened)."""
    try:
        return [torch.broadcast_to(mask, slot.param.shape) for slot in region.slots]
    except RuntimeError:
        sizes = [slot.numel for slot in region.slots]
        if mask.dim() == 1 and mask.numel() == sum(sizes):
            return list(mask.split(sizes))
        shapes = ", ".join(str(tuple(slot.param.shape)) for slot in region.slots)
        raise ValueError(
            f"param group {region.index}'s 'exp_avg_mask' of shape {tuple(mask.shape)} does not broadcast to "
            f"its parameters of shapes {shapes} (a group's mask applies to each of its parameters) and is not "
            f"their {sum(sizes)} elements flattened; give each masked parameter its own param group") from None
