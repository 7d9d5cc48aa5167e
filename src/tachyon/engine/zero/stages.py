"""ZeRO stages 0, 1 and 2 as strategy objects the Engine calls.

All three share the flat layout (`FlatParameters`: the model's trainable parameters, in the
model dtype, as views into one buffer), cut it into the same gradient buckets (`buckets.py`) and
hand the optimizer ONE flat fp32 master tensor per param group. They differ in what each rank
keeps (Psi = parameter count, N = ranks) and how gradients travel:

    stage | masters + optimizer states | gradients held                  | reduction per bucket
    0     | whole (on every rank)      | whole, in the accumulation dtype | all_reduce
    1     | this rank's 1/N partition  | its 1/N partition (between       | reduce_scatter to the
          |                            | micro-steps: param.grad, whole)  | owners, at the boundary
    2     | this rank's 1/N partition  | its 1/N partition                | reduce_scatter to the
          |                            |                                  | owners, every micro-step

Stage 0 (`Stage0`): each parameter's post-accumulate-grad hook adds ``param.grad``
into the flat accumulator (in ``grad_accum_dtype``); on the boundary micro-step the hook also
reports the parameter to the `BucketScheduler`, which all-reduces every complete bucket of the
accumulator (in place, async when ``overlap_comm``). When the accumulator has the model's dtype
(DeepSpeed's default) ``param.grad`` then becomes a view of the parameter's piece of it, as
DeepSpeed leaves gradients in ``param.grad`` without ZeRO: after ``engine.backward`` a script
reads the accumulated gradient there (averaged over the ranks after the boundary backward), later
backwards accumulate into it in place, and what a script writes into it before ``engine.step()``
-- in place (clipping, scaling) or by assigning a new tensor -- is what the step uses. A
gradient a script sets to None before the step counts as zero (a warning says so; torch's
optimizers would skip that parameter, the flat optimizer cannot). With a wider accumulator (fp32
for a bf16 model) ``param.grad`` is freed instead: read it with
`tachyon.engine.zero.fragments.full_grad` (``deepspeed.utils.safe_get_full_grad``).

Stages 1 and 2 (`Stage1`, `Stage2`): a full-size gradient in the accumulation dtype never
exists. Each gradient is copied into a bucket buffer (in ``comm_dtype``) and freed;
one reduce-scatter per bucket gives every rank the sum of the chunk it owns
(`tachyon.engine.zero.shards`), which it adds into its partition accumulator. Stage 2 does this
on every micro-step (DeepSpeed's behaviour). Stage 1 does it on the boundary micro-step and lets
autograd accumulate into ``param.grad`` (model dtype, full size: ZeRO-1's gradient memory)
in between, saving the reductions of the other micro-steps; with an accumulation dtype wider
than the model's (fp32 for a bf16 model) it reduces every micro-step like stage 2, since a
full-size fp32 gradient would cost more than the partition it avoids. After a reducing backward
``param.grad`` is None, as in DeepSpeed's ZeRO-1/2: the gradient lives in the owners'
partitions; `tachyon.engine.zero.fragments` reads and writes it (``safe_get_full_grad`` /
``safe_set_full_grad``). A ``param.grad`` a script sets after that backward is not used by the
step (as in DeepSpeed), and a warning says so.

Memory discipline (what DeepSpeed 0.19.8 holds, or less, at every point of a step with its
default config: benchmarks/results/2026-11-25-cpu-zero-memory-default-config.md): the accumulator is
allocated at the first reduction of a step and freed by `master_grads` once converted to the
fp32 master gradients (or by `zero_grad` when it is the fp32 master gradient); bucket buffers
exist only during a reducing backward, sized ``min(reduce_bucket_size, largest bucket)``.

Averaging: gradients are divided by ``pre`` before and by ``N / pre`` after the reduction, where
``pre`` is N with ``prescale_gradients`` and ``gradient_predivide_factor`` otherwise.

With an fp32 model the master weights are views of the model's own buffer wherever the rank's
share is contiguous (stage 0, one rank, or one bucket per param group): the optimizer updates the
model in place. Otherwise `after_step` copies the updated masters into the model buffer; stages
1/2 then all-gather each bucket from its chunks (``all_gather_into``, in place, no gather buffer:
``allgather_bucket_size`` has nothing to bound).
"""

from __future__ import annotations

import warnings

import torch

from .base import ZeroStrategy
from .buckets import Bucket
from .comm import Pending


class Stage0(ZeroStrategy):
    """Plain data parallelism: everything replicated, the accumulator all-reduced in buckets."""

    stage = 0
    partitioned_masters = False

    def __init__(self, param_groups: list[dict], **kwargs):
        super().__init__(param_groups, **kwargs)
        self._converted: list[Pending] = []
        self.exposes_param_grads = self.grad_accum_dtype == self.model_dtype
        """Whether ``param.grad`` is left as a view of the accumulator (see the module docstring)."""
        self._warned_dropped = False

    def _accumulator_numel(self) -> int:
        return self.flat.numel

    def _accumulator_views(self, acc: torch.Tensor) -> list[torch.Tensor]:
        return [acc.narrow(0, r.start, r.numel) for r in self.flat.regions]

    def _take_grad(self, slot) -> None:
        """Move ``slot.param.grad`` into the accumulator (add it; or copy it where the parameter's
        exposed view was replaced, since the new tensor holds the whole accumulated gradient),
        then leave ``param.grad`` as the view of the accumulator, or free it."""
        param, grad = slot.param, slot.param.grad
        exposed = self._exposed.get(id(param))
        if grad is None or grad is exposed:
            return
        piece = self.accumulator().narrow(0, slot.offset, slot.numel)
        if exposed is not None:
            piece.copy_(grad.reshape(-1))
        else:
            piece.add_(grad.reshape(-1))
        if self.exposes_param_grads:
            param.grad = self._exposed[id(param)] = piece.view_as(param)
        else:
            param.grad = None

    def _on_grad(self, param: torch.Tensor) -> None:
        slot = self._slot_of[id(param)]
        self._take_grad(slot)
        if self._reducing:
            self.buckets.report(slot)

    def master_grads(self) -> list[torch.Tensor]:
        """Take what a script wrote into ``param.grad`` since the backward, then the base's
        master gradients; frees the exposed views when the accumulator is converted."""
        for slot in self.flat.slots:
            param = slot.param
            if param.grad is None and id(param) in self._exposed:
                del self._exposed[id(param)]
                self.accumulator().narrow(0, slot.offset, slot.numel).zero_()
                if not self._warned_dropped:
                    self._warned_dropped = True
                    warnings.warn(f"param.grad of a parameter of shape {tuple(param.shape)} was set to None between "
                                  "backward and step: the step uses a zero gradient for it (weight decay and momentum "
                                  "still move it; torch's optimizers would skip it)", stacklevel=4)
            else:
                self._take_grad(slot)
        grads = super().master_grads()
        if self._accumulator is None:  # converted to fp32 and freed: let the views' storage go too
            for slot in self.flat.slots:
                if id(slot.param) in self._exposed:
                    slot.param.grad = None
            self._exposed = {}
        return grads

    converted_in_flight = 2
    """Buckets reduced through a converted copy (``comm_dtype`` other than the accumulator's)
    that may be in flight at once: each copy lives until its reduction is done."""

    def _launch(self, bucket: Bucket) -> list[Pending]:
        view = self.accumulator().narrow(0, bucket.begin, bucket.numel)
        if self.comm_dtype == view.dtype:
            buf = view
        else:
            while len(self._converted) >= self.converted_in_flight:
                self._converted.pop(0).wait()
            buf = view.to(self.comm_dtype)
        if self.pre_divide != 1:
            buf.div_(self.pre_divide)

        def then() -> None:
            if buf is not view:
                view.copy_(buf)
                # free the converted copy now: the process group's worker may hold the tensor (not
                # its use: the reduction is done) a moment after wait() returns (gloo does)
                buf.set_()
            if self.post_divide != 1:
                view.div_(self.post_divide)

        pending = self.comm.all_reduce(buf, async_op=True, then=then)
        if buf is not view:
            self._converted.append(pending)
        return [pending]

    def end_backward(self) -> None:
        super().end_backward()
        self._converted = []



class _PartitionedGradients(ZeroStrategy):
    """Stages 1 and 2: gradients reduce-scattered per bucket into this rank's partition.

    Bucket buffers: up to two (one without ``overlap_comm``, or with one bucket) of the largest
    bucket's size in ``comm_dtype``, allocated when a reducing backward first needs one and freed
    when it ends. A gradient is copied into the buffer of the bucket being filled (the next to
    launch) by its hook and freed once every bucket it overlaps has its piece; a gradient that
    arrives before its bucket is the next (autograd's order is not the layout's) waits in
    ``param.grad`` until then. Launching a bucket copies whatever pieces are still missing (zero
    for parameters without a gradient, and for padding), then reduce-scatters it in place: this
    rank's chunk of the buffer receives the sum, which is added into the partition accumulator.
    """

    partitioned_masters = True
    num_bucket_buffers = 2

    def __init__(self, param_groups: list[dict], **kwargs):
        super().__init__(param_groups, **kwargs)
        self._region_offsets, offset = [], 0
        for region in self.flat.regions:
            self._region_offsets.append(offset)
            offset += region.part
        n_buffers = min(self.num_bucket_buffers if self.buckets.overlap else 1, len(self.buckets.buckets))
        self.buffer_numel = self.buckets.max_bucket_numel
        self._buffers: list[torch.Tensor | None] = [None] * n_buffers
        self._buffer_users: list[list[Pending]] = [[] for _ in range(n_buffers)]
        self._warned_written = False
        self._reset_backward_state()

    def _reset_backward_state(self) -> None:
        self._turn = 0
        """How many buffers were handed out: the next one is ``_turn % len(_buffers)``."""
        self._filling: dict[int, int] = {}
        """bucket index -> the buffer its pieces are copied into (this backward)."""
        self._copied: dict[int, set[int]] = {}
        """bucket index -> id(param) of the parameters whose piece is in its buffer."""
        self._reported: set[int] = set()
        """id(param) of the parameters whose hook ran (this backward)."""

    def _accumulator_numel(self) -> int:
        return sum(region.part for region in self.flat.regions)

    def _accumulator_views(self, acc: torch.Tensor) -> list[torch.Tensor]:
        return [acc.narrow(0, o, r.part) for o, r in zip(self._region_offsets, self.flat.regions)]

    # ------------------------------------------------------------------ bucket buffers
    def _acquire(self) -> int:
        """The next bucket buffer in turn, once the reductions still reading it are done."""
        which = self._turn % len(self._buffers)
        self._turn += 1
        for previous in self._buffer_users[which]:
            previous.wait()
        self._buffer_users[which] = []
        if self._buffers[which] is None:
            self._buffers[which] = torch.empty(self.buffer_numel, dtype=self.comm_dtype, device=self.flat.buffer.device)
        return which

    def _buffer_of(self, bucket: Bucket) -> torch.Tensor:
        which = self._filling.get(bucket.index)
        if which is None:
            which = self._filling[bucket.index] = self._acquire()
        return self._buffers[which].narrow(0, 0, bucket.numel)

    def _bucket_buffers(self) -> list[torch.Tensor]:
        return [b for b in self._buffers if b is not None]

    def _copy_piece(self, bucket: Bucket, slot) -> None:
        """``slot``'s gradient piece into ``bucket``'s buffer (zeros without a gradient); frees
        ``param.grad`` when this was the last bucket it overlaps."""
        at, lo, n = bucket.piece(slot)
        piece = self._buffer_of(bucket).narrow(0, at, n)
        grad = slot.param.grad
        if grad is None:
            piece.zero_()
        else:
            piece.copy_(grad.reshape(-1).narrow(0, lo, n))
        self._copied.setdefault(bucket.index, set()).add(id(slot.param))
        if self.buckets.buckets_of(slot)[-1] == bucket.index:
            slot.param.grad = None

    def _fill(self, index: int) -> None:
        """Copy the pieces of the reported gradients into bucket ``index``'s buffer."""
        if index >= len(self.buckets.buckets):
            return
        bucket = self.buckets.buckets[index]
        copied = self._copied.get(index, ())
        for slot in bucket.slots:
            if id(slot.param) in self._reported and id(slot.param) not in copied and slot.param.grad is not None:
                self._copy_piece(bucket, slot)

    # ------------------------------------------------------------------ backward
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._reducing:
            return  # stage 1 between boundaries: autograd accumulates into param.grad
        slot = self._slot_of[id(param)]
        self._reported.add(id(param))
        indices = self.buckets.buckets_of(slot)
        if indices and indices[0] <= self.buckets.next_index <= indices[-1] and param.grad is not None:
            self._copy_piece(self.buckets.buckets[self.buckets.next_index], slot)
        self.buckets.report(slot)

    def _launch(self, bucket: Bucket) -> list[Pending]:
        buf = self._buffer_of(bucket)
        copied = self._copied.get(bucket.index, ())
        for slot in bucket.slots:
            if id(slot.param) not in copied:
                self._copy_piece(bucket, slot)
        for lo, hi in bucket.gaps:
            buf.narrow(0, lo, hi - lo).zero_()
        which = self._filling.pop(bucket.index)
        self._copied.pop(bucket.index, None)
        if self.pre_divide != 1:
            buf.div_(self.pre_divide)
        c = bucket.chunk(self.world_size)
        out = buf.narrow(0, self.rank * c, c)
        start = self._region_offsets[bucket.region.index] + self.shards.partition_offset[bucket.index]

        def then() -> None:
            if self.post_divide != 1:
                out.div_(self.post_divide)
            self._accumulate(start, out)

        pending = [self.comm.reduce_scatter(out, buf, async_op=True, then=then)]
        self._buffer_users[which] = pending
        self._fill(bucket.index + 1)  # gradients that arrived early for the next bucket
        return pending

    def begin_backward(self, boundary: bool) -> None:
        super().begin_backward(boundary)
        self._reset_backward_state()

    def master_grads(self) -> list[torch.Tensor]:
        """The base's, after warning about a ``param.grad`` a script set after the reducing
        backward: it is not used (the gradients already are in the owners' partitions)."""
        written = [slot for slot in self.flat.slots if slot.param.grad is not None]
        if written and not self._warned_written:
            self._warned_written = True
            warnings.warn(f"param.grad was set on {len(written)} parameter(s) after the backward that reduced the "
                          f"gradients; ZeRO stage {self.stage} steps on the reduced partitions and does not use it "
                          "(as DeepSpeed): write gradients with deepspeed.utils.safe_set_full_grad "
                          "(tachyon.engine.zero.fragments.set_full_grad) instead", stacklevel=4)
        return super().master_grads()

    def end_backward(self) -> None:
        super().end_backward()
        self._buffers = [None] * len(self._buffers)
        self._buffer_users = [[] for _ in self._buffers]
        self._reset_backward_state()


class Stage1(_PartitionedGradients):
    """Optimizer states, fp32 masters and (from the boundary backward on) gradients
    partitioned; between boundaries the gradient accumulates in ``param.grad`` unless the
    accumulation dtype is wider than the model's (see the module docstring)."""

    stage = 1

    def _reduces(self, boundary: bool) -> bool:
        return boundary or self.grad_accum_dtype.itemsize > self.model_dtype.itemsize


class Stage2(_PartitionedGradients):
    """Optimizer states, fp32 masters and gradients partitioned; reduces every micro-step."""

    stage = 2

    def _reduces(self, boundary: bool) -> bool:
        return True


STAGES = {0: Stage0, 1: Stage1, 2: Stage2}


def build_zero_strategy(stage: int, param_groups: list[dict], **kwargs) -> ZeroStrategy:
    """The strategy for ZeRO ``stage`` (0, 1 or 2); kwargs as `ZeroStrategy`."""
    if stage not in STAGES:
        raise ValueError(f"zero_optimization.stage={stage!r} is not supported; allowed: 0, 1, 2")
    return STAGES[stage](param_groups, **kwargs)
