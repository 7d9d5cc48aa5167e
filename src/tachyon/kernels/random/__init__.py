"""Counter-based random numbers shared by every dropout in tachyon.

Dropout masks are never stored: each kernel regenerates them in backward from the seed and the
element's position. A tensor being dropped is viewed as rows of N elements (attention's scores:
one row per (batch, head, query), N keys); element (row, col) is kept when

    draw(row, col) >= dropout_threshold(p)        a 16-bit draw; threshold = round(p * 65536)

where the draws of a row come from Philox 4x32-10 (Triton's ``tl.randint4x``) at counters
row * cdiv(N, 8) + col // 8, eight 16-bit draws per call (low half of each 32-bit output first).
One Philox call per 8 decisions instead of one per decision (``tl.rand``) is what makes dropout
cheap on a GPU; p is applied in steps of 1/65536. :func:`dropout_keep_rows` here is the bit-exact
PyTorch version, so the PyTorch path and the Triton path of an op drop exactly the same elements.

The seed is a Python int or a 0-dim int64 tensor on the data's device (see :mod:`.seed`); the
same value gives the same numbers either way. :func:`rand` (``tl.rand``) stays for other uses.
"""

from tachyon.kernels.random.reference import (
    dropout_draws, dropout_keep_mask, dropout_keep_rows, dropout_threshold, philox4, philox_randint, rand,
)
from tachyon.kernels.random.seed import check_seed, join_seed, split_seed

__all__ = ["check_seed", "dropout_draws", "dropout_keep_mask", "dropout_keep_rows", "dropout_threshold", "join_seed",
           "philox4", "philox_randint", "rand", "split_seed"]
