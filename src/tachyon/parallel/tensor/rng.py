"""Dropout randomness that differs across tensor-parallel ranks where it must, and only there.

tachyon's dropouts draw a Philox seed from the default generator of the data's device on every
call. Tensor-parallel ranks start from the same generator state (same ``torch.manual_seed``) and
run the same calls, so they draw the same seeds: right for dropout on replicated activations
(the hidden dropout without sequence parallelism must give every rank the same mask, or the
replicas drift apart), wrong for dropout on data that is split across ranks (attention
probabilities of different heads, hidden states of different sequence slices), where equal
seeds would make the masks of different shards identical.

:func:`tp_distinct_rng` runs a block with a per-rank stream, as Megatron's model-parallel RNG
tracker does, but derived from the default generator instead of kept as separate state: it draws
one value from the CPU default generator (the same on every tp rank), seeds the device generator
with a mix of that value and the tp rank for the block, then restores the device generator. The
default streams advance by exactly one CPU draw on every rank, so replicated regions stay in
step; and the block's randomness is a function of the generator state on entry, so activation
checkpointing (which restores that state before recomputing) recomputes the same masks.

:func:`tp_seeds` serves a caller that passes its dropouts explicit seeds from one draw per
forward (TransformerLayer's ``_seed_draw``): every rank draws the same [tp, sites] table from the
device's default generator (one launch, the streams stay in step), and a site takes row
``tp_rank`` where its data is split across ranks, row 0 where it is replicated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive ranks far apart


def _device_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


@contextmanager
def tp_distinct_rng(device: torch.device | str, tp_rank: int) -> Iterator[None]:
    """Inside the block, ``device``'s default generator yields a stream specific to ``tp_rank``."""
    device = torch.device(device)
    base = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # CPU generator: no device sync
    generator = _device_generator(device)
    saved = generator.get_state()
    generator.manual_seed((base + _MIX * (tp_rank + 1)) % (2**63))
    try:
        yield
    finally:
        generator.set_state(saved)


def tp_seeds(device: torch.device | str, tp_size: int, tp_rank: int, distinct: list[bool]) -> list[torch.Tensor]:
    """One Philox seed per dropout site (0-dim int64 views of one ``torch.randint`` draw of
    [tp_size, len(distinct)] on ``device``'s default generator): the same on every tp rank where
    ``distinct[i]`` is False, this rank's own where it is True."""
    table = torch.randint(0, 2**62, (tp_size, len(distinct)), dtype=torch.int64, device=device)
    return [table[tp_rank if split else 0, site] for site, split in enumerate(distinct)]


__all__ = ["tp_distinct_rng", "tp_seeds"]
