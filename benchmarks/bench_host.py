"""Host time: tachyon's GPU code path against the PyTorch modules it replaces, on a CPU.

On a GPU a call costs its host time (Python, autograd, argument checks, Triton's launcher) or its
kernels' time, whichever is longer; at BERT-Large seq 128 batch 64 a layer's kernels take about
1-1.5 ms per forward+backward, so host time above that is time the GPU waits. Host time can be
measured without a GPU: `tachyon.profiling.launch_stub.StubLaunches` runs every Python step of
tachyon's CUDA path on CPU tensors and stubs only the driver's launch (kernels counted, not run).
Each row times one call both ways in this process, interleaved (rounds of ``--calls`` calls of
each variant in turn; medians over ``--rounds`` rounds; the ratio is the median of the rounds'
ratios), as thread CPU time, at tiny shapes so
that the CPU math of the reference (and of the GEMMs both sides run on the CPU here) stays small:
what remains is what each side spends on the host.

    python benchmarks/bench_host.py [--rounds 41] [--calls 10] [--only "layer_norm,BERT layer,..."]

Columns: tachyon_us and reference_us per call; ratio = tachyon / reference (goal: <= 0.8 for
layers, <= 1.5 for single ops); triton_launches per call; py_calls / c_calls (and ref_*): Python
functions and C functions called from Python in one call, counted with ``sys.setprofile``: figures
the machine's load does not change (torch's own C++ work, e.g. autograd's, is not in them). Must run without TRITON_INTERPRET (the
stub replaces the GPU launch path that the interpreter would replace). Appends
bench_host.csv rows (results/latest or $TACHYON_BENCH_OUT). CPU timings are only meaningful as
ratios within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("bench_host.py stubs Triton's GPU launch path: run it without TRITON_INTERPRET")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import output_dir, print_table, write_csv  # noqa: E402

# tiny shapes: the reference's CPU math stays a small part of its time
BATCH, SEQ, HIDDEN, HEADS, FFN = 2, 16, 64, 4, 256
ROWS = BATCH * SEQ


def thread_us(fn: Callable[[], object], calls: int) -> float:
    """Thread CPU microseconds per call of ``calls`` calls."""
    start = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - start) / calls / 1e3


def calls_per_run(fn: Callable[[], object]) -> tuple[int, int]:
    """(Python function calls, calls of C functions from Python) in one run of ``fn``: a count
    that the machine's load does not change, beside the times that it does."""
    counts = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"]


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Thread-CPU us per call of each fn in each round; the fns are timed in turn, round after
    round, so a change in the machine's load hits neighbouring samples of each alike."""
    for fn in fns.values():  # warm-up: compile stand-ins, autotune, caches
        for _ in range(5):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(thread_us(fn, calls))
    return samples


def _params(*shapes, dtype=torch.float32):
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def _no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def _fwd_bwd(fn, params):
    def run():
        for p in params:
            p.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return run


def op_units() -> dict[str, tuple[Callable, Callable]]:
    """name -> (tachyon call, reference call); each builds its own inputs."""
    from tachyon.kernels.activation import bias_act
    from tachyon.kernels.attention import attention
    from tachyon.kernels.dropout import bias_dropout_add_layer_norm
    from tachyon.kernels.layernorm import layer_norm, rms_norm
    from tachyon.kernels.linear import mlp

    units = {}
    x, w, b = _params((ROWS, HIDDEN), (HIDDEN,), (HIDDEN,))
    units["layer_norm fwd (no grad)"] = (_no_grad(lambda: layer_norm(x, w, b)),
                                         _no_grad(lambda: F.layer_norm(x, (HIDDEN,), w, b)))
    units["layer_norm fwd: its Triton launch alone"] = (_bare_norm_launch(x, w, b),
                                                        _no_grad(lambda: F.layer_norm(x, (HIDDEN,), w, b)))
    units["layer_norm fwd+bwd"] = (_fwd_bwd(lambda: layer_norm(x, w, b), (x, w, b)),
                                   _fwd_bwd(lambda: F.layer_norm(x, (HIDDEN,), w, b), (x, w, b)))
    units["rms_norm fwd+bwd"] = (_fwd_bwd(lambda: rms_norm(x, w), (x, w)),
                                 _fwd_bwd(lambda: F.rms_norm(x, (HIDDEN,), w, 1e-6), (x, w)))
    xf, bf = _params((ROWS, FFN), (FFN,))
    units["bias+gelu fwd+bwd"] = (_fwd_bwd(lambda: bias_act(xf, bf, "gelu"), (xf, bf)),
                                  _fwd_bwd(lambda: F.gelu(xf + bf), (xf, bf)))
    r = torch.randn(ROWS, HIDDEN, requires_grad=True)
    units["bias+dropout+add+layer_norm fwd+bwd"] = (
        _fwd_bwd(lambda: bias_dropout_add_layer_norm(x, b, r, w, b, 1e-5, 0.1, 1234, training=True), (x, b, r, w)),
        _fwd_bwd(lambda: F.layer_norm(F.dropout(x + b, 0.1) + r, (HIDDEN,), w, b), (x, b, r, w)),
    )
    w1, b1, w2 = _params((FFN, HIDDEN), (FFN,), (HIDDEN, FFN))
    units["mlp (gemm+bias+gelu, gemm) fwd+bwd"] = (
        _fwd_bwd(lambda: mlp(x, w1, b1, "gelu", w2, None), (x, w1, b1, w2)),
        _fwd_bwd(lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2), (x, w1, b1, w2)),
    )
    q, k, v = _params(*[(BATCH, HEADS, SEQ, HIDDEN // HEADS)] * 3)
    units["attention fwd+bwd"] = (_fwd_bwd(lambda: attention(q, k, v), (q, k, v)),
                                  _fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v), (q, k, v)))
    # what an eager call on an sm_90 GPU runs by default: backend "auto" consults the dispatch table,
    # which picks the torch twin where the kernel was not measured clearly faster (here, fp32: not measured)
    for name in ("layer_norm fwd (no grad)", "layer_norm fwd+bwd", "rms_norm fwd+bwd", "attention fwd+bwd",
                 "mlp (gemm+bias+gelu, gemm) fwd+bwd"):
        tachyon_fn, reference_fn = units[name]
        units[f"{name}, auto on sm_90"] = (_on_sm90(tachyon_fn), reference_fn)
    return units


def _bare_norm_launch(x, w, b) -> Callable[[], object]:
    """layer_norm's one kernel launch with its outputs allocated once: what any eager call of the op
    costs at least (Triton's binder and specialization key, the cached launcher)."""
    from tachyon.kernels.layernorm import triton as tri

    y, mean, rstd = torch.empty_like(x), torch.empty(ROWS), torch.empty(ROWS)
    block_n, num_warps = tri.row_config(HIDDEN)

    def run():
        tri._norm_fwd_kernel[(ROWS,)](x, x, w, b, y, y, mean, rstd, x.stride(0), 0, y.stride(0), 0, HIDDEN, 1e-5,
                                      IS_RMS=False, HAS_RES=False, HAS_BIAS=True, STORE_Z=False, STORE_MEAN=True,
                                      BLOCK_N=block_n, num_warps=num_warps)
    return run


def layer_units() -> dict[str, tuple[Callable, Callable]]:
    """The fused layers against the modules they replace, forward+backward in training mode."""
    from benchmarks.bench_te_layer import BasicTransformerLayer
    from benchmarks.bench_transformer_kernel import hf_layer, kernel_config

    import benchmarks.bench_transformer_kernel as btk
    import tachyon.nn as tnn
    from tachyon.nn import TransformerKernelLayer

    btk.HIDDEN, btk.HEADS, btk.FFN = HIDDEN, HEADS, FFN
    units = {}
    x = torch.randn(BATCH, SEQ, HIDDEN)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, SEQ // 2:] = 0
    hf = hf_layer("sdpa", torch.float32, "cpu")
    hf_mask = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    for pre_ln in (True, False):
        layer = TransformerKernelLayer(kernel_config(BATCH, SEQ, torch.float32, pre_ln)).train()
        label = "pre-LN" if pre_ln else "post-LN"
        units[f"BERT layer {label} fwd+bwd"] = (
            _fwd_bwd(lambda layer=layer: layer(x, mask), list(layer.parameters())),
            _fwd_bwd(lambda: hf(x, attention_mask=hf_mask), list(hf.parameters())),
        )
        units[f"BERT layer {label} fwd (grad on)"] = (lambda layer=layer: layer(x, mask),
                                                      lambda: hf(x, attention_mask=hf_mask))
    xs = torch.randn(SEQ, BATCH, HIDDEN)
    te = tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.1, attention_dropout=0.1).train()
    basic = BasicTransformerLayer(HIDDEN, FFN, HEADS).train()
    units["TE TransformerLayer fwd+bwd"] = (_fwd_bwd(lambda: te(xs), list(te.parameters())),
                                            _fwd_bwd(lambda: basic(xs), list(basic.parameters())))
    # its forward alone (grad on: what the training step's forward costs, the saved tensors included);
    # the backward's share is the fwd+bwd row minus this one
    units["TE TransformerLayer fwd (grad on)"] = (lambda: te(xs), lambda: basic(xs))
    # the same layer through its submodules (one_node_eager=False: the path torch.compile traces)
    modules = copy.deepcopy(te)
    modules.one_node_eager = False
    units["TE TransformerLayer fwd+bwd, module path"] = (_fwd_bwd(lambda: modules(xs), list(modules.parameters())),
                                                         _fwd_bwd(lambda: basic(xs), list(basic.parameters())))
    # with RoPE (TE's angle tensor; the reference layer has none, so these rows are conservative): the
    # one-node path and the module path
    angles = tnn.RotaryPositionEmbedding(HIDDEN // HEADS)(SEQ)
    units["TE TransformerLayer fwd+bwd, RoPE"] = (_fwd_bwd(lambda: te(xs, rotary_pos_emb=angles), list(te.parameters())),
                                                  _fwd_bwd(lambda: basic(xs), list(basic.parameters())))
    units["TE TransformerLayer fwd+bwd, RoPE, module path"] = (
        _fwd_bwd(lambda: modules(xs, rotary_pos_emb=angles), list(modules.parameters())),
        _fwd_bwd(lambda: basic(xs), list(basic.parameters())))
    # backend "auto" as on an sm_90 GPU: tachyon.kernels.dispatch picks torch's LayerNorm for the input norm
    units["TE TransformerLayer fwd+bwd, auto on sm_90"] = (
        _on_sm90(_fwd_bwd(lambda: te(xs), list(te.parameters()))),
        _fwd_bwd(lambda: basic(xs), list(basic.parameters())))
    return units


_SM90 = [False]  # True while an "auto on sm_90" unit runs (see _sm90_dispatch)


def _on_sm90(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with backend "auto" answering as on an sm_90 GPU: the dispatch table's choices apply
    (the CUDA check and the GPU architecture are patched once for the run by :func:`_sm90_dispatch`,
    as tests/kernels/test_dispatch.py patches them; this only turns them on, so the patching costs
    the timed call nothing beyond two list stores)."""
    def run():
        _SM90[0] = True
        try:
            return fn()
        finally:
            _SM90[0] = False
    return run


@contextlib.contextmanager
def _sm90_dispatch():
    """Within: the ops' ``auto_on_cuda`` answers as on CUDA, and ``dispatch.arch_of`` as sm_90, while
    ``_SM90[0]`` is set; otherwise as before (CPU: no dispatch table)."""
    import tachyon.kernels.linear.mlp  # noqa: F401  (the module, not the function the package exports)
    from tachyon.kernels import dispatch
    from tachyon.kernels.attention import op as attention_op
    from tachyon.kernels.layernorm import op as norm_op
    from tachyon.nn import transformer_layer_fused as one_node

    modules = (norm_op, attention_op, sys.modules["tachyon.kernels.linear.mlp"], one_node)
    real = [m.auto_on_cuda for m in modules]
    real_arch = dispatch.arch_of

    def on_cuda(tensor, backend=None, _real=real[0], _flag=_SM90):
        return backend in (None, "auto") if _flag[0] else _real(tensor, backend)

    for m in modules:
        m.auto_on_cuda = on_cuda
    dispatch.arch_of = lambda tensor: "sm_90" if _SM90[0] else real_arch(tensor)
    try:
        yield
    finally:
        for m, f in zip(modules, real):
            m.auto_on_cuda = f
        dispatch.arch_of = real_arch


def measure(units: dict[str, tuple[Callable, Callable]], rounds: int, calls: int, stub) -> list[dict]:
    rows = []
    for name, (tachyon_fn, reference_fn) in units.items():
        for _ in range(3):  # autotuning launches every config once; count a call after it
            tachyon_fn()
        stub.clear()
        tachyon_fn()
        launches = len(stub.launches)
        py_t, c_t = calls_per_run(tachyon_fn)
        py_r, c_r = calls_per_run(reference_fn)
        samples = interleaved({"tachyon": tachyon_fn, "reference": reference_fn}, rounds, calls)
        t_us, r_us = statistics.median(samples["tachyon"]), statistics.median(samples["reference"])
        # the ratio of each round's pair, then their median: robust to the load drifting between rounds
        ratios = sorted(t / r for t, r in zip(samples["tachyon"], samples["reference"]))
        ratio = statistics.median(ratios)
        rows.append({"unit": name, "tachyon_us": t_us, "reference_us": r_us, "ratio": ratio,
                     "ratio_p20": ratios[len(ratios) // 5], "ratio_p80": ratios[(4 * len(ratios)) // 5],
                     "triton_launches": launches,
                     "py_calls": py_t, "c_calls": c_t, "ref_py_calls": py_r, "ref_c_calls": c_r})
        print(f"{name}: {t_us:.1f} us vs {r_us:.1f} us (ratio {ratio:.2f}, p20-p80 {rows[-1]['ratio_p20']:.2f}-"
              f"{rows[-1]['ratio_p80']:.2f}), {launches} launches, "
              f"Python calls {py_t} + {c_t} C vs {py_r} + {c_r}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated substrings of unit names")
    args = parser.parse_args()
    from tachyon.profiling.launch_stub import StubLaunches

    torch.manual_seed(0)
    torch.set_num_threads(1)  # host time is one thread's work; CPU math stays single-threaded on both sides
    with StubLaunches() as stub, _sm90_dispatch():
        units = {**op_units(), **layer_units()}
        if args.only:
            wanted = [w.strip() for w in args.only.split(",") if w.strip()]
            units = {k: v for k, v in units.items() if any(w in k for w in wanted)}
        rows = measure(units, args.rounds, args.calls, stub)
    print_table(rows, title=f"Host time per call, thread CPU us (medians of {args.rounds} interleaved rounds)")
    write_csv(output_dir() / "bench_host.csv", rows, "host")


if __name__ == "__main__":
    main()
