"""Gradient buckets: contiguous ranges of the flat buffer, reduced as soon as backward has
produced their gradients.

Backward produces gradients roughly in reverse parameter order, so each param group's region is
cut back to front: every bucket holds ``bucket_numel`` elements (rounded down to a multiple of
the quantum, ``world_size * ALIGN``) except the region's lowest one, launched last, which holds
the rest; a region smaller than one bucket is one bucket (buckets are sized from the model when
it is the smaller). Cuts ignore parameter boundaries: a parameter larger than a bucket spans
several, and a bucket may hold the tail of one parameter and the head of the next::

    region:   [ p0 | p1 ......... | p2 | p3 ... | pad ]
    buckets:  [  b3  |    b2    |    b1    |    b0    ]     (b0 launches first)

Every bucket is a multiple of the quantum, so it splits into ``world_size`` equal chunks: chunk r
of every bucket is rank r's to own (stages 1/2, `tachyon.engine.zero.shards`). One
reduce-scatter per bucket delivers each owner its chunk, and one all-gather per bucket rebuilds
the bucket from the chunks after the step.

Buckets are launched strictly in bucket order: bucket k goes when every parameter overlapping it
and every bucket before it have reported. Every rank therefore issues the same collectives in
the same order even when autograd's hook order varies, which is what keeps gloo/NCCL from
mismatching ops. Parameters that get no gradient in a backward (unused) never report; their
buckets are flushed, in order, by `BucketScheduler.finish`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .comm import Pending
from .layout import ALIGN, FlatParameters, GroupRegion, ParamSlot


@dataclasses.dataclass(eq=False)
class Bucket:
    """Flat-buffer range [begin, end) of one region; ``slots``: the parameters overlapping it."""

    index: int
    """Launch order (0 goes first)."""
    region: GroupRegion
    begin: int
    end: int
    slots: list[ParamSlot]
    gaps: list[tuple[int, int]]
    """Bucket-relative [lo, hi) ranges no parameter covers (the region's padding): zero."""

    @property
    def numel(self) -> int:
        return self.end - self.begin

    def chunk(self, world_size: int) -> int:
        """Elements per rank's chunk."""
        return self.numel // world_size

    def piece(self, slot: ParamSlot) -> tuple[int, int, int]:
        """(bucket offset, parameter offset, length) of the part of ``slot`` inside this bucket."""
        lo, hi = max(slot.offset, self.begin), min(slot.offset + slot.numel, self.end)
        return lo - self.begin, lo - slot.offset, hi - lo


def bucket_quantum(world_size: int) -> int:
    """Every bucket (and region) is a multiple of this many elements."""
    return world_size * ALIGN


def cut_buckets(flat: FlatParameters, bucket_numel: int) -> list[Bucket]:
    """Buckets of ``bucket_numel`` elements (rounded down to a multiple of the quantum, at least
    one quantum), back to front, never across param groups; see the module docstring."""
    quantum = bucket_quantum(flat.world_size)
    size = max(quantum, int(bucket_numel) // quantum * quantum)
    buckets: list[Bucket] = []
    for region in reversed(flat.regions):
        end = region.start + region.numel
        while end > region.start:
            begin = max(region.start, end - size)
            buckets.append(_bucket(len(buckets), region, begin, end))
            end = begin
    return buckets


def _bucket(index: int, region: GroupRegion, begin: int, end: int) -> Bucket:
    slots = [s for s in region.slots if s.offset < end and s.offset + s.numel > begin]
    gaps, at = [], begin
    for s in slots:  # slots are contiguous and in offset order within a region
        lo = max(s.offset, begin)
        if lo > at:
            gaps.append((at - begin, lo - begin))
        at = max(at, min(s.offset + s.numel, end))
    if at < end:
        gaps.append((at - begin, end - begin))
    return Bucket(index, region, begin, end, slots, gaps)


class BucketScheduler:
    """Tracks which parameters reported in the current backward and launches ready buckets.

    Args:
        buckets: from `cut_buckets`.
        launch: starts the reduction of one bucket; returns its in-flight collectives.
        overlap: keep launched collectives in flight until `finish` (overlap with backward);
            when False each bucket's collectives are waited for right after launch.
    """

    def __init__(self, buckets: list[Bucket], launch: Callable[[Bucket], list[Pending]], overlap: bool):
        self.buckets = buckets
        self._launch = launch
        self.overlap = overlap
        self._buckets_of: dict[int, list[int]] = {}
        for b in buckets:
            for slot in b.slots:
                self._buckets_of.setdefault(id(slot.param), []).append(b.index)
        self._reported = [0] * len(buckets)
        self._next = 0
        self._in_flight: list[Pending] = []

    @property
    def max_bucket_numel(self) -> int:
        return max((b.numel for b in self.buckets), default=0)

    @property
    def next_index(self) -> int:
        """Index of the next bucket to launch (== len(buckets) once all went)."""
        return self._next

    def buckets_of(self, slot: ParamSlot) -> list[int]:
        """Indices of the buckets ``slot`` overlaps, in launch order."""
        return self._buckets_of.get(id(slot.param), [])

    def reset(self) -> None:
        self._reported = [0] * len(self.buckets)
        self._next = 0
        self._in_flight = []

    def report(self, slot: ParamSlot) -> None:
        """``slot``'s gradient is final for this backward; launch whatever became ready."""
        for index in self._buckets_of.get(id(slot.param), ()):
            self._reported[index] += 1
        while self._next < len(self.buckets) and self._reported[self._next] >= len(self.buckets[self._next].slots):
            self._launch_next()

    def _launch_next(self) -> None:
        pending = self._launch(self.buckets[self._next])
        self._next += 1
        if self.overlap:
            self._in_flight.extend(pending)
        else:
            for p in pending:
                p.wait()

    def finish(self) -> None:
        """Launch the buckets not launched yet (in order), then wait for everything in flight."""
        while self._next < len(self.buckets):
            self._launch_next()
        in_flight, self._in_flight = self._in_flight, []
        for p in in_flight:
            p.wait()
        self.reset()
