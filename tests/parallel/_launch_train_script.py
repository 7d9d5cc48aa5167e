"""Run by tests/parallel/test_launch.py through `python -m tachyon.parallel.launch --nproc-per-node 2`.

Each rank: init_distributed, one all_reduce of its rank, then a few SGD steps on a tiny linear
model with gradients all-reduced by hand (plain data parallel), each rank on its own data shard.
Prints one line per rank: RESULT rank=<r> world=<w> sum=<all_reduce> loss0=<first> loss=<last> checksum=<weights>.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import tachyon
from tachyon.parallel.distributed import get_local_rank, get_rank, get_world_size


def main() -> None:
    torch.set_num_threads(1)
    tachyon.init_distributed(timeout=datetime.timedelta(seconds=60), verbose=False)
    rank, world = get_rank(), get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)

    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    x = torch.randn(16, 4, generator=data)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.25
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        losses.append(loss.item())
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    sys.stdout.write(  # one write per line: the two ranks share the pipe
        f"RESULT rank={rank} world={world} local_rank={get_local_rank()} sum={total.item():g} "
        f"loss0={losses[0]:.6f} loss={losses[-1]:.6f} checksum={checksum:.12f}\n"
    )
    sys.stdout.flush()
    # Returns without tearing anything down, as a user's script would: the exit handler that
    # init_distributed registered destroys the process group (tachyon.parallel.distributed).


if __name__ == "__main__":
    main()
