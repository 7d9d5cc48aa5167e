"""The fewest bytes and launches a unit of work needs, computed from its shapes.

A measured count (traffic.py) means little alone; beside the anchor it says who wins, beside this
minimum it says how much is left to win. The minimum of a unit is the ideal program for the same
math with the same GEMMs:

- every GEMM is one call that reads its two operands (and bias, or the matrix it accumulates
  into) once and writes its result once; nothing fuses across a GEMM but an MLP's activation:
  its bias + activation run in the epilogue of the GEMM before it (which writes the
  pre-activation, kept for backward, and the activation), and its backward in the epilogue of the
  dX GEMM that makes the activation's gradient (which reads the pre-activation and writes its
  gradient and the bias gradient);
- attention is one flash kernel forward (reads q, k, v, writes the context and the fp32
  logsumexp) and one backward (reads q, k, v, the context, its gradient and the logsumexp; writes
  dq, dk, dv and the qkv bias gradient as column sums);
- everything between two GEMMs is ONE pass that reads each of its inputs once and writes each of
  its outputs once: the forward's outputs include what the unit keeps for backward (the memory
  flags change that: written once in forward, read once in backward), a backward pass sums the
  gradient parts of a tensor used twice (a residual) as it reads them, and weight and bias
  gradients are written once;
- a memory flag that drops a tensor from what is kept pays for its recomputation in backward.

Bytes: tensors in the unit's dtype, fp32 normalization statistics (mean and rstd per row; rstd
only for RMSNorm or the invertible form), fp32 logsumexp; optimizer states fp32. Dropout masks
are regenerated from a seed, never stored; the seed is a kernel argument (no launch: tachyon's
BERT layer spends one launch on its on-device seed counter, which the count shows beside this).

Each unit is a list of steps (:class:`Step`), so a result can be compared step by step.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Step:
    """One pass of the ideal program: bytes it must read and write, and its launches."""

    name: str
    read: int
    written: int
    launches: int = 1


@dataclasses.dataclass(frozen=True)
class Minimum:
    unit: str
    steps: tuple[Step, ...]

    @property
    def bytes(self) -> int:
        return sum(s.read + s.written for s in self.steps)

    @property
    def launches(self) -> int:
        return sum(s.launches for s in self.steps)

    def table(self, unit: float = float(1 << 20), unit_name: str = "MiB") -> str:
        width = max(len(s.name) for s in self.steps)
        lines = [f"{'step':<{width}}  {'read':>9}  {'written':>9}  launches   ({unit_name})"]
        for s in self.steps + (Step("total", sum(s.read for s in self.steps),
                                    sum(s.written for s in self.steps), self.launches),):
            lines.append(f"{s.name:<{width}}  {s.read / unit:>9.3f}  {s.written / unit:>9.3f}  {s.launches:>8d}")
        return "\n".join(lines)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_positive(unit: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{unit}: {name} must be an int >= 1; got {value!r}")


class _Program:
    """Builds the step list: sizes in elements, bytes computed with the unit's element size."""

    def __init__(self, e: int) -> None:
        self.e, self.steps = e, []

    def step(self, name: str, read: int, written: int, *, read_fp32: int = 0, written_fp32: int = 0) -> None:
        self.steps.append(Step(name, read * self.e + 4 * read_fp32, written * self.e + 4 * written_fp32))

    def gemm(self, name: str, m: int, k: int, n: int, *, bias: bool = False, accumulate: bool = False) -> None:
        """C [m, n] = A [m, k] @ B [k, n] (+ bias [n]) (+ C: accumulate)."""
        self.step(name, m * k + k * n + (n if bias else 0) + (m * n if accumulate else 0), m * n)

    def linear(self, name: str, t: int, k: int, n: int, *, bias: bool, backward: bool, dx_accumulate: bool = False):
        """Forward y [t, n] = x [t, k] W^T (+ b); backward dX (accumulated into a residual's gradient
        when ``dx_accumulate``) and dW (the bias gradient is the consumer pass's column sum)."""
        if not backward:
            self.gemm(f"{name} GEMM", t, k, n, bias=bias)
            return
        self.gemm(f"{name} dX GEMM", t, n, k, accumulate=dx_accumulate)
        self.gemm(f"{name} dW GEMM", n, t, k)


def _attention_steps(prog: _Program, t: int, heads: int, kv_heads: int, d: int, *, bias: bool, backward: bool,
                     tag: str = "attention") -> None:
    qkv = t * (heads + 2 * kv_heads) * d
    ctx = t * heads * d
    lse = t * heads
    if not backward:
        prog.step(f"{tag} forward", qkv, ctx, written_fp32=lse)
        return
    prog.step(f"{tag} backward", qkv + 2 * ctx, qkv + (qkv // t if bias else 0), read_fp32=lse)


def bert_layer_minimum(
    batch: int, seq: int, hidden: int, intermediate: int, heads: int, dtype: torch.dtype = torch.float32, *,
    pre_layer_norm: bool = False, normalize_invertible: bool = False, gelu_checkpoint: bool = False,
    attn_dropout_checkpoint: bool = False, dropout: bool = True, backward: bool = True,
) -> Minimum:
    """One BERT encoder layer (DeepSpeed's transformer kernel / HF BertLayer), forward (+ backward).

    Post-LN (HF BertLayer): y1 = LN(x + dropout(attn(x) Wo + bo)); out = LN(y1 + dropout(gelu(y1 Wi
    + bi) Wout + bout)). Pre-LN: DeepSpeed's pre-LN layer (see TransformerKernelLayer). Flags as
    DeepSpeed's: normalize_invertible keeps each LayerNorm's output instead of its input (the
    pre-norm sums z are then not written), gelu_checkpoint drops the GELU output (recomputed from the
    pre-activation before the output GEMM's weight gradient), attn_dropout_checkpoint drops what
    attention keeps (the QKV GEMM and the attention forward run again in backward). ``dropout``:
    hidden and attention dropout active (a pass after dropout writes the masked gradient and the
    residual's gradient separately)."""
    unit = "bert_layer_minimum"
    _check_positive(unit, batch=batch, seq=seq, hidden=hidden, intermediate=intermediate, heads=heads)
    if hidden % heads:
        raise ValueError(f"{unit}: hidden={hidden} is not a multiple of heads={heads}")
    t, h, i, e = batch * seq, hidden, intermediate, _size(dtype)
    th, ti, d = t * h, t * i, hidden // heads
    stats = t if normalize_invertible else 2 * t  # fp32 per row kept for backward
    keep_z = not normalize_invertible  # LayerNorm backward from its input z, or from its output
    p = _Program(e)
    # --- forward ---
    if pre_layer_norm:
        p.step("LN_in", th + 2 * h, th, written_fp32=stats)
    p.linear("QKV", t, h, 3 * h, bias=True, backward=False)
    _attention_steps(p, t, heads, heads, d, bias=True, backward=False)
    p.linear("attention output", t, h, h, bias=False, backward=False)
    if pre_layer_norm:  # z1 = x + dropout(a + bo) (the residual stream, kept), y1 = LN_attn(z1)
        p.step("bias+dropout+residual+LN_attn", 2 * th + 3 * h, 2 * th, written_fp32=stats)
    else:  # y1 = LN1(x + dropout(a + bo)); z1 kept unless invertible
        p.step("bias+dropout+residual+LN1", 2 * th + 3 * h, th + (th if keep_z else 0), written_fp32=stats)
    p.step("intermediate GEMM + bias + GELU", th + h * i + i, 2 * ti)  # writes pre and GELU(pre)
    p.linear("output", t, i, h, bias=False, backward=False)
    if pre_layer_norm:
        p.step("bias+dropout+residual", 2 * th + h, th)
    else:
        p.step("bias+dropout+residual+LN2", 2 * th + 3 * h, th + (th if keep_z else 0), written_fp32=stats)
    if not backward:
        return Minimum("BERT layer forward", tuple(p.steps))
    # --- backward ---
    grad_out = 2 if dropout else 1  # the masked gradient and the residual's, or one tensor
    if pre_layer_norm:  # d(out) is the residual's gradient as it is; the pass writes the masked one
        p.step("bias+dropout+residual backward", th, (th if dropout else 0) + h)
    else:
        p.step("bias+dropout+residual+LN2 backward", 2 * th + 2 * h, grad_out * th + 3 * h, read_fp32=stats)
    if gelu_checkpoint:
        p.step("GELU recompute", ti, ti)  # from the kept pre-activation
    p.step("output dX GEMM + GELU backward", th + h * i + ti, ti + i)  # reads pre; writes dpre, dbias
    p.gemm("output dW GEMM", h, t, i)
    p.linear("intermediate", t, h, i, bias=False, backward=True)
    # LN backward reads the two gradient parts of its output (GEMM dX and the residual's) and z or y
    p.step("bias+dropout+residual+LN backward", 3 * th + 2 * h, grad_out * th + 3 * h, read_fp32=stats)
    p.linear("attention output", t, h, h, bias=False, backward=True)
    if attn_dropout_checkpoint:
        p.linear("QKV recompute", t, h, 3 * h, bias=True, backward=False)
        _attention_steps(p, t, heads, heads, d, bias=True, backward=False, tag="attention recompute")
    _attention_steps(p, t, heads, heads, d, bias=True, backward=True)
    # post-LN: x's gradient = QKV dX + the residual's (accumulated by the GEMM); pre-LN: LN_in's dX
    p.linear("QKV", t, h, 3 * h, bias=True, backward=True, dx_accumulate=not pre_layer_norm)
    if pre_layer_norm:
        p.step("LN_in backward", 3 * th + 2 * h, th + 2 * h, read_fp32=stats)
    return Minimum("BERT layer forward+backward", tuple(p.steps))


def transformer_layer_minimum(
    batch: int, seq: int, hidden: int, ffn: int, heads: int, kv_heads: int | None = None,
    dtype: torch.dtype = torch.float32, *, normalization: str = "LayerNorm", gated: bool = False,
    bias: bool = True, dropout: bool = True, backward: bool = True,
) -> Minimum:
    """One pre-LN TE TransformerLayer (GPT-2: LayerNorm, GELU, biases, dropout; Llama: RMSNorm,
    SwiGLU (``gated``: fc1 writes [t, 2 ffn]), GQA, no bias, no dropout), forward (+ backward).

    x -> norm1 -> QKV -> attention (RoPE applied inside the attention kernel's loads, as the
    minimum) -> proj -> h = x + dropout(. + b) -> norm2 -> fc1 -> act -> fc2 -> out = h + dropout(. + b).
    The residual add and norm2 are one pass (it writes h and norm2's output); norms keep their input."""
    unit = "transformer_layer_minimum"
    kv = heads if kv_heads is None else kv_heads
    _check_positive(unit, batch=batch, seq=seq, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv)
    if hidden % heads or heads % kv:
        raise ValueError(f"{unit}: hidden={hidden} must be a multiple of heads={heads}, and heads a multiple of kv_heads={kv}")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"{unit}: normalization={normalization!r}; allowed: 'LayerNorm', 'RMSNorm'")
    t, h, e, d = batch * seq, hidden, _size(dtype), hidden // heads
    th, f1 = t * h, (2 * ffn if gated else ffn)
    qkv_n = (heads + 2 * kv) * d
    nparams = 1 if normalization == "RMSNorm" else 2
    stats = t if normalization == "RMSNorm" else 2 * t
    b = 1 if bias else 0
    p = _Program(e)
    p.step("norm1", th + nparams * h, th, written_fp32=stats)
    p.linear("QKV", t, h, qkv_n, bias=bias, backward=False)
    _attention_steps(p, t, heads, kv, d, bias=bias, backward=False)
    p.linear("proj", t, heads * d, h, bias=False, backward=False)
    p.step("bias+dropout+residual+norm2", 2 * th + (b + nparams) * h, 2 * th, written_fp32=stats)
    p.step("fc1 GEMM + bias + activation", th + h * f1 + b * f1, t * f1 + t * ffn)  # writes pre and act(pre)
    p.linear("fc2", t, ffn, h, bias=False, backward=False)
    p.step("bias+dropout+residual", 2 * th + b * h, th)
    if not backward:
        return Minimum("TransformerLayer forward", tuple(p.steps))
    # out's gradient is h's residual gradient as it is; with dropout the pass writes the masked one
    # (no dropout and no bias: fc2's gradient is out's, nothing to do)
    if dropout or bias:
        p.step("bias+dropout+residual backward", th, (th if dropout else 0) + b * h)
    p.step("fc2 dX GEMM + activation backward", th + h * ffn + t * f1, t * f1 + b * f1)  # reads pre
    p.gemm("fc2 dW GEMM", h, t, ffn)
    p.linear("fc1", t, h, f1, bias=False, backward=True)
    # norm2 backward: reads its output's gradient, h's residual gradient and h; writes h's total
    # gradient (also x's residual gradient) and, with dropout, the masked one for proj
    p.step("norm2+residual backward", 3 * th + nparams * h, (2 if dropout else 1) * th + (b + nparams) * h,
           read_fp32=stats)
    p.linear("proj", t, heads * d, h, bias=False, backward=True)
    _attention_steps(p, t, heads, kv, d, bias=bias, backward=True)
    p.linear("QKV", t, h, qkv_n, bias=bias, backward=True)
    p.step("norm1 backward", 3 * th + nparams * h, th + nparams * h, read_fp32=stats)
    return Minimum("TransformerLayer forward+backward", tuple(p.steps))


def adam_minimum(numels: list[int], param_dtype: torch.dtype = torch.float32,
                 grad_dtype: torch.dtype | None = None) -> Minimum:
    """One Adam/AdamW step over tensors of these sizes: read param, grad and both fp32 moments,
    write param and both moments, in one launch."""
    if not numels or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numels):
        raise ValueError(f"adam_minimum: numels must be a non-empty list of ints >= 0; got {numels!r}")
    n = sum(numels)
    pe, ge = _size(param_dtype), _size(grad_dtype or param_dtype)
    return Minimum("Adam step", (Step("adam", n * (pe + ge + 8), n * (pe + 8)),))


__all__ = ["Minimum", "Step", "adam_minimum", "bert_layer_minimum", "transformer_layer_minimum"]
