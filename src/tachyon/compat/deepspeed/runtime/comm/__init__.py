"""``deepspeed.runtime.comm``: DeepSpeed's compressed-communication backends (``nccl.NcclBackend``,
``mpi.MpiBackend``, ``compressed.CompressedBackend``), which its 1-bit optimizers call. tachyon's
1-bit optimizers communicate through `tachyon.parallel.compression` (``compressed_all_reduce``), a
different compression (per-block scales, the L1 mean; docs/onebit.md), so these classes are not
provided: using one raises NotImplementedError saying so."""

from __future__ import annotations

from tachyon.compat._names import module_getattr

WHY = ("DeepSpeed's compressed-communication backend is not provided: tachyon's 1-bit optimizers use "
       "tachyon.parallel.compression.compressed_all_reduce, whose compression (a sign bit per element and one "
       "L1-mean scale per block of 2048 elements) differs from DeepSpeed's (one L2 scale per worker tensor); "
       "docs/onebit.md")

_SUBMODULES = ("compressed", "mpi", "nccl")
__getattr__ = module_getattr(__name__, "deepspeed.runtime.comm", {}, submodules=_SUBMODULES)


__all__ = list(_SUBMODULES)
