"""The dropout seed every op accepts: a Python int, or a 0-dim int64 tensor on the data's device.

A tensor seed lets a seed live on the GPU and change every step without a host sync, and lets
torch.compile treat it as a graph input instead of a constant (an int seed that changes per step
would be baked into the graph and force a recompile). Both forms give the same Philox stream:
``rand(s, offsets) == rand(torch.tensor(s), offsets)`` bit for bit, on every backend.

The value of a tensor seed is never read on the host, so it is not range-checked; it must hold a
value in [0, 2**63) like an int seed (any int64 bit pattern gives a valid stream).
"""

from __future__ import annotations

import torch

SEED_RANGE = "[0, 2**63)"


def split_seed(seed: int | torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """A checked seed as the custom ops take it: ``(int seed, None)``, or ``(0, tensor seed)``."""
    return (0, seed) if isinstance(seed, torch.Tensor) else (int(seed), None)


def join_seed(seed: int, seed_tensor: torch.Tensor | None) -> int | torch.Tensor:
    """The inverse of :func:`split_seed`: the tensor seed when there is one, else the int."""
    return seed_tensor if seed_tensor is not None else seed


def check_seed(op: str, seed: object, device: torch.device, context: str = "") -> int | torch.Tensor:
    """Validate a seed for an op whose data is on ``device``; returns it as an int or the tensor.

    Raises ValueError naming ``seed`` and the allowed forms: an int in [0, 2**63) (bools refused),
    or a 0-dim torch.int64 tensor on ``device``. ``context`` is appended to say why a seed is
    needed (e.g. " when dropout is active (p=0.1)")."""
    allowed = f"an int in {SEED_RANGE} or a 0-dim torch.int64 tensor on {device}"
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.dim() != 0 or seed.device != device:
            raise ValueError(
                f"{op}: seed must be {allowed}{context}; got a tensor of dtype {seed.dtype}, shape "
                f"{tuple(seed.shape)} on {seed.device}"
            )
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{op}: seed must be {allowed}{context}; got {seed!r}")
    return int(seed)


__all__ = ["SEED_RANGE", "check_seed", "join_seed", "split_seed"]
