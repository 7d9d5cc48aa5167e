"""The dropout mask in Triton (:func:`keep_tile`, :func:`keep_row`), and kernels that write it or
tl.rand(seed, offset) for a range (tests and debugging).

The seed is a scalar kernel argument (a Python int) or loaded from memory (a 0-dim int64 tensor):
:func:`load_seed` is the helper every dropout kernel uses, so both forms reach Philox as the same
64-bit key. The mask's definition (16-bit draws, eight per Philox call, per-row counters) is in
tachyon.kernels.random; :func:`keep_tile` computes one Philox call per 8 elements of a tile and
spreads its four 32-bit outputs over them with joins and reshapes (no per-element Philox).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.kernels.ints import cdiv, next_power_of_2
from tachyon.kernels.launch import fast_launch


@triton.jit
def load_seed(seed, SEED_PTR, SEED_FROM_PTR: tl.constexpr):
    """The Philox seed: the scalar ``seed``, or the int64 at ``SEED_PTR`` when SEED_FROM_PTR."""
    if SEED_FROM_PTR:
        seed = tl.load(SEED_PTR)
    return seed


def seed_args(seed: int | torch.Tensor, dummy: torch.Tensor) -> tuple[int, torch.Tensor, bool]:
    """(scalar seed, seed pointer, SEED_FROM_PTR) for a launch: an int travels as the scalar (the
    pointer is ``dummy``, never read), a 0-dim int64 tensor as the pointer (the scalar is 0)."""
    if isinstance(seed, torch.Tensor):
        return 0, seed, True
    return int(seed), dummy, False


@triton.jit
def _spread(r0, r1, r2, r3, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Four [ROWS, COLS // 8] uint32 Philox outputs -> [ROWS, COLS] int32 16-bit draws: column
    8g + 2w + h holds half h (0: low) of output w of group g."""
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (ROWS, COLS // 2))  # 4g + w -> output w
    halves = tl.join(words & 0xFFFF, words >> 16)  # logical shifts: the words are uint32
    return tl.reshape(halves, (ROWS, COLS)).to(tl.int32)


@triton.jit
def keep_tile(seed, row_counters, col0, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] dropout keep mask: row_counters [BLOCK_M] int64 = row * cdiv(N, 8) (the
    first Philox counter of each row), columns col0 .. col0 + BLOCK_N - 1 with col0 % 8 == 0 and
    BLOCK_N % 8 == 0; kept where the 16-bit draw >= threshold (tachyon.kernels.random)."""
    groups = col0 // 8 + tl.arange(0, BLOCK_N // 8)
    r0, r1, r2, r3 = tl.randint4x(seed, row_counters[:, None] + groups[None, :])
    return _spread(r0, r1, r2, r3, BLOCK_M, BLOCK_N) >= threshold


@triton.jit
def keep_row(seed, row_counter, threshold, BLOCK_N: tl.constexpr):
    """[BLOCK_N] keep mask of columns 0 .. BLOCK_N - 1 of one row (BLOCK_N % 8 == 0): row_counter is
    row * cdiv(N, 8), an int64 scalar."""
    groups = tl.arange(0, BLOCK_N // 8)
    r0, r1, r2, r3 = tl.randint4x(seed, row_counter + groups[None, :])
    return tl.reshape(_spread(r0, r1, r2, r3, 1, BLOCK_N), (BLOCK_N,)) >= threshold


@fast_launch
@triton.jit
def _keep_kernel(OUT, seed, SEED_PTR, row0, M, N, groups, threshold, SEED_FROM_PTR: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW: tl.constexpr):
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROW:  # one row per program through keep_row
        cols = tl.arange(0, BLOCK_N)
        row = tl.program_id(0).to(tl.int64)
        keep = keep_row(seed, (row0 + row) * groups, threshold, BLOCK_N)
        tl.store(OUT + row * N + cols, keep.to(tl.int8), mask=cols < N)
    else:
        col0 = tl.program_id(1) * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)
        keep = keep_tile(seed, (row0 + rows.to(tl.int64)) * groups, col0, threshold, BLOCK_M, BLOCK_N)
        tl.store(OUT + rows[:, None] * N + cols[None, :], keep.to(tl.int8),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def keep_mask(seed: int | torch.Tensor, m: int, n: int, p: float, row0: int = 0, device: str | torch.device = "cpu",
              row: bool = False, block_m: int = 4, block_n: int = 32) -> torch.Tensor:
    """bool [m, n]: rows row0 .. row0 + m - 1 of the dropout keep mask through :func:`keep_tile` (or
    :func:`keep_row` when ``row``, block_n covering n), for tests against the PyTorch reference."""
    from tachyon.kernels.random.reference import dropout_threshold

    out = torch.empty((m, n), dtype=torch.int8, device=device)
    s, ptr, from_ptr = seed_args(seed, out)
    if row:
        block_n = max(8, next_power_of_2(n))
    grid = (m,) if row else (cdiv(m, block_m), cdiv(n, block_n))
    _keep_kernel[grid](out, s, ptr, row0, m, n, cdiv(n, 8), dropout_threshold(p), SEED_FROM_PTR=from_ptr,
                       BLOCK_M=block_m, BLOCK_N=block_n, ROW=row)
    return out.bool()


@fast_launch
@triton.jit
def _rand_kernel(OUT, seed, SEED_PTR, offset0, n, SEED_FROM_PTR: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    tl.store(OUT + idx, tl.rand(seed, offset0 + idx), mask=mask)


def rand(seed: int | torch.Tensor, n: int, offset: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """fp32 [n]: tl.rand(seed, offset + i). seed: an int, or a 0-dim int64 tensor on ``device``."""
    out = torch.empty(n, dtype=torch.float32, device=device)
    block = 1024
    s, ptr, from_ptr = seed_args(seed, out)
    _rand_kernel[(cdiv(n, block),)](out, s, ptr, offset, n, SEED_FROM_PTR=from_ptr, BLOCK=block)
    return out


@triton.jit
def _splitmix64(x):
    """splitmix64 of uint64 values (wrapping arithmetic; shifts on uint64 are logical)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@fast_launch
@triton.jit
def _chained_seeds_kernel(KEY, CALLS, OUT, ADVANCE: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    calls = tl.load(CALLS)
    if ADVANCE:
        calls = calls + 1
        tl.store(CALLS, calls)
    h = _splitmix64(tl.load(KEY).to(tl.uint64, bitcast=True) ^ calls.to(tl.uint64, bitcast=True))
    sites = tl.arange(0, BLOCK)
    seeds = _splitmix64(h ^ sites.to(tl.uint64)) & 0x7FFFFFFFFFFFFFFF
    tl.store(OUT + sites, seeds.to(tl.int64, bitcast=True), mask=sites < N)


def chained_seeds(key: torch.Tensor, calls: torch.Tensor, n: int, advance: bool) -> torch.Tensor:
    """One launch: ``calls += 1`` when ``advance``, then int64 [n] seeds
    splitmix64(splitmix64(key ^ calls) ^ site) & (2**63 - 1) for site = 0 .. n-1.
    key, calls: 0-dim int64 on one device (calls updated in place)."""
    out = torch.empty(n, dtype=torch.int64, device=key.device)
    _chained_seeds_kernel[(1,)](key, calls, out, ADVANCE=advance, N=n, BLOCK=max(next_power_of_2(n), 2))
    return out
