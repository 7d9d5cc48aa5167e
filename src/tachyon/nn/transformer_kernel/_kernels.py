"""The fused ops the BERT kernel layer is built from, and the per-call dropout seeds.

The seed of one dropout site is a splitmix64 chain over (layer seed, layer_id, call, site).
:func:`dropout_seed` computes it with Python ints; :func:`dropout_seeds` computes the same values
with int64 tensor ops on the layer's device from ``dropout_key`` (the chain's (seed, layer_id)
prefix, a constant per layer) and the forward counter (a tensor), so the layer never reads the
counter on the host and torch.compile sees the seeds as tensors computed in the graph rather
than as constants that change every step.

Tensor splitmix64: int64 addition and multiplication wrap around (two's complement), so their
bit patterns are the uint64 results; a logical right shift is an arithmetic shift with the
sign-extended high bits masked off.
"""

from __future__ import annotations

import torch

from tachyon.backend import resolve
from tachyon.kernels.attention import attention, attention_qkvpacked, padding_bias_from_mask
from tachyon.kernels.dropout import bias_dropout_add, bias_dropout_add_layer_norm
from tachyon.kernels.layernorm import layer_norm
from tachyon.kernels.linear import linear_with_residual, mlp
from tachyon.kernels.registry import fused_op

_M64 = (1 << 64) - 1
_M63 = (1 << 63) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
NUM_SITES = 3  # attention probabilities, attention output, FFN output


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * _MIX1) & _M64
    x = ((x ^ (x >> 27)) * _MIX2) & _M64
    return x ^ (x >> 31)


def _signed64(x: int) -> int:
    """The int64 with the bit pattern of uint64 ``x``."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def dropout_seed(base_seed: int, layer_id: int, call: int, site: int) -> int:
    """The Philox seed of one dropout site in one forward call of one layer, in [0, 2**63).

    A splitmix64 chain over (base seed, layer_id, call counter, site), so every (layer, call,
    site) gets its own stream and the same inputs always give the same seed.
    """
    h = _splitmix64(base_seed & _M64)
    for value in (layer_id, call, site):
        h = _splitmix64(h ^ (value & _M64))
    return h & _M63


def dropout_key(base_seed: int, layer_id: int) -> int:
    """The (seed, layer_id) prefix of the chain, as a signed int64 value (for a buffer)."""
    return _signed64(_splitmix64(_splitmix64(base_seed & _M64) ^ (layer_id & _M64)))


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of the 64-bit patterns held in an int64 tensor."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each int64 element's bit pattern (wrapping arithmetic), as int64."""
    x = x + _signed64(_GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed64(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed64(_MIX2)
    return x ^ _shr(x, 31)


def dropout_seeds(key: torch.Tensor, call: torch.Tensor) -> list[torch.Tensor]:
    """The seeds of the three dropout sites of forward number ``call``, as 0-dim int64 tensors on
    ``key``'s device; equal to ``[dropout_seed(seed, layer_id, call, site) for site in 0, 1, 2]``
    for ``key = dropout_key(seed, layer_id)``. key, call: 0-dim int64 tensors. No host sync."""
    h = splitmix64_tensor(key ^ call)
    sites = torch.arange(NUM_SITES, dtype=torch.int64, device=key.device)
    return list((splitmix64_tensor(h ^ sites) & _M63).unbind(0))


def inside_backward() -> bool:
    """True while autograd's engine runs a backward pass (an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


@fused_op("tachyon::next_dropout_seeds", mutates_args=("calls",))
def _next_dropout_seeds(key: torch.Tensor, calls: torch.Tensor, backend: str) -> torch.Tensor:
    advance = not inside_backward()
    if backend == "triton":
        from tachyon.kernels.random.triton import chained_seeds

        return chained_seeds(key, calls, NUM_SITES, advance)
    if advance:
        calls.add_(1)
    return torch.stack(dropout_seeds(key, calls))


@_next_dropout_seeds.register_fake
def _(key, calls, backend):
    return key.new_empty(NUM_SITES)


def next_dropout_seeds(key: torch.Tensor, calls: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """A layer's forward: ``calls += 1`` (in place, except while autograd runs a backward pass, so
    an activation-checkpoint recompute reuses the forward's seeds), then the int64 [3] seeds
    ``dropout_seeds(key, calls)`` of its three dropout sites. key, calls: 0-dim int64 on one device.

    One custom op, so the check runs when the op runs (also inside a compiled graph); on CUDA one
    Triton launch (kernels/random/triton.py ``chained_seeds``) instead of ~25 tiny tensor ops."""
    return _next_dropout_seeds(key, calls, resolve(key, backend))


__all__ = [
    "attention", "attention_qkvpacked", "bias_dropout_add", "bias_dropout_add_layer_norm",
    "dropout_key", "dropout_seed", "dropout_seeds", "inside_backward", "layer_norm", "linear_with_residual", "mlp",
    "next_dropout_seeds",
    "padding_bias_from_mask", "splitmix64_tensor",
]
