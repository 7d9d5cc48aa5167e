"""Philox 4x32-10 in PyTorch integer arithmetic, bit-identical to Triton's ``tl.randint``/``tl.rand``.

All values are held in int64 tensors as unsigned 32-bit numbers; a 32x32-bit product is formed in
int64 with two's-complement wrap-around, whose bit pattern is the exact 64-bit product.

The seed is a Python int or a 0-dim int64 tensor (on the offsets' device) holding the same value:
both give the same numbers, and a tensor seed is never read on the host (no device sync), so a
seed computed on the GPU, or traced by torch.compile as a graph input, works unchanged.
"""

from __future__ import annotations

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


def philox_randint(seed: int | torch.Tensor, offsets: torch.Tensor, n_rounds: int = 10) -> torch.Tensor:
    """The first output of Philox(counter=(offset lo, offset hi, 0, 0), key=(seed lo, seed hi)),
    as uint32 values in an int64 tensor. Equal to ``tl.randint(seed, offsets)``.

    seed: a Python int or a 0-dim integer tensor on the offsets' device (its 64-bit pattern is
    the key; not read on the host)."""
    k0, k1 = _key(seed)
    off = offsets.to(torch.int64)
    c0 = off & _MASK32
    c1 = (off >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(n_rounds):
        # the 64-bit product of two uint32 values, held (wrapped) in int64: its bit pattern is
        # exact, so the high and low 32-bit halves come out by shifting and masking
        prod_b = c2 * _ROUND_B
        prod_a = c0 * _ROUND_A
        c0, c1 = ((prod_b >> 32) & _MASK32) ^ c1 ^ k0, prod_b & _MASK32
        c2, c3 = ((prod_a >> 32) & _MASK32) ^ c3 ^ k1, prod_a & _MASK32
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0


def rand(seed: int | torch.Tensor, offsets: torch.Tensor, n_rounds: int = 10) -> torch.Tensor:
    """Uniform [0, 1) float32, equal bit for bit to ``tl.rand(seed, offsets)``."""
    x = philox_randint(seed, offsets, n_rounds)
    x = torch.where(x >= 2**31, x - 2**32, x)  # reinterpret as int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def dropout_keep_mask(seed: int | torch.Tensor, shape: tuple[int, ...], p: float, device: torch.device | str = "cpu",
                      offset: int = 0) -> torch.Tensor:
    """Boolean keep-mask of ``shape``: element i (flat index) is kept when rand(seed, offset + i) > p."""
    n = 1
    for d in shape:
        n *= d
    offsets = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    return (rand(seed, offsets) > p).view(shape)
