"""Philox 4x32-10 in PyTorch integer arithmetic, bit-identical to Triton's ``tl.randint``/``tl.rand``.

All values are held in int64 tensors as unsigned 32-bit numbers; a 32x32-bit product is formed in
int64 with two's-complement wrap-around, whose bit pattern is the exact 64-bit product.

The seed is a Python int or a 0-dim int64 tensor (on the offsets' device) holding the same value:
both give the same numbers, and a tensor seed is never read on the host (no device sync), so a
seed computed on the GPU, or traced by torch.compile as a graph input, works unchanged.
"""

from __future__ import annotations

import functools

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_UNIFORM_SCALE = 4.6566127342e-10  # the largest scale with (2**31 - 1) * scale < 1 in fp32


def _key(seed: int | torch.Tensor) -> tuple[int | torch.Tensor, int | torch.Tensor]:
    """(low, high) 32-bit halves of the 64-bit seed, as ints or 0-dim int64 tensors."""
    if isinstance(seed, torch.Tensor):
        s = seed.to(torch.int64)
        # arithmetic shift then mask = the logical shift of the seed's 64-bit pattern
        return s & _MASK32, (s >> 32) & _MASK32
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & _MASK32, (seed >> 32) & _MASK32


_CHUNK = 1 << 18  # offsets per pass: the ~10 int64 temporaries of a chunk stay in cache


def philox_randint(seed: int | torch.Tensor, offsets: torch.Tensor, n_rounds: int = 10) -> torch.Tensor:
    """The first output of Philox(counter=(offset lo, offset hi, 0, 0), key=(seed lo, seed hi)),
    as uint32 values in an int64 tensor of offsets' shape. Equal to ``tl.randint(seed, offsets)``
    (output 0 of :func:`philox4`)."""
    return philox4(seed, offsets, n_rounds)[0]


def rand(seed: int | torch.Tensor, offsets: torch.Tensor, n_rounds: int = 10) -> torch.Tensor:
    """Uniform [0, 1) float32, equal bit for bit to ``tl.rand(seed, offsets)``."""
    x = philox_randint(seed, offsets, n_rounds)
    # tl.rand reads the uint32 as int32 n and uses n if n >= 0 else -n - 1; for x >= 2**31,
    # -(x - 2**32) - 1 = 2**32 - 1 - x = x ^ 0xFFFFFFFF
    x = torch.where(x >= 2**31, x ^ _MASK32, x)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def philox4(seed: int | torch.Tensor, counters: torch.Tensor, n_rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """All four outputs of Philox(counter=(lo, hi, 0, 0), key=(seed lo, seed hi)), as uint32 values in
    int64 tensors of counters' shape. Equal to ``tl.randint4x(seed, counters)``."""
    if n_rounds < 1:
        raise ValueError(f"philox4: n_rounds must be >= 1; got {n_rounds}")
    key0, key1 = _key(seed)
    flat = counters.to(torch.int64).reshape(-1)
    outs = [torch.empty_like(flat) for _ in range(4)]
    for start in range(0, flat.numel(), _CHUNK):
        words = _philox4_chunk(flat[start:start + _CHUNK], key0, key1, n_rounds)
        for out, word in zip(outs, words):
            out[start:start + _CHUNK] = word
    return tuple(out.view(counters.shape) for out in outs)


def _philox4_chunk(off: torch.Tensor, k0, k1, n_rounds: int) -> tuple[torch.Tensor, ...]:
    c0, c1 = off & _MASK32, (off >> 32) & _MASK32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    for r in range(n_rounds):
        if r:
            k0 = (k0 + _KEY_A) & _MASK32
            k1 = (k1 + _KEY_B) & _MASK32
        prod_b, prod_a = c2 * _ROUND_B, c0 * _ROUND_A
        c0 = (prod_b >> 32).bitwise_and_(_MASK32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (prod_a >> 32).bitwise_and_(_MASK32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1, c3 = prod_b.bitwise_and_(_MASK32), prod_a.bitwise_and_(_MASK32)
    return c0, c1, c2, c3


# Dropout decisions: 16 bits each, 8 per Philox call (its four 32-bit outputs, low half first).
DECISIONS_PER_CALL = 8
_DECISION_RANGE = 1 << 16


@functools.lru_cache(maxsize=256)  # called by every dropout launch: a cached call runs no Python frame
def dropout_threshold(p: float) -> int:
    """The 16-bit threshold of drop probability ``p``: an element is kept when its 16-bit draw is
    >= this, so it is dropped with probability threshold / 65536 = p to within 2**-17."""
    return min(_DECISION_RANGE, max(0, round(float(p) * _DECISION_RANGE)))


def dropout_draws(seed: int | torch.Tensor, row_ids: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The 16-bit draws (int64 in [0, 65536)) of rows ``row_ids`` [R] of an [.., n_cols] matrix: [R, n_cols].

    Element (row, col) takes half (col % 2) of output (col % 8) // 2 of Philox at counter
    row * cdiv(n_cols, 8) + col // 8: each row starts a fresh group of counters, so a kernel tile
    whose columns start at a multiple of 8 computes one Philox call per 8 of its elements."""
    groups = -(-int(n_cols) // DECISIONS_PER_CALL)
    counters = row_ids.to(torch.int64).view(-1, 1) * groups + torch.arange(groups, device=row_ids.device)
    words = torch.stack(philox4(seed, counters), dim=-1)  # [R, groups, 4]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # [R, groups, 4, 2]
    return halves.view(row_ids.numel(), groups * DECISIONS_PER_CALL)[:, :n_cols]


def dropout_keep_rows(seed: int | torch.Tensor, row_ids: torch.Tensor, n_cols: int, p: float) -> torch.Tensor:
    """Boolean keep mask [R, n_cols] of rows ``row_ids`` (see :func:`dropout_draws`)."""
    return dropout_draws(seed, row_ids, n_cols) >= dropout_threshold(p)


def dropout_keep_mask(seed: int | torch.Tensor, shape: tuple[int, ...], p: float, device: torch.device | str = "cpu",
                      row_offset: int = 0) -> torch.Tensor:
    """Boolean keep mask of ``shape`` [..., N], viewed as rows of N: row r of that view is row
    ``row_offset + r`` of :func:`dropout_keep_rows`."""
    n_cols = shape[-1] if shape else 1
    n_rows = 1
    for d in shape[:-1]:
        n_rows *= d
    rows = torch.arange(row_offset, row_offset + n_rows, dtype=torch.int64, device=device)
    return dropout_keep_rows(seed, rows, n_cols, p).view(shape)
