"""A Triton kernel that writes tl.rand(seed, offset) for a range of offsets (tests and debugging).

The seed is a scalar kernel argument (a Python int) or loaded from memory (a 0-dim int64 tensor):
:func:`load_seed` is the helper every dropout kernel uses, so both forms reach ``tl.rand`` as the
same 64-bit key.
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
