"""Ops per FP8 GEMM under each recipe, in emulation on CPU: what a GPU's host pays per GEMM.

Every op dispatched while a tachyon.nn.Linear runs its forward, and then its backward, is
counted by a TorchDispatchMode (views, which move no data and launch nothing, are left out: view,
_unsafe_view, t, transpose, select, unbind, as_strided, expand, detach, ...), on two paths:

    torch    tachyon's PyTorch path (the CPU's): every ATen op, inside tachyon's ops too
    triton   the GPU's op sequence (Triton kernels under the CPU interpreter): each tachyon op
             (the fused FP8 casts, norms, attention) counts once, as the one kernel it launches

The emulated FP8 GEMM is one matmul (where the GPU runs one torch._scaled_mm) plus the
dequantizing conversions and multiplies around it: the "emulation only" column counts those
(and the matmuls), which the native path does not run. Also a whole tachyon.nn.TransformerLayer
(4 FP8 GEMMs) forward and backward. The delayed recipe's forward count includes the scale update
at the autocast's exit.

    python benchmarks/bench_fp8_ops.py                 # both paths; prints the tables, appends CSV rows
    python benchmarks/bench_fp8_ops.py --tokens 64 --hidden 256 --path torch
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from pathlib import Path

if __name__ == "__main__" and "--path" not in sys.argv[1:] or "triton" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path runs its kernels interpreted, on CPU
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import output_dir, print_table, write_csv  # noqa: E402

aten = torch.ops.aten
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.select.int,
         aten.unbind.int, aten.as_strided.default, aten.expand.default, aten.detach.default, aten.alias.default,
         aten.slice.Tensor, aten.view_as_real.default, aten.permute.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.view.dtype}


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops by name, views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in VIEWS:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


# ops the emulation adds around its matmul that torch._scaled_mm does inside (the dequantization)
EMULATION_ONLY = ("_to_copy", "mul", "mm", "repeat_interleave", "index_select", "clone")


def recipes() -> dict:
    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    return {"bf16 (no FP8)": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling(),
            "block": Float8BlockScaling()}


def count_linear(recipe, tokens: int, hidden: int, dtype: torch.dtype) -> tuple[OpCounter, OpCounter]:
    import tachyon
    import tachyon.nn as tnn

    layer = tnn.Linear(hidden, hidden, params_dtype=dtype)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    for _ in range(2):  # warm: states prepared, scales set
        with tachyon.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
        y.float().sum().backward()
    grad = torch.ones(tokens, hidden, dtype=dtype)
    fwd, bwd = OpCounter(), OpCounter()
    with fwd, tachyon.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x)
    with bwd:
        y.backward(grad)
    return fwd, bwd


def count_layer(recipe, tokens: int, hidden: int, dtype: torch.dtype) -> tuple[OpCounter, OpCounter]:
    import tachyon
    import tachyon.nn as tnn

    layer = tnn.TransformerLayer(hidden, 4 * hidden, max(1, hidden // 64), hidden_dropout=0.0, attention_dropout=0.0,
                                 params_dtype=dtype, attn_input_format="bshd")
    x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    for _ in range(2):
        with tachyon.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
        y.float().sum().backward()
    fwd, bwd = OpCounter(), OpCounter()
    with fwd, tachyon.autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x)
    with bwd:
        y.backward(torch.ones_like(y))
    return fwd, bwd


@contextlib.contextmanager
def on_path(path: str):
    """Run tachyon's ops on ``path``: "torch" (tachyon's custom ops replaced by their PyTorch
    reference, so their ATen ops are counted) or "triton" (interpreted kernels, one op each)."""
    import tachyon
    import tachyon.kernels.fp8_block_cast.op as block_op
    from tachyon.kernels.fp8_block_cast import reference

    if path == "triton":
        with tachyon.use_backend("triton"):
            yield
        return
    real = block_op._fp8_block_cast, block_op._fp8_scale_from_amax

    def inline_cast(x, fp8_dtype, size, square, rows, cols, pow2, eps, backend):
        return reference.block_cast(x, fp8_dtype, size, square=square, rows=rows, cols=cols, power_2_scale=pow2,
                                    amax_epsilon=eps)

    def inline_scale(amax, fp8_max, pow2, eps, value_for_inf, backend):
        scale = reference.block_scale(amax, fp8_max, pow2, eps, value_for_inf)
        return scale, scale.reciprocal()

    block_op._fp8_block_cast, block_op._fp8_scale_from_amax = inline_cast, inline_scale
    try:
        with tachyon.use_backend("torch"):
            yield
    finally:
        block_op._fp8_block_cast, block_op._fp8_scale_from_amax = real


def run(tokens: int, hidden: int, dtype: torch.dtype, path: str = "torch") -> list[dict]:
    rows = []
    for name, recipe in recipes().items():
        with on_path(path):
            fwd, bwd = count_linear(recipe, tokens, hidden, dtype)
            lfwd, lbwd = count_layer(recipe, tokens, hidden, dtype)
        rows.append({
            "path": path, "recipe": name, "Linear fwd ops": fwd.total, "Linear bwd ops": bwd.total,
            "of which emulation-only (fwd/bwd)": f"{sum(fwd.ops[k] for k in EMULATION_ONLY)}/"
                                                 f"{sum(bwd.ops[k] for k in EMULATION_ONLY)}",
            "TransformerLayer fwd ops": lfwd.total, "TransformerLayer bwd ops": lbwd.total,
            "Linear fwd detail": " ".join(f"{k}:{v}" for k, v in sorted(fwd.ops.items())),
            "Linear bwd detail": " ".join(f"{k}:{v}" for k, v in sorted(bwd.ops.items())),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--path", choices=("torch", "triton"), nargs="+", default=["torch", "triton"])
    args = parser.parse_args()
    for path in args.path:
        rows = run(args.tokens, args.hidden, torch.bfloat16, path)
        print_table([{k: v for k, v in r.items() if "detail" not in k} for r in rows],
                    title=f"ops per FP8 GEMM, {path} path (CPU emulation, bf16, {args.tokens} tokens, hidden {args.hidden})")
        for r in rows:
            print(f"\n{r['recipe']} ({path})\n  forward:  {r['Linear fwd detail']}\n  backward: {r['Linear bwd detail']}")
        write_csv(output_dir() / "bench_fp8_ops.csv", rows, "fp8_ops")


if __name__ == "__main__":
    main()
