"""``deepspeed.runtime.utils``: the helpers scripts and tests import from DeepSpeed's runtime.

``set_random_seed`` seeds Python's, numpy's and torch's generators (DeepSpeed's);
``partition_uniform`` is `tachyon.parallel.pipeline.partition`'s (the boundaries of
``num_parts`` contiguous parts, DeepSpeed's format: ``num_parts + 1`` offsets; fewer items than
parts leave the last parts empty). ``partition_balanced`` is DeepSpeed's: it minimises the
difference between the heaviest and the lightest part (tachyon's PipelineModule minimises the
heaviest stage instead, and needs a layer per stage), with fewer items than parts split uniformly;
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


def partition_balanced(weights: list, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``weights`` minimising (heaviest part -
    lightest part), DeepSpeed's linear-partition dynamic programme (on ties the latest split point
    wins); with no more items than parts, `partition_uniform`'s boundaries."""
    from tachyon.parallel.pipeline.partition import partition_uniform

    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    high = [[inf] * (m + 1) for _ in range(n + 1)]
    low = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    split = [[0] * (m + 1) for _ in range(n + 1)]
    high[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(high[k][j - 1], part), min(low[k][j - 1], part)
                if cost[i][j] >= hi - lo:
                    cost[i][j], high[i][j], low[i][j], split[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(split[parts[-1]][j])
    return parts[::-1]


_TABLE = {"partition_uniform": Target((("tachyon.parallel.pipeline.partition", "partition_uniform"),))}
_OWN = ["partition_balanced", "see_memory_usage", "set_random_seed"]
__getattr__ = module_getattr(__name__, "deepspeed.runtime.utils", _TABLE, lambda: _OWN)
__all__ = [*_OWN, *_TABLE]
