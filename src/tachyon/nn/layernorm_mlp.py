"""``LayerNormMLP``: norm -> fc1 -> bias + activation -> fc2, Transformer Engine style.

    mlp = tachyon.nn.LayerNormMLP(1024, 4096, activation="gelu")
    y = mlp(x)                                   # x [..., 1024] -> y [..., 1024]

Activations (Transformer Engine's names and definitions):

    "gelu"    the tanh approximation 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3))), as TE's gelu
              (and GPT-2's); not torch's default erf GELU
    "relu", "silu", "qgelu" (h * sigmoid(1.702 h))
    "geglu"   gelu_tanh(a) * b,  "swiglu"  silu(a) * b,  with [a, b] = (fc1 out + fc1_bias).chunk(2, -1):
              fc1 then has 2 * ffn_hidden_size outputs (the gate half first)

Outside FP8 the block is one op, tachyon.kernels.linear.mlp: fc1's GEMM adds the bias and applies
the activation in its epilogue (writing the pre-activation for backward and the activation for
fc2), and in backward fc2's dX GEMM applies the activation's derivative in its epilogue. Inside
fp8_autocast the two GEMMs go through :func:`tachyon.fp8.fp8_linear` (FP8, each with its own
scaling state "fc1" and "fc2") around the fused bias + activation kernel
(tachyon.kernels.activation.bias_act). Parameters (TE's names): layer_norm_weight, layer_norm_bias,
fc1_weight [ffn (x2 gated), hidden], fc1_bias, fc2_weight [hidden, ffn], fc2_bias.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tachyon.fp8.linear import FP8ModuleMixin, fp8_linear, runs_high_precision
from tachyon.kernels.activation import ACTIVATIONS as KERNEL_ACTIVATIONS
from tachyon.kernels.activation import bias_act
from tachyon.kernels.linear import mlp
from tachyon.nn.layernorm_linear import apply_norm, check_normalization, make_norm_params
from tachyon.nn.linear import check_features, check_input, compute_dtype, make_weight, register_bias, te_outputs

# TE activation name -> the fused kernel's activation name
_KERNEL_NAME = {"gelu": "gelu_tanh", "relu": "relu", "silu": "silu", "qgelu": "qgelu", "swiglu": "swiglu"}
if "geglu_tanh" in KERNEL_ACTIVATIONS:
    _KERNEL_NAME["geglu"] = "geglu_tanh"
ACTIVATIONS = ("gelu", "geglu", "swiglu", "relu", "silu", "qgelu")
GATED = ("geglu", "swiglu")


def te_activation(h: Tensor, bias: Tensor | None, activation: str, backend: str | None) -> Tensor:
    """bias + TE's ``activation`` on fc1's output h [..., K] -> [..., K] or [..., K/2] (gated)."""
    name = _KERNEL_NAME.get(activation)
    if name is not None:
        return bias_act(h, bias, name, backend=backend)
    # "geglu" with TE's tanh GELU while the fused kernel offers only the erf one: the gate half
    # still goes through the fused bias + gelu_tanh kernel; the value half's bias and the product
    # are two more elementwise passes.
    f = h.shape[-1] // 2
    gate, value = h[..., :f], h[..., f:]
    bias_gate, bias_value = (bias[:f], bias[f:]) if bias is not None else (None, None)
    act = bias_act(gate, bias_gate, "gelu_tanh", backend=backend)
    return act * (value + bias_value if bias_value is not None else value)


def ffn(module: LayerNormMLP, ln_out: Tensor, dtype: torch.dtype, fc1_bias: Tensor | None, fc2_bias: Tensor | None,
        is_first_microbatch: bool | None) -> Tensor:
    """fc2(act(fc1(ln_out) + fc1_bias)) + fc2_bias with ``module``'s weights in ``dtype``.

    Outside FP8: one op, kernels/linear's ``mlp`` (the bias + activation in fc1's GEMM epilogue
    and the activation's backward in the epilogue of fc2's dX GEMM). In FP8 (or for a module whose
    GEMMs ran in FP8): the two fp8_linear GEMMs around the fused bias + activation kernel."""
    name = _KERNEL_NAME.get(module.activation)
    fc1_weight, fc2_weight = module.fc1_weight.to(dtype), module.fc2_weight.to(dtype)
    if name is not None and runs_high_precision(module.fp8_scaling["fc1"], module.fp8_scaling["fc2"]):
        return mlp(ln_out, fc1_weight, fc1_bias, name, fc2_weight, fc2_bias, backend=module.backend)
    h = fp8_linear(ln_out, fc1_weight, None, module.fp8_scaling["fc1"], is_first_microbatch=is_first_microbatch)
    a = te_activation(h, fc1_bias, module.activation, module.backend)
    return fp8_linear(a, fc2_weight, fc2_bias, module.fp8_scaling["fc2"], is_first_microbatch=is_first_microbatch)


class LayerNormMLP(FP8ModuleMixin, nn.Module):
    """y = fc2(act(fc1(norm(x)) + fc1_bias)) + fc2_bias, GEMMs in FP8 inside fp8_autocast.

    hidden_size, ffn_hidden_size: sizes. eps, normalization ("LayerNorm" / "RMSNorm"),
    zero_centered_gamma: the norm (as in LayerNormLinear). bias: fc1/fc2 biases. activation: one
    of "gelu" (tanh approximation, as TE), "geglu", "swiglu", "relu", "silu", "qgelu".
    return_layernorm_output: also return the norm's output. init_method: callable for fc1_weight;
    output_layer_init_method: for fc2_weight (both default to torch.nn.Linear's kaiming uniform;
    biases start at zero). params_dtype, device: of the parameters. return_bias: return fc2_bias
    instead of adding it. backend: pins the norm and activation kernels' backend.

    forward(x, is_first_microbatch=None, *, input_is_normalized=False): x [..., hidden] -> y
    [..., hidden] in the params dtype (or torch.autocast's); returns y, (y, fc2_bias), (y, ln_out)
    or (y, fc2_bias, ln_out). ``input_is_normalized``: x is already this module's norm output
    (the caller computed it with the module's norm parameters, fused with an op before it), so
    the norm is skipped and ln_out is x.
    is_first_microbatch: the FP8 weight cache of fc1 and fc2 across gradient-accumulation
    micro-batches, as in :class:`tachyon.nn.Linear`. Saved for backward: the norm's
    input and statistics, ln_out (or its FP8 copy), the pre-activation (fc1's output + fc1_bias;
    in FP8 fc1's output) and the activation's output as fc2's input (or its FP8 copy).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        return_layernorm_output: bool = False,
        init_method: Callable[[Tensor], None] | None = None,
        output_layer_init_method: Callable[[Tensor], None] | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        zero_centered_gamma: bool = False,
        return_bias: bool = False,
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        check_features("LayerNormMLP", hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        check_normalization("LayerNormMLP", normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation={activation!r} is not supported; allowed: {', '.join(map(repr, ACTIVATIONS))}")
        if not eps >= 0:
            raise ValueError(f"LayerNormMLP: eps must be >= 0; got {eps}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.activation, self.use_bias = activation, bias
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.backend = backend
        dtype = params_dtype or torch.get_default_dtype()
        fc1_out = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        make_norm_params(self, hidden_size, normalization, zero_centered_gamma, dtype, device)
        self.fc1_weight = make_weight((fc1_out, hidden_size), init_method, dtype, device)
        self.fc2_weight = make_weight((hidden_size, ffn_hidden_size), output_layer_init_method, dtype, device)
        register_bias(self, "fc1_bias", fc1_out, bias, dtype, device)
        register_bias(self, "fc2_bias", hidden_size, bias, dtype, device)
        self._init_fp8_scaling("fc1", "fc2")

    def forward(self, x: Tensor, is_first_microbatch: bool | None = None, *, input_is_normalized: bool = False):
        check_input("LayerNormMLP", x, self.hidden_size)
        dtype = compute_dtype(self.fc1_weight, x)
        # input_is_normalized: the caller ran this module's norm itself (fused with the residual
        # add before it, e.g. bias_dropout_add_layer_norm in TransformerLayer)
        ln_out = x.to(dtype) if input_is_normalized else apply_norm(self, x.to(dtype), dtype)
        fc1_bias = self.fc1_bias.to(dtype) if self.fc1_bias is not None else None
        fc2_bias = self.fc2_bias.to(dtype) if self.fc2_bias is not None else None
        y = ffn(self, ln_out, dtype, fc1_bias, None if self.return_bias else fc2_bias, is_first_microbatch)
        return te_outputs(y, fc2_bias, ln_out, self.return_bias, self.return_layernorm_output)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}, bias={self.use_bias}")


__all__ = ["ACTIVATIONS", "LayerNormMLP"]
