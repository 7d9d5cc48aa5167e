"""The flat layout: every trained parameter becomes a view into one flat buffer.

ZeRO partitions are made of flat slices, so the model's trainable parameters (all in the model
dtype) are copied into one contiguous 1-D buffer and each ``param.data`` is re-pointed to its slice
(the parameter objects, hence the user's references and module attributes, stay the same).

Optimizer param groups map to consecutive regions of the buffer::

    buffer: [ group 0: p0 p1 p2 pad | group 1: p3 p4 pad ]
    region g is padded to a multiple of world_size * ALIGN elements; each rank owns part_g =
    numel_g / world_size of them (which ones: `tachyon.engine.zero.shards`).

Padding elements are zero and stay zero (their gradients are zero). Parameters that do not
require grad are left out (not trained, not communicated).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

ALIGN = 8
"""Every rank's chunk of a bucket holds a multiple of ALIGN elements, so chunks start 16-byte
aligned for 2-byte dtypes (regions and buckets are multiples of world_size * ALIGN)."""


@dataclasses.dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives in the flat buffer."""

    param: torch.nn.Parameter
    group: int
    index_in_group: int
    offset: int
    """Element offset in the whole flat buffer."""
    numel: int


@dataclasses.dataclass(eq=False)
class GroupRegion:
    """One optimizer param group's region of the flat buffer."""

    index: int
    start: int
    numel: int
    """Padded size, a multiple of world_size * ALIGN."""
    world_size: int
    slots: list[ParamSlot]
    options: dict[str, Any]
    """The param group's hyperparameters (everything but ``params``)."""

    @property
    def part(self) -> int:
        """Elements of this region each rank owns."""
        return self.numel // self.world_size


class FlatParameters:
    """Copies the trainable parameters of ``param_groups`` into one flat buffer of ``dtype`` on
    ``device`` and re-points each ``param.data`` at its slice.

    Args:
        param_groups: torch-optimizer-style groups (dicts with a ``params`` list).
        dtype: the model dtype; every trainable parameter must already have it.
        device: where the buffer lives.
        world_size: number of data-parallel partitions each region is split into.
    """

    def __init__(self, param_groups: list[dict], dtype: torch.dtype, device: torch.device, world_size: int):
        self.dtype, self.device, self.world_size = dtype, device, world_size
        self.regions: list[GroupRegion] = []
        self.slots: list[ParamSlot] = []
        self.frozen: list[torch.nn.Parameter] = []
        seen: set[int] = set()
        start = 0
        quantum = world_size * ALIGN
        for g, group in enumerate(param_groups):
            slots = []
            offset = start
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError("a parameter appears in more than one optimizer param group")
                seen.add(id(p))
                if not p.requires_grad:
                    self.frozen.append(p)
                    continue
                if p.dtype != dtype:
                    raise ValueError(f"parameter of dtype {p.dtype} found; the model dtype is {dtype}")
                slot = ParamSlot(p, g, len(slots), offset, p.numel())
                slots.append(slot)
                offset += slot.numel
            padded = -(-(offset - start) // quantum) * quantum if offset > start else quantum
            options = {k: v for k, v in group.items() if k != "params"}
            self.regions.append(GroupRegion(g, start, padded, world_size, slots, options))
            self.slots.extend(slots)
            start += padded
        self.numel = start
        self.buffer = torch.zeros(self.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for slot in self.slots:
                view = self.buffer.narrow(0, slot.offset, slot.numel)
                view.copy_(slot.param.data.reshape(-1))
                slot.param.data = view.view_as(slot.param)

    @property
    def num_params(self) -> int:
        """Trainable elements (without padding)."""
        return sum(slot.numel for slot in self.slots)
