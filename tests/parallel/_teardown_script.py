"""Run by tests/parallel/test_teardown.py under `python -m tachyon.parallel.launch --nproc-per-node 2`.

argv[1] = "rank1-raises": both ranks start through tachyon.init_distributed (a long group timeout)
and all-reduce once; rank 1 then raises, rank 0 returns. The exit handler must let rank 1 leave at
once with its own error (no barrier) and rank 0 finish its teardown without waiting for the
timeout.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import tachyon


def main(mode: str) -> None:
    tachyon.init_distributed(timeout=datetime.timedelta(seconds=300), verbose=False)
    t = torch.ones(1)
    dist.all_reduce(t)
    if mode == "rank1-raises" and dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose after its first collective")
    print(f"rank {dist.get_rank()} done sum={t.item():g}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
