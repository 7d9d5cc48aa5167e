"""PyTorch reference for bias + dropout + residual (+ LayerNorm/RMSNorm): CPU path and oracle.

For x: [..., N] viewed as [M, N] row-major, bias: [N] or None, residual: [..., N] or None:

    keep    = dropout_keep_mask(seed, x.shape, p)   rows of N (Philox, tachyon.kernels.random)
    z       = residual + where(keep, (x + bias) / (1 - p), 0)     in fp32, stored in x's dtype
    y       = LayerNorm(z) * weight + ln_bias    (or RMSNorm)     from the stored (rounded) z

With p == 0 or training=False there is no dropout and seed is not read. The seed is an int or a
0-dim int64 tensor on x's device (same value, same mask). The mask is a function of (seed, index)
only, so the backward regenerates it instead of storing it:

    dz = dout (+ the norm's backward)    dresidual = dz
    dx = where(keep, dz / (1 - p), 0)    dbias = sum over rows of dx (fp32, then bias's dtype)

:func:`bias_dropout_add` and :func:`bias_dropout_add_layer_norm` are autograd code (the oracle);
the ``*_forward`` / ``*_backward`` functions are the explicit passes the op's CPU path runs, with
the same saving behaviour as the Triton kernels. The norm math is kernels/layernorm's.
"""

from __future__ import annotations

import torch

from tachyon.kernels.layernorm.reference import norm_backward, norm_forward
from tachyon.kernels.random import dropout_keep_mask


def dropout_scale(p: float) -> float:
    """1 / (1 - p): what kept elements are multiplied by (0 for p == 1, where nothing is kept)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _keep(seed: int | torch.Tensor, x: torch.Tensor, p: float) -> torch.Tensor:
    return dropout_keep_mask(seed, tuple(x.shape), p, device=x.device)


def _dropped(x: torch.Tensor, bias: torch.Tensor | None, p: float, seed: int | torch.Tensor | None) -> torch.Tensor:
    """fp32 dropout(x + bias); p == 0 means no dropout."""
    h = x.float()
    if bias is not None:
        h = h + bias.float()
    if p > 0:
        h = torch.where(_keep(seed, x, p), h * dropout_scale(p), 0.0)
    return h


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, p: float,
    seed: int | torch.Tensor | None, *, training: bool = True,
) -> torch.Tensor:
    """Autograd reference: residual + dropout(x + bias) in x's dtype."""
    h = _dropped(x, bias, p if training else 0.0, seed)
    if residual is not None:
        h = h + residual.float()
    return h.to(x.dtype)


def bias_dropout_add_layer_norm(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, weight: torch.Tensor,
    ln_bias: torch.Tensor | None, eps: float, p: float, seed: int | torch.Tensor | None, *, training: bool = True,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd reference: (y, z) with z = residual + dropout(x + bias), y = LayerNorm(z) (RMSNorm if rms)."""
    z = bias_dropout_add(x, bias, residual, p, seed, training=training)
    y, _, _, _ = norm_forward(z, weight, ln_bias, None, eps, rms)
    return y, z


def bias_dropout_add_forward(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, p: float, seed: int | torch.Tensor,
) -> torch.Tensor:
    """Explicit forward of the CPU path (p already 0 when not training). x, residual: [M, N]."""
    with torch.no_grad():
        return bias_dropout_add(x, bias, residual, p, seed)


def bias_dropout_backward(
    dz: torch.Tensor, p: float, seed: int | torch.Tensor, want_dbias: bool, dx_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dz: [M, N], the gradient of z (= of the residual). Returns (dx in dx_dtype, fp32 dbias or None)."""
    with torch.no_grad():
        g = dz.float()
        if p > 0:
            g = torch.where(_keep(seed, dz, p), g * dropout_scale(p), 0.0)
        return g.to(dx_dtype), (g.sum(0) if want_dbias else None)


def bias_dropout_add_norm_forward(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, weight: torch.Tensor,
    ln_bias: torch.Tensor | None, eps: float, p: float, seed: int | torch.Tensor, rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit forward of the CPU path. x, residual: [M, N]. Returns (y, z, mean, rstd), stats fp32 [M]."""
    with torch.no_grad():
        z = bias_dropout_add(x, bias, residual, p, seed)
        y, _, mean, rstd = norm_forward(z, weight, ln_bias, None, eps, rms)
        return y, z, mean, rstd


def bias_dropout_add_norm_backward(
    dy: torch.Tensor, saved: torch.Tensor, dz_out: torch.Tensor | None, weight: torch.Tensor,
    ln_bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: int | torch.Tensor, rms: bool,
    from_output: bool, want_dbias: bool, want_dres: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Explicit backward. ``saved`` is z, or y when ``from_output`` (the invertible form).

    Returns (dx, dresidual or None, fp32 dbias or None, dweight, dln_bias or None); dx and
    dresidual in dy's dtype (the dtype of x and residual). As in the Triton launcher, dresidual
    is only returned when ``want_dres`` and there is dropout (without dropout it equals dx).
    """
    with torch.no_grad():
        dz, dw, dlnb = norm_backward(
            dy, saved, dz_out, weight, ln_bias, mean, rstd, rms, from_output, torch.float32,
        )
        dx, dbias = bias_dropout_backward(dz, p, seed, want_dbias, dy.dtype)
        return dx, (dz.to(dy.dtype) if want_dres and p > 0 else None), dbias, dw, dlnb
