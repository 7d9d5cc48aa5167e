"""Launch shapes shared by the elementwise Triton kernels (kernels/activation, kernels/dropout).

Forward: 2-D tiles of about TILE elements, [BLOCK_M rows, BLOCK_N columns]. Backward: a grid of
(row programs, column blocks) where each row program walks a contiguous range of rows (a
multiple of BLOCK_M) and writes one row of fp32 partial column sums, which the launcher adds up:
enough row programs to fill the GPU, few under the interpreter (each program costs milliseconds).
"""

from __future__ import annotations

import torch
import triton

TILE = 4096  # elements per program tile: 16-32 per thread at 4-8 warps


def tiles(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the 2-D tiles over rows of n columns."""
    block_n = min(triton.next_power_of_2(n), 1024)
    block_m = max(1, TILE // block_n)
    return block_m, block_n, 8 if block_m * block_n >= 4096 else 4


def max_programs(device: torch.device) -> int:
    """How many programs fill ``device``: 8 per SM on a GPU, 4 under the interpreter."""
    if device.type == "cuda":
        return 8 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def row_split(m: int, block_m: int, col_blocks: int, device: torch.device) -> tuple[int, int]:
    """(row programs, rows per program) for m rows in blocks of block_m, beside col_blocks column
    blocks; rows per program is a multiple of block_m and no program is empty."""
    programs = max(1, min(triton.cdiv(m, block_m), triton.cdiv(max_programs(device), col_blocks)))
    rows_per_program = triton.cdiv(triton.cdiv(m, programs), block_m) * block_m
    return triton.cdiv(m, rows_per_program), rows_per_program
