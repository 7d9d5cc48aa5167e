"""Counter-based random numbers shared by every dropout in tachyon.

Dropout masks are never stored: each kernel regenerates them in backward from (seed, offset),
where offset is the element's flat index in the tensor being dropped. The Triton kernels call
``tl.rand(seed, offset)`` (Philox 4x32-10); :func:`rand` here is a bit-exact PyTorch version of it,
so the PyTorch path and the Triton path of an op drop exactly the same elements.

    keep = rand(seed, offsets) > p          # the convention every kernel uses

The seed is a Python int or a 0-dim int64 tensor on the data's device (see :mod:`.seed`); the
same value gives the same numbers either way.
"""

from tachyon.kernels.random.reference import dropout_keep_mask, philox_randint, rand
from tachyon.kernels.random.seed import check_seed, join_seed, split_seed

__all__ = ["check_seed", "dropout_keep_mask", "join_seed", "philox_randint", "rand", "split_seed"]
