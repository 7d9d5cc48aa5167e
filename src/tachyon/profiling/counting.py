"""How many FLOPs and MACs one dispatched op costs, and the dispatch mode that counts them.

`CountingMode` is a ``TorchDispatchMode``: it sees every ATen op and every tachyon custom op
(``torch.ops.tachyon.*``; the ops' eager fast path steps aside while a dispatch mode is active,
see tachyon/kernels/registry.py) and asks `count_op` what each one cost. Counts depend on
shapes and flags only, never on data.

The rules (docs/flops_profiler.md has the table with examples):

- GEMMs (mm, addmm, bmm, baddbmm, _scaled_mm, convolutions; linear, matmul and einsum lower to
  them): ``torch.utils.flop_counter``'s formulas, 2*M*N*K FLOPs and M*N*K MACs. A bias added
  inside the GEMM (addmm) is not counted, as in torch's counter and DeepSpeed's.
- Attention, on every backend (the CPU flash kernel torch's counter misses, CUDA flash /
  efficient / cuDNN, tachyon's ``attention_fwd`` / ``attention_bwd``): forward
  ``2 * batch * heads * pairs * (d_qk + d_v)`` FLOPs (the QK^T and PV GEMMs), backward
  ``2 * batch * heads * pairs * (3 * d_qk + 2 * d_v)`` (score recompute, dP, dV, dQ, dK: torch's
  convention); MACs half of that. ``pairs`` is seq_q * seq_k, or with a causal flag only the
  (query, key) pairs the mask lets through: top-left aligned for torch's SDPA (query i sees keys
  j <= i), bottom-right for tachyon's op (j <= i + seq_k - seq_q), so seq * (seq + 1) / 2 when
  the lengths are equal. A mask passed as a tensor is counted dense (counts never read data).
  The softmax inside a fused attention kernel is not counted (DeepSpeed's and torch's rule).
- Non-GEMM ops count FLOPs only (0 MACs), per element of their output (DeepSpeed's per-element
  rules where it has one): elementwise arithmetic (add, mul, div, exp, rsqrt, ...) and
  activations (gelu, relu, silu, tanh, ...) 1; addcmul / addcdiv / lerp 2; softmax 1 (log_softmax
  and the losses built on it, cross entropy and NLL, count 0 in the forward, as DeepSpeed counts
  them: a model that returns its loss profiles to DeepSpeed's numbers); dropout 1
  (the scaling multiply); LayerNorm / GroupNorm / BatchNorm 5 with an affine weight, 4 without;
  RMSNorm 4 with a weight, 3 without; sum / mean 1 per input element, var / std 3.
  The backward kernel of a norm, softmax, activation or dropout counts twice its forward.
  Copies, casts, views, comparisons, indexing, embedding lookups and random draws count 0.
- Composite ops are counted by what they run: CPU ``rms_norm`` runs pow, mean, add, rsqrt and
  two multiplies, so it counts 4 per element plus 2 per row.
- tachyon's custom ops count what their reference implementation computes (`_tachyon_count`),
  composed from the rules above (e.g. ``bias_act_linear_fwd`` = bias add + activation + GEMM;
  ``gemm_bias_act`` = GEMM + bias add + activation; ``int8_linear`` = the GEMM of its shapes).

Ops not in any table count 0. torch's counter handles higher-order ops and nested tensors that
this one does not try to (eager training and inference only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

Count = tuple[int, int]
"""(FLOPs, MACs)."""


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    out = {}
    for index, arg in enumerate(func._schema.arguments):
        if index < len(args):
            out[arg.name] = args[index]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


# ------------------------------------------------------------------------------ attention
def _clamped_sum(first: int, n: int, high: int) -> int:
    """sum over i in [0, n) of clamp(first + i, 0, high)."""
    lo = min(max(0, 1 - first), n)  # first index with a positive value
    hi = min(max(lo, high - first), n)  # first index at or above ``high``
    ramp = (hi - lo) * (first + lo + first + hi - 1) // 2
    return ramp + (n - hi) * high


def attention_pairs(seq_q: int, seq_k: int, causal: bool, bottom_right: bool = False) -> int:
    """(query, key) pairs attention computes: all of them, or those a causal mask lets through."""
    if not causal:
        return seq_q * seq_k
    first = 1 + (seq_k - seq_q if bottom_right else 0)
    return _clamped_sum(first, seq_q, seq_k)


def attention_count(q_shape, k_shape, v_shape, causal: bool, *, backward: bool = False,
                    bottom_right: bool = False) -> Count:
    """q [b, h, sq, d_qk], k [b, hk, sk, d_qk], v [b, hk, sk, d_v] (GQA: hk divides h)."""
    batch, heads, seq_q, d_qk = (int(s) for s in q_shape)
    seq_k, d_v = int(k_shape[-2]), int(v_shape[-1])
    pairs = attention_pairs(seq_q, seq_k, causal, bottom_right)
    per_pair = 3 * d_qk + 2 * d_v if backward else d_qk + d_v
    macs = batch * heads * pairs * per_pair
    return 2 * macs, macs


def _sdpa(backward: bool) -> Callable[..., Count]:
    def count(func, args, kwargs, out) -> Count:
        a = bind(func, args, kwargs)
        return attention_count(a["query"].shape, a["key"].shape, a["value"].shape, bool(a.get("is_causal", False)),
                               backward=backward)

    return count


# ------------------------------------------------------------------------------ per-element rules
def _per_output(factor: int) -> Callable[..., Count]:
    def count(func, args, kwargs, out) -> Count:
        return factor * _numel(_first_tensor(out)), 0

    return count


def _per_input(factor: int) -> Callable[..., Count]:
    def count(func, args, kwargs, out) -> Count:
        return factor * _numel(_first_tensor(args)), 0

    return count


def _norm(weight_arg: str, backward: bool, with_weight: int = 5, without: int = 4) -> Callable[..., Count]:
    """Normalization ops: per element of the (first) input tensor."""

    def count(func, args, kwargs, out) -> Count:
        a = bind(func, args, kwargs)
        x = a.get("input", _first_tensor(args))
        if backward and "grad_out" in a:
            x = a["grad_out"]
        per = with_weight if a.get(weight_arg) is not None else without
        return (2 if backward else 1) * per * _numel(x), 0

    return count


_ELEMENTWISE = (
    "add", "sub", "mul", "div", "rsub", "neg", "reciprocal", "pow", "exp", "exp2", "expm1", "log", "log2",
    "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "erf", "erfc", "erfinv", "abs", "fmod", "remainder",
    "atan2", "hypot", "xlogy", "square",
)
_TWO_OPS = ("addcmul", "addcdiv", "lerp")
_ACTIVATIONS = (
    "relu", "gelu", "silu", "sigmoid", "tanh", "elu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "mish",
    "softplus", "celu", "selu", "relu6", "log_sigmoid_forward",
)
_ACTIVATION_BACKWARDS = (
    "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "threshold_backward", "elu_backward",
    "leaky_relu_backward", "hardtanh_backward", "hardswish_backward", "hardsigmoid_backward", "mish_backward",
    "softplus_backward", "log_sigmoid_backward",
)


def _aten_table() -> dict[Any, Callable[..., Count]]:
    table: dict[Any, Callable[..., Count]] = {}

    def put(names, formula) -> None:
        for name in names:
            packet = getattr(aten, name, None)
            if packet is not None:
                table[packet] = formula

    put(_ELEMENTWISE + tuple(f"{n}_" for n in _ELEMENTWISE), _per_output(1))
    put(_TWO_OPS + tuple(f"{n}_" for n in _TWO_OPS), _per_output(2))
    put(_ACTIVATIONS + tuple(f"{n}_" for n in _ACTIVATIONS), _per_output(1))
    put(_ACTIVATION_BACKWARDS, _per_output(2))
    put(("glu",), _per_output(2))
    put(("glu_backward",), _per_output(4))
    put(("_softmax", "_safe_softmax"), _per_output(1))  # not _log_softmax: see the module docstring
    put(("_softmax_backward_data", "_log_softmax_backward_data"), _per_output(2))
    put(("native_dropout",), _per_output(1))
    put(("native_dropout_backward",), _per_output(2))
    put(("sum", "mean", "nansum", "nanmean"), _per_input(1))
    put(("var", "std", "var_mean", "std_mean"), _per_input(3))
    put(("embedding_dense_backward",), _per_input(1))
    put(("native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
         "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "_batch_norm_no_update"),
        _norm("weight", False))
    put(("native_layer_norm_backward", "native_group_norm_backward", "native_batch_norm_backward",
         "batch_norm_backward"), _norm("weight", True))
    put(("_fused_rms_norm",), _norm("weight", False, 4, 3))
    put(("_fused_rms_norm_backward",), _norm("weight", True, 4, 3))
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"):
        put((name,), _sdpa(False))
        put((f"{name}_backward",), _sdpa(True))
    return table


_ATEN = _aten_table()
_TORCH = {packet: formula for packet, formula in flop_registry.items() if packet not in _ATEN}
"""torch.utils.flop_counter's formulas (GEMMs, convolutions, fused attention internals) for what
the table above does not override; they take shapes and return FLOPs."""
_GEMM_LIKE = frozenset(
    getattr(aten, n) for n in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution",
                               "cudnn_convolution", "cudnn_convolution_transpose", "convolution_backward",
                               "_flash_attention_forward", "_flash_attention_backward",
                               "_efficient_attention_forward", "_efficient_attention_backward")
    if hasattr(aten, n)
)


# ------------------------------------------------------------------------------ tachyon ops
def _gated(activation: str) -> bool:
    return activation in ("swiglu", "geglu", "geglu_tanh")


def _bias_act(x: torch.Tensor, bias: Any, activation: str) -> int:
    """x [M, K] -> act [M, F] (F = K / 2 gated): bias add + activation (+ the gate multiply)."""
    out = x.numel() // 2 if _gated(activation) else x.numel()
    return (x.numel() if bias is not None else 0) + out * (2 if _gated(activation) else 1)


def _gemm_act(rows: int, k: int, n: int, bias: bool, activation: str | None) -> Count:
    """A GEMM [rows, k] x [k, n] with bias + activation in its epilogue (n: the GEMM's columns,
    2F for a gated activation, whose F outputs cost 2 each: the activation and the product, so
    rows * n either way)."""
    macs = rows * k * n
    return 2 * macs + (rows * n if bias else 0) + (rows * n if activation else 0), macs


def _norm_count(x: torch.Tensor, rms: bool) -> int:
    return (4 if rms else 5) * x.numel()  # tachyon's norms always have a weight


def _bda(x: torch.Tensor, bias: Any, residual: Any, p: float) -> int:
    n = x.numel()
    return (n if bias is not None else 0) + (n if p > 0 else 0) + (n if residual is not None else 0)


def _tachyon_count(name: str, a: dict[str, Any], out: Any) -> Count | None:
    """tachyon::<name> (arguments bound by name); None for ops that compute no model math."""
    if name == "attention_fwd":
        return attention_count(a["q"].shape, a["k"].shape, a["v"].shape, a["causal"], bottom_right=True)
    if name == "attention_bwd":
        return attention_count(a["q"].shape, a["k"].shape, a["v"].shape, a["causal"], backward=True,
                               bottom_right=True)
    if name in ("attention_packed_fwd", "attention_packed_bwd"):  # qkv [b, s, (h + 2 kvh) d] (sbhd: [s, b, ...])
        qkv, heads, kv_heads = a["qkv"], a["heads"], a["kv_heads"]
        d = qkv.shape[-1] // (heads + 2 * kv_heads)
        batch, seq = (qkv.shape[1], qkv.shape[0]) if a["sbhd"] else (qkv.shape[0], qkv.shape[1])
        kv = (batch, kv_heads, seq, d)
        flops, macs = attention_count((batch, heads, seq, d), kv, kv, a["causal"], backward=name.endswith("bwd"),
                                      bottom_right=True)
        if a.get("rope_cos") is not None:  # RoPE applied inside the op: x * cos + rot(x) * sin on q and k
            flops += 3 * batch * seq * (heads + kv_heads) * a["rope_cos"].shape[-1]
        return flops, macs
    if name == "norm_fwd":
        return (a["x"].numel() if a["residual"] is not None else 0) + _norm_count(a["x"], a["is_rms"]), 0
    if name == "norm_bwd":
        return 2 * _norm_count(a["dy"], a["is_rms"]), 0
    if name == "bias_act_fwd":
        return _bias_act(a["x"], a["bias"], a["activation"]), 0
    if name == "bias_act_bwd":
        return 2 * _bias_act(a["x"], a["bias"], a["activation"]), 0
    if name == "bias_act_linear_fwd":
        x, w2 = a["x"], a["weight2"]
        rows, hidden = x.numel() // x.shape[-1], w2.shape[1]
        macs = rows * hidden * w2.shape[0]
        return _bias_act(x, a["bias"], a["activation"]) + 2 * macs, macs
    if name == "gemm_bias_act":  # x [M, K] @ weight [R, K]^T + bias, then the activation
        x, w = a["x"], a["weight"]
        return _gemm_act(x.shape[0], x.shape[1], w.shape[0], a["bias"] is not None, a["activation"])
    if name == "gemm_act_grad":  # dout [M, O] @ weight2 [O, F], then the activation's backward on pre
        dout, w2 = a["dout"], a["weight2"]
        macs = dout.shape[0] * dout.shape[1] * w2.shape[1]
        return 2 * macs + 2 * _bias_act(a["pre"], a["pre"][0] if a["want_dbias"] else None, a["activation"]), macs
    if name in ("int8_linear", "norm_int8_linear"):  # the dequantizing GEMM (+ norm prologue, epilogue)
        x, q = a["x"], a["qweight"]
        flops, macs = _gemm_act(x.shape[0], x.shape[1], q.shape[0], a["bias"] is not None, a["activation"])
        if name == "norm_int8_linear":
            flops += _norm_count(x, a["rms"]) + (x.numel() if a["residual"] is not None else 0)
        return flops, macs
    if name == "bias_dropout_add_fwd":
        return _bda(a["x"], a["bias"], a["residual"], a["p"]), 0
    if name == "dropout_bwd":
        n = a["dout"].numel()
        return 2 * n + (n if a["want_dbias"] else 0), 0
    if name == "bias_dropout_add_norm_fwd":
        return _bda(a["x"], a["bias"], a["residual"], a["p"]) + _norm_count(a["x"], a["rms"]), 0
    if name == "bias_dropout_add_norm_bwd":
        n = a["dy"].numel()
        return 2 * _norm_count(a["dy"], a["rms"]) + (2 * n if a["p"] > 0 else 0) + (n if a["want_dbias"] else 0), 0
    if name == "rotary":
        rotated = a["cos"].shape[-1]
        rows = a["q"].numel() // a["q"].shape[-1] + a["k"].numel() // a["k"].shape[-1]
        return 3 * rows * rotated, 0  # x * cos + rot(x) * sin
    if name == "fp8_cast":
        n = a["x"].numel()
        return n + (n if a["amax"] is not None else 0), 0  # scale multiply (+ |x| max)
    return None


def count_op(func: Any, args: tuple, kwargs: dict, out: Any) -> Count:
    """(FLOPs, MACs) of one call of ``func`` (an OpOverload) that returned ``out``."""
    packet = func._overloadpacket
    formula = _ATEN.get(packet)
    if formula is not None:
        return formula(func, args, kwargs, out)
    formula = _TORCH.get(packet)
    if formula is not None:
        flops = int(formula(*args, **kwargs, out_val=out))
        return flops, flops // 2 if packet in _GEMM_LIKE else 0
    namespace, _, name = packet._qualified_op_name.partition("::")
    if namespace == "tachyon":
        counted = _tachyon_count(name, bind(func, args, kwargs), out)
        if counted is not None:
            return int(counted[0]), int(counted[1])
    return 0, 0


def has_formula(func: Any) -> bool:
    packet = func._overloadpacket
    return packet in _ATEN or packet in _TORCH or packet._qualified_op_name.startswith("tachyon::")


def op_name(func: Any) -> str:
    """``aten.mm``, ``tachyon.attention_fwd``: the op without its overload."""
    return func._overloadpacket._qualified_op_name.replace("::", ".")


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass."""
    return torch._C._current_graph_task_id() != -1


def in_graph_node() -> bool:
    """True inside a backward node's computation (as opposed to a gradient hook: ZeRO's
    post-accumulate-grad hooks run under AccumulateGrad and must not count as model work)."""
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ != "AccumulateGrad"


class CountingMode(TorchDispatchMode):
    """Calls ``record(op_name, flops, macs, backward)`` for every op that costs something.

    Args:
        record: the callback.
        count_backward: also count ops run by autograd's backward (gradient formulas and
            activation-checkpoint recomputation; not gradient hooks).
    """

    def __init__(self, record: Callable[[str, int, int, bool], None], count_backward: bool = False):
        super().__init__()
        self.record, self.count_backward = record, count_backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not has_formula(func):
            # CompositeImplicit ops that reach the mode (inference mode) are counted by their parts
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        backward = in_backward()
        if backward and not (self.count_backward and in_graph_node()):
            return out
        flops, macs = count_op(func, args, kwargs, out)
        if flops or macs:
            self.record(op_name(func), flops, macs, backward)
        return out


__all__ = ["CountingMode", "attention_count", "attention_pairs", "bind", "count_op", "in_backward"]
