"""Where a rank's piece of a parameter lies in the full (unsplit) parameter, as DCP chunks.

A checkpoint stores every parameter as ONE logical tensor of its full shape, whatever the
layout that saved it: pipeline stages name their parameters layout-free (PipelineModule), and
tensor parallelism's shards are mapped back to the full tensor here. The logical tensor of a
parameter of full shape (d0, d1, ...) is 2-D, ``[d0, d1 * ...]`` (1-D ``[n]`` for a vector), so
that any piece a rank holds is a few rectangles ("boxes") of it:

- ZeRO hands a rank a contiguous range [lo, hi) of its LOCAL parameter, flattened. In the local
  2-D view ``[r, c]`` that range is at most a partial first row, a block of whole rows and a
  partial last row.
- Tensor parallelism (`tachyon.parallel.tensor.shard.ShardSpec`) maps local rows (split along
  dim 0, block by block for fused QKV / gated weights) or local columns (split along dim 1) to
  full ones: local index x of block k is full index ``full_start_k + tp_rank * local_k + (x -
  local_start_k)``, so consecutive local rows stay consecutive within a block.

Each box is a contiguous run of the local flat parameter (whole local rows, or part of one row),
so it is a view of the rank's flat master (save) or of the fresh tensor a load fills, with no
copy. `Boxes` hands those views to torch.distributed.checkpoint through its extension hooks
(``__create_write_items__``, ``__create_chunk_list__``): DCP's resharding reads, on load, exactly
the overlap of every saved box with every box a rank asks for, from whichever files hold it.

(A flat 1-D logical tensor would turn each row of a column-split weight into its own chunk:
thousands of chunks per weight for a large model. DTensor cannot express ZeRO's ranges, which
start anywhere inside a parameter, nor the block-wise QKV split.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""(offsets in the logical tensor, sizes, start in the local flat parameter)."""


@dataclass(frozen=True)
class AxisMap:
    """Local -> full indices along one axis split over ``tp`` ranks in ``blocks`` (each block split
    separately; one block = a plain split). ``tp == 1``: the identity."""

    full: int
    tp: int = 1
    rank: int = 0
    blocks: tuple[int, ...] | None = None

    def segments(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """(full start, local start, length) covering local indices [a, b), in order."""
        if self.tp == 1:
            return [(a, a, b - a)] if b > a else []
        out, local_start, full_start = [], 0, 0
        for block in self.blocks or (self.full,):
            local = block // self.tp
            lo, hi = max(a, local_start), min(b, local_start + local)
            if lo < hi:
                out.append((full_start + self.rank * local + lo - local_start, lo, hi - lo))
            local_start += local
            full_start += block
        return out


def logical_shape(full_shape: tuple[int, ...], version: int = 2) -> tuple[int, ...]:
    """The checkpoint's shape for a parameter of ``full_shape`` (module docstring); format
    version 1 stored every parameter flat."""
    numel = math.prod(full_shape)
    if version < 2 or len(full_shape) <= 1:
        return (numel,)
    return (full_shape[0], numel // full_shape[0]) if full_shape[0] else (0, 0)


class Geometry:
    """How one local parameter (or tensor-parallel shard) sits in its logical tensor.

    local_shape: the tensor this rank holds; spec: its ShardSpec (None: not split); tp_rank:
    this rank's tensor-parallel coordinate; version: the checkpoint format."""

    def __init__(self, local_shape: tuple[int, ...], spec: Any = None, tp_rank: int = 0, version: int = 2) -> None:
        full = tuple(spec.full_shape) if spec is not None else tuple(local_shape)
        self.full_shape, self.shape = full, logical_shape(full, version)
        numel = math.prod(local_shape)
        if len(self.shape) == 1:
            self.cols = numel  # one row
            self.rows = AxisMap(self.shape[0], *((spec.tp, tp_rank, spec.blocks) if spec is not None else ()))
            if spec is not None and (version < 2 and len(full) > 1 or spec.dim != 0):
                raise ValueError(f"a tensor-parallel parameter of shape {full} split along dim {spec.dim} cannot be "
                                 "stored in a format-1 checkpoint")
            self.col_map = AxisMap(numel)
            return
        self.cols = numel // local_shape[0] if local_shape[0] else 0
        rows, cols = AxisMap(self.shape[0]), AxisMap(self.shape[1])
        if spec is not None:
            if spec.dim == 0:
                rows = AxisMap(self.shape[0], spec.tp, tp_rank, spec.blocks)
            elif spec.dim == 1:
                inner = math.prod(full[2:])
                blocks = tuple(b * inner for b in spec.blocks) if spec.blocks is not None else None
                cols = AxisMap(self.shape[1], spec.tp, tp_rank, blocks)
            else:
                raise ValueError(f"checkpoints store tensor-parallel parameters split along dim 0 or 1; this one "
                                 f"(shape {full}) is split along dim {spec.dim}")
        self.rows, self.col_map = rows, cols

    def boxes(self, lo: int, hi: int) -> list[Box]:
        """The boxes of the local flat range [lo, hi) (module docstring)."""
        if hi <= lo:
            return []
        if len(self.shape) == 1:
            return [((f,), (n,), local) for f, local, n in self.rows.segments(lo, hi)]
        c = self.cols
        spans = []  # (first local row, row count, first local column, column count): contiguous runs
        first, last = lo // c, (hi - 1) // c
        if first == last:
            spans.append((first, 1, lo % c, hi - lo))
        else:
            start, end = first, last + 1  # whole rows [start, end)
            if lo % c:
                spans.append((first, 1, lo % c, c - lo % c))
                start += 1
            if hi % c:
                end -= 1
            if start < end:
                spans.append((start, end - start, 0, c))
            if hi % c:
                spans.append((last, 1, 0, hi % c))
        out: list[Box] = []
        for row0, nrows, col0, ncols in spans:
            col_segments = self.col_map.segments(col0, col0 + ncols)
            # several column segments per row (a column split in blocks): one row at a time stays contiguous
            runs = [(r, 1) for r in range(row0, row0 + nrows)] if len(col_segments) > 1 else [(row0, nrows)]
            for run0, k in runs:
                for full_row, local_row, n_rows in self.rows.segments(run0, run0 + k):
                    for full_col, local_col, n_cols in col_segments:
                        out.append(((full_row, full_col), (n_rows, n_cols), local_row * c + local_col))
        return out


class Boxes:
    """One logical tensor as torch.distributed.checkpoint sees this rank's part of it: ``boxes``
    [(offsets, sizes, tensor of those sizes)]. Save: the tensors are views of the engine's
    state; load: views of fresh tensors DCP fills. Use with `BoxesSavePlanner` /
    `tachyon.engine.checkpoint.manifest.TensorsOnlyLoadPlanner`, which look the views up."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, boxes: list[tuple[tuple, tuple, torch.Tensor]]) -> None:
        self.shape, self.dtype, self.items = torch.Size(shape), dtype, boxes
        self._by_offset = {tuple(off): t for off, _, t in boxes}

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)),
                                                      properties=TensorProperties(dtype=self.dtype), size=self.shape))
                for off, sizes, _ in self.items]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)) for off, sizes, _ in self.items]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._by_offset[tuple(index.offset)]


def lookup_box(state_dict: dict[str, Any], index: Any) -> torch.Tensor | None:
    """The tensor of ``index``'s box when ``state_dict[index.fqn]`` is a `Boxes`, else None."""
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, Boxes) else None


def boxes_save_planner() -> Any:
    """DCP's default save planner, also finding the tensors of `Boxes` entries."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class BoxesSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            found = lookup_box(self.state_dict, index)
            return found if found is not None else super().lookup_object(index)

    return BoxesSavePlanner()


def boxes_of(geometry: Geometry, pieces: list[tuple[int, int, torch.Tensor]]) -> list[tuple[tuple, tuple, torch.Tensor]]:
    """DCP boxes for ``pieces`` [(lo, hi, flat tensor holding local elements lo..hi)]."""
    out = []
    for lo, hi, flat in pieces:
        for off, sizes, start in geometry.boxes(lo, hi):
            out.append((off, sizes, flat.narrow(0, start - lo, math.prod(sizes)).view(sizes)))
    return out


__all__ = ["AxisMap", "Box", "Boxes", "Geometry", "boxes_of", "boxes_save_planner", "logical_shape", "lookup_box"]
