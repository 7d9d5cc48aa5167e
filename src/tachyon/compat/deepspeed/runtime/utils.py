"""``deepspeed.runtime.utils``: the helpers scripts and tests import from DeepSpeed's runtime.

``set_random_seed`` seeds Python's, numpy's and torch's generators (DeepSpeed's);
``partition_uniform`` / ``partition_balanced`` are `tachyon.parallel.pipeline.partition`'s (the
boundaries of ``num_parts`` contiguous parts, DeepSpeed's format: ``num_parts + 1`` offsets);
``see_memory_usage`` logs the accelerator's memory counters when ``force`` is set.
"""

from __future__ import annotations

import logging
import random

import torch

from tachyon.compat._names import Target, module_getattr

logger = logging.getLogger("DeepSpeed")


def set_random_seed(seed: int) -> None:
    """Seed ``random``, numpy (when installed) and torch (every device)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log allocated / reserved accelerator memory (only with ``force``, as DeepSpeed)."""
    if not force:
        return
    from tachyon.compat.deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    logger.info(f"{message} | allocated {acc.memory_allocated() / 2**30:.2f} GB | "
                f"max allocated {acc.max_memory_allocated() / 2**30:.2f} GB | reserved {acc.memory_reserved() / 2**30:.2f} GB")


_TABLE = {name: Target((("tachyon.parallel.pipeline.partition", name),))
          for name in ("partition_uniform", "partition_balanced")}
_OWN = ["see_memory_usage", "set_random_seed"]
__getattr__ = module_getattr(__name__, "deepspeed.runtime.utils", _TABLE, lambda: _OWN)
__all__ = [*_OWN, *_TABLE]
