"""``Linear``: a Transformer-Engine-style linear layer whose GEMM runs in FP8 inside fp8_autocast.

    layer = tachyon.nn.Linear(1024, 4096, bias=True, params_dtype=torch.bfloat16, device="cuda")
    y = layer(x)                                   # x [..., 1024] -> y [..., 4096]
    with tachyon.fp8_autocast():
        y = layer(x)                               # same, GEMM in FP8 (delayed scaling)

Parameters ``weight`` [out_features, in_features] and ``bias`` [out_features] (TE's and
torch.nn.Linear's names, so state_dicts load both ways; the FP8 scaling state is an extra
``_extra_state`` entry). Initialization: ``init_method(weight)``, by default torch.nn.Linear's
(kaiming uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))); the bias starts at zero, as
in Transformer Engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from tachyon.fp8.linear import FP8ModuleMixin, fp8_linear


def default_init(weight: Tensor) -> None:
    """torch.nn.Linear's weight init: kaiming uniform, a = sqrt(5) (bound 1/sqrt(fan_in))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def check_features(module: str, **sizes: int) -> None:
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{module}: {name} must be a positive int; got {size!r}")


def make_weight(shape: tuple[int, ...], init_method: Callable[[Tensor], None] | None, dtype, device) -> nn.Parameter:
    """A new parameter of ``shape`` initialized by ``init_method`` (default :func:`default_init`)."""
    if init_method is not None and not callable(init_method):
        raise ValueError(f"init_method must be a callable(weight) or None; got {init_method!r}")
    weight = torch.empty(shape, dtype=dtype, device=device)
    with torch.no_grad():
        (init_method or default_init)(weight)
    return nn.Parameter(weight)


def register_bias(module: nn.Module, name: str, size: int, bias: bool, dtype, device) -> None:
    """Registers the zero-initialized bias parameter ``name`` [size], or None when not ``bias``."""
    module.register_parameter(name, nn.Parameter(torch.zeros(size, dtype=dtype, device=device)) if bias else None)


def te_outputs(out: Tensor, bias: Tensor | None, ln_out: Tensor | None, return_bias: bool,
               return_layernorm_output: bool):
    """Transformer Engine's return convention: out, then bias (``return_bias``), then the norm's
    output (``return_layernorm_output``); out alone is returned bare, not as a 1-tuple."""
    result = (out, *((bias,) if return_bias else ()), *((ln_out,) if return_layernorm_output else ()))
    return result if len(result) > 1 else out


def compute_dtype(param: Tensor, x: Tensor) -> torch.dtype:
    """The GEMMs' dtype: torch.autocast's when it is on for x's device, else the params'."""
    device_type = x.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return param.dtype


def check_input(module: str, x: Tensor, features: int) -> None:
    if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != features:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{module}: input has shape {shape}; its last dim must be in_features={features}")
    if not x.is_floating_point():
        raise ValueError(f"{module}: input has dtype {x.dtype}; expected a floating-point tensor")


class Linear(FP8ModuleMixin, nn.Module):
    """y = x @ weight.T + bias, with the GEMM in FP8 inside ``tachyon.fp8_autocast``.

    in_features, out_features: sizes (multiples of 16 to run in FP8). bias: learn an additive
    bias. init_method: callable(weight) that initializes ``weight`` in place. params_dtype:
    parameter dtype (default torch.get_default_dtype()). device: where parameters live.
    return_bias: forward returns (y without bias, bias) so the caller can fuse the add (bias is
    None when ``bias=False``).

    forward(x, is_first_microbatch=None, *, return_bias=None): x [..., in_features] (cast to the
    params dtype, or torch.autocast's dtype) -> y [..., out_features] in that dtype
    (``return_bias`` overrides the module's setting for one call). is_first_microbatch (TE's
    FP8 weight cache for gradient accumulation; no effect outside an enabled fp8_autocast): None
    casts the weight to FP8 on every call; True casts it and caches the FP8 weight on the module;
    False reuses that cache (no weight cast, no weight amax recorded). Saved for backward: x and
    weight (outside FP8), or their FP8 copies and scale_inv values (inside fp8_autocast).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: Callable[[Tensor], None] | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
    ) -> None:
        super().__init__()
        check_features("Linear", in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = make_weight((out_features, in_features), init_method, dtype, device)
        register_bias(self, "bias", out_features, bias, dtype, device)
        self._init_fp8_scaling("gemm")

    def forward(self, x: Tensor, is_first_microbatch: bool | None = None, *, return_bias: bool | None = None):
        check_input("Linear", x, self.in_features)
        return_bias = self.return_bias if return_bias is None else return_bias
        dtype = compute_dtype(self.weight, x)
        weight = self.weight.to(dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        y = fp8_linear(x.to(dtype), weight, None if return_bias else bias, self.fp8_scaling["gemm"],
                       is_first_microbatch=is_first_microbatch)
        return te_outputs(y, bias, None, return_bias, False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}"


__all__ = ["Linear"]
