"""``LayerNormLinear``: LayerNorm (or RMSNorm) followed by a linear layer, Transformer Engine style.

    ln_qkv = tachyon.nn.LayerNormLinear(1024, 3 * 1024, eps=1e-5)
    qkv = ln_qkv(x)                                  # linear(layer_norm(x))
    qkv, ln_out = LayerNormLinear(..., return_layernorm_output=True)(x)   # ln_out for the residual

The norm is tachyon's fused norm kernel (one pass over the activations, statistics in fp32); the
GEMM is :func:`tachyon.fp8.fp8_linear` (FP8 inside fp8_autocast). Parameters (TE's names):
``layer_norm_weight`` [in], ``layer_norm_bias`` [in] (LayerNorm only), ``weight`` [out, in],
``bias`` [out]. With ``zero_centered_gamma`` the norm weight is stored as gamma - 1 (starts at
zero, y = norm(x) * (1 + gamma)), which keeps weight decay from pulling the scale toward zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tachyon.fp8.linear import FP8ModuleMixin, fp8_linear
from tachyon.kernels.layernorm import layer_norm, rms_norm
from tachyon.nn.linear import check_features, check_input, compute_dtype, make_weight, register_bias, te_outputs

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(module: str, normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{module}: normalization={normalization!r} is not supported; allowed: {', '.join(map(repr, NORMALIZATIONS))}")


def make_norm_params(module: nn.Module, size: int, normalization: str, zero_centered_gamma: bool, dtype, device) -> None:
    """Registers ``layer_norm_weight`` (ones, or zeros when zero-centered) and ``layer_norm_bias``."""
    init = torch.zeros if zero_centered_gamma else torch.ones
    module.layer_norm_weight = nn.Parameter(init(size, dtype=dtype, device=device))
    register_bias(module, "layer_norm_bias", size, normalization == "LayerNorm", dtype, device)


def norm_weight(gamma: Tensor, zero_centered_gamma: bool, dtype: torch.dtype) -> Tensor:
    """The weight a norm kernel takes: gamma in ``dtype``, or 1 + gamma when zero-centered.

    The zero-centered weight is formed in fp32 (the kernel computes in fp32), so small gammas of
    a low-precision parameter are not rounded away by adding 1.
    """
    return gamma.float() + 1.0 if zero_centered_gamma else gamma.to(dtype)


def apply_norm(module: nn.Module, x: Tensor, dtype: torch.dtype, return_input_branch: bool = False):
    """The module's norm over the last dim of x (in ``dtype``); weight 1 + gamma when zero-centered
    (:func:`norm_weight`). ``return_input_branch``: returns (y, x as a view) for a caller that also
    adds x to a residual branch; x's two gradients are then summed by the norm's backward kernel
    (``return_residual=True`` of the norm ops), not by a separate add."""
    weight = norm_weight(module.layer_norm_weight, module.zero_centered_gamma, dtype)
    if module.normalization == "RMSNorm":
        return rms_norm(x, weight, eps=module.eps, return_residual=return_input_branch, backend=module.backend)
    bias = module.layer_norm_bias.to(dtype)
    return layer_norm(x, weight, bias, eps=module.eps, return_residual=return_input_branch, backend=module.backend)


class LayerNormLinear(FP8ModuleMixin, nn.Module):
    """y = linear(norm(x)): LayerNorm or RMSNorm, then a GEMM that runs in FP8 inside fp8_autocast.

    in_features, out_features: sizes. eps: the norm's epsilon. bias: the linear's bias.
    normalization: "LayerNorm" or "RMSNorm". return_layernorm_output: also return the norm's
    output (for apply_residual_connection_post_layernorm). init_method: callable(weight) for
    ``weight`` (default torch.nn.Linear's kaiming uniform; biases start at zero). params_dtype,
    device: of the parameters. zero_centered_gamma: store gamma - 1. return_bias: return the bias
    instead of adding it. backend: pins the norm kernel's backend ("triton" / "torch").

    forward(x, is_first_microbatch=None, *, return_bias=None, return_input_branch=False):
    x [..., in_features] -> out [..., out_features] in the params dtype (or torch.autocast's);
    returns out, (out, bias), (out, ln_out) or (out, bias, ln_out) (TE's order).
    ``return_bias`` overrides the module's setting for one call. ``return_input_branch`` appends
    x (in the compute dtype, as a view) for a caller that adds it to a residual branch: the
    norm's backward kernel then adds that branch's gradient to x's (no separate add). is_first_microbatch: the FP8 weight cache across
    gradient-accumulation micro-batches, as in :class:`tachyon.nn.Linear` (None: no caching;
    True: cast and cache; False: reuse the cache). Saved for backward: the norm's input and fp32
    row statistics, and the GEMM's input (ln_out, or its FP8 copy inside fp8_autocast) and
    weight (or the cached FP8 weight).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_layernorm_output: bool = False,
        init_method: Callable[[Tensor], None] | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        zero_centered_gamma: bool = False,
        return_bias: bool = False,
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        check_features("LayerNormLinear", in_features=in_features, out_features=out_features)
        check_normalization("LayerNormLinear", normalization)
        if not eps >= 0:
            raise ValueError(f"LayerNormLinear: eps must be >= 0; got {eps}")
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output, self.return_bias, self.use_bias = return_layernorm_output, return_bias, bias
        self.backend = backend
        dtype = params_dtype or torch.get_default_dtype()
        make_norm_params(self, in_features, normalization, zero_centered_gamma, dtype, device)
        self.weight = make_weight((out_features, in_features), init_method, dtype, device)
        register_bias(self, "bias", out_features, bias, dtype, device)
        self._init_fp8_scaling("gemm")

    def forward(self, x: Tensor, is_first_microbatch: bool | None = None, *, return_bias: bool | None = None,
                return_input_branch: bool = False):
        check_input("LayerNormLinear", x, self.in_features)
        return_bias = self.return_bias if return_bias is None else return_bias
        dtype = compute_dtype(self.weight, x)
        ln_out = apply_norm(self, x.to(dtype), dtype, return_input_branch)
        ln_out, x_branch = ln_out if return_input_branch else (ln_out, None)
        bias = self.bias.to(dtype) if self.bias is not None else None
        out = fp8_linear(ln_out, self.weight.to(dtype), None if return_bias else bias, self.fp8_scaling["gemm"],
                         is_first_microbatch=is_first_microbatch)
        result = te_outputs(out, bias, ln_out, return_bias, self.return_layernorm_output)
        if not return_input_branch:
            return result
        return (*(result if isinstance(result, tuple) else (result,)), x_branch)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"normalization={self.normalization}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}")


__all__ = ["LayerNormLinear"]
