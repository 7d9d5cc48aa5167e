"""Which elements each rank owns, and the copies between the flat model buffer and a rank's
flat partition.

Ownership follows the gradient buckets (`buckets.py`): a bucket [begin, end) of N * c elements
(N ranks) is split into N chunks, and rank r owns chunk r, [begin + r*c, begin + (r+1)*c). One
reduce-scatter of the bucket then hands every rank the sum of exactly its chunk, and one
all-gather rebuilds the bucket: each bucket moves its own bytes once, the ZeRO paper's volume.
(Owning one contiguous 1/N slice of the whole model instead would put most of a bucket on one or
two owners, and a reduce-scatter over equal chunks would then move N times the bucket.)

Rank r's partition of region g is its chunks of g's buckets in ascending flat order,
concatenated: ``part_g = numel_g / N`` elements, the layout of the rank's fp32 master, optimizer
states and gradient accumulator for that param group::

    region (N = 2):   [ b1: c0 c1 | b0: c0 c1 ]      (b0 launches first)
    rank 0 partition: [ b1.c0 | b0.c0 ]
    rank 1 partition: [ b1.c1 | b0.c1 ]

The buckets of a region all have the same size except the lowest one (the remainder), so a
rank's chunks of the full-size buckets are one strided view of the flat buffer
(``[n_full, N, c][:, r]``): a partition is copied in or out with two tensor copies, whatever the
number of buckets. With one rank, or one bucket per region, a partition is a contiguous range.
"""

from __future__ import annotations

import dataclasses

import torch

from .buckets import Bucket
from .layout import FlatParameters, GroupRegion, ParamSlot


@dataclasses.dataclass(frozen=True)
class _RegionLayout:
    head_begin: int
    """Flat offset of the lowest bucket (the remainder; size 0 when there is none)."""
    head_numel: int
    full_begin: int
    """Flat offset of the first full-size bucket."""
    n_full: int
    size: int
    """Elements per full-size bucket."""


class Shards:
    """Ownership of ``flat`` by its ranks, from ``buckets`` (see the module docstring)."""

    def __init__(self, flat: FlatParameters, buckets: list[Bucket]):
        self.world_size = n = flat.world_size
        self.regions = flat.regions
        self.partition_offset: dict[int, int] = {}
        """bucket index -> where its chunk starts in the owner's partition of the region."""
        self._layouts: list[_RegionLayout] = []
        self._buckets_of_slot: dict[int, list[Bucket]] = {}
        for region in flat.regions:
            ascending = sorted((b for b in buckets if b.region is region), key=lambda b: b.begin)
            at = 0
            for b in ascending:
                self.partition_offset[b.index] = at
                at += b.chunk(n)
                for slot in b.slots:
                    self._buckets_of_slot.setdefault(id(slot.param), []).append(b)
            size = ascending[-1].numel
            head = ascending[0].numel if ascending[0].numel != size else 0
            n_full = len(ascending) - (1 if head else 0)
            if any(b.numel != size for b in ascending[1 if head else 0:]):
                raise AssertionError("buckets of a region must be equal but for the lowest one")
            self._layouts.append(_RegionLayout(region.start, head, region.start + head, n_full, size))

    def chunk_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """Flat [begin, end) of ``rank``'s chunk of ``bucket``."""
        c = bucket.chunk(self.world_size)
        return bucket.begin + rank * c, bucket.begin + (rank + 1) * c

    def contiguous_start(self, region: GroupRegion, rank: int) -> int | None:
        """The flat offset at which ``rank``'s partition of ``region`` is one contiguous range of
        the flat buffer (one rank, or one bucket in the region); None when it is not."""
        lay = self._layouts[region.index]
        if self.world_size == 1:
            return region.start
        if lay.n_full + (1 if lay.head_numel else 0) == 1:
            return region.start + rank * region.part
        return None

    def _views(self, flat: torch.Tensor, region: GroupRegion, rank: int) -> list[tuple[int, torch.Tensor]]:
        """(partition offset, view of ``flat``) pairs covering ``rank``'s partition of ``region``."""
        lay, n = self._layouts[region.index], self.world_size
        out = []
        if lay.head_numel:
            c = lay.head_numel // n
            out.append((0, flat.narrow(0, lay.head_begin + rank * c, c)))
        if lay.n_full:
            c = lay.size // n
            full = flat.narrow(0, lay.full_begin, lay.n_full * lay.size).view(lay.n_full, n, c)
            out.append((lay.head_numel // n, full[:, rank]))
        return out

    @torch.no_grad()
    def flat_to_partition(self, flat: torch.Tensor, partition: torch.Tensor, region: GroupRegion, rank: int) -> None:
        """``partition`` [region.part] = ``rank``'s chunks of ``flat`` (casting as needed)."""
        for offset, view in self._views(flat, region, rank):
            partition.narrow(0, offset, view.numel()).view(view.shape).copy_(view)

    @torch.no_grad()
    def partition_to_flat(self, partition: torch.Tensor, flat: torch.Tensor, region: GroupRegion, rank: int) -> None:
        """``rank``'s chunks of ``flat`` = ``partition`` (casting as needed)."""
        for offset, view in self._views(flat, region, rank):
            view.copy_(partition.narrow(0, offset, view.numel()).view(view.shape))

    def _pieces(self, slot: ParamSlot, rank: int) -> list[tuple[int, int, int, int]]:
        """(lo, hi, partition offset, flat offset of lo) of ``slot``'s elements that ``rank`` owns;
        lo/hi are parameter-relative, in ascending order, merged where contiguous."""
        out: list[tuple[int, int, int, int]] = []
        for b in self._buckets_of_slot.get(id(slot.param), []):
            begin, end = self.chunk_range(b, rank)
            lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, end)
            if lo >= hi:
                continue
            at = self.partition_offset[b.index] + lo - begin
            if out and out[-1][1] == lo - slot.offset and out[-1][2] + out[-1][1] - out[-1][0] == at:
                out[-1] = (out[-1][0], hi - slot.offset, out[-1][2], out[-1][3])
            else:
                out.append((lo - slot.offset, hi - slot.offset, at, lo))
        return out

    def partition_pieces(self, slot: ParamSlot, rank: int) -> list[tuple[int, int, int]]:
        """(lo, hi, offset in ``rank``'s partition) of the elements of ``slot`` it owns."""
        return [(lo, hi, at) for lo, hi, at, _ in self._pieces(slot, rank)]

    def region_pieces(self, slot: ParamSlot, rank: int) -> list[tuple[int, int, int]]:
        """(lo, hi, offset in the whole region) of the elements of ``slot`` that ``rank`` owns."""
        region = self.regions[slot.group]
        return [(lo, hi, flat - region.start) for lo, hi, _, flat in self._pieces(slot, rank)]

    def segments(self, region: GroupRegion, rank: int) -> torch.Tensor:
        """int64 [n_seg, 3] rows (start, length, parameter index in its group) of ``rank``'s
        partition of ``region`` (LAMB's per-parameter norms); ids agree across ranks."""
        rows = [(at, hi - lo, slot.index_in_group)
                for slot in region.slots for lo, hi, at in self.partition_pieces(slot, rank)]
        rows.sort()
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
