"""Correctness smoke for a GPU session: every Triton kernel once, at a real shape, fp16 and bf16.

Each case runs one op three ways: the Triton backend in the low-precision dtype, the torch backend
in the same dtype, and the torch backend in fp32 on the same values (the oracle). It passes when,
for the output and every gradient, the Triton error against the oracle is at most twice the torch
error plus the dtype's atol (the "2x of PyTorch" rule of tests/utils/asserts.py). Dropout masks are
the same on both backends (one Philox stream), so ops with dropout compare too. Two layer cases
follow: the BERT kernel layer's one-node eager path against its op-by-op path (bit for bit), and
``make_graphed_callables`` against eager calls (bit for bit).

This is the budgeted part of ``benchmarks/gpu.sh``; the full ``pytest -m gpu`` stays available
(``--only tests``). bf16 runs first, then fp16. Prints one line per case (PASS / FAIL / ERROR with
the reason) and appends it to gpu_smoke.csv as it finishes; exits 1 if any case failed.
``--shard I/N`` runs every N-th case from the I-th (the layer checks count as one case): gpu.sh's
warm phase compiles the kernels in N processes at once that way.

    python benchmarks/gpu_smoke.py               # on a GPU: real shapes
    python benchmarks/gpu_smoke.py --dtype bf16 --shard 0/4
    TRITON_INTERPRET=1 python benchmarks/gpu_smoke.py --cpu   # the script's logic on CPU, toy shapes
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Stream  # noqa: E402

ATOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5}


def _leaves(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def run_op(fn: Callable, inputs: list[torch.Tensor], dtype: torch.dtype, backend: str, grad_seed: int = 0):
    """Outputs and input gradients of fn(*inputs cast to dtype, backend=...)."""
    xs = [t.detach().to(dtype).requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    outs = _leaves(fn(*xs, backend=backend))
    gen = torch.Generator(device=outs[0].device).manual_seed(grad_seed)
    diffable = [o for o in outs if o.requires_grad]
    if diffable:
        loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o in diffable)
        loss.backward()
    return [o.detach().float() for o in outs] + [x.grad.float() for x in xs if x.grad is not None]


def check(name: str, fn: Callable, inputs: list[torch.Tensor], dtype: torch.dtype) -> dict:
    start = time.perf_counter()
    row = {"case": name, "dtype": str(dtype).removeprefix("torch."), "result": "ERROR", "worst": "", "detail": ""}
    try:
        tri = run_op(fn, inputs, dtype, "triton")
        ref_lp = run_op(fn, inputs, dtype, "torch")
        oracle = run_op(fn, inputs, torch.float32, "torch")
        worst, failures = 0.0, []
        for i, (t, r, o) in enumerate(zip(tri, ref_lp, oracle)):
            if t.shape != o.shape:
                failures.append(f"tensor {i}: shape {tuple(t.shape)} vs {tuple(o.shape)}")
                continue
            err_t = (t - o).abs().max().item() if t.numel() else 0.0
            err_r = (r - o).abs().max().item() if r.numel() else 0.0
            bound = 2 * err_r + ATOL[dtype]
            worst = max(worst, err_t / bound if bound else 0.0)
            if not err_t <= bound:  # NaN fails too
                failures.append(f"tensor {i}: triton err {err_t:.3g} > 2 x torch err {err_r:.3g} + atol")
        row.update(result="FAIL" if failures else "PASS", worst=f"{worst:.3g}", detail="; ".join(failures)[:300])
    except Exception as exc:  # one case's failure must not stop the others
        row["detail"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
        traceback.print_exc(limit=3)
    row["seconds"] = round(time.perf_counter() - start, 2)
    print(f"{row['result']:5s} {name} {row['dtype']} worst={row['worst']} {row['detail']}", flush=True)
    return row


def cases(device: str, small: bool) -> list[tuple[str, Callable, list[torch.Tensor]]]:
    from tachyon.kernels.activation import bias_act
    from tachyon.kernels.attention import attention, attention_qkvpacked
    from tachyon.kernels.dropout import bias_dropout_add, bias_dropout_add_layer_norm
    from tachyon.kernels.layernorm import layer_norm, rms_norm
    from tachyon.kernels.linear import mlp
    from tachyon.kernels.rope import apply_rotary, rope_frequencies

    g = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape, scale=1.0, grad=True):
        return (scale * torch.randn(*shape, generator=g)).to(device).requires_grad_(grad)

    rows, hidden, ffn = (64, 32, 64) if small else (4096, 1024, 4096)
    b, h, s, d = (2, 2, 16, 16) if small else (8, 16, 512, 64)
    seed = torch.tensor(1234, device=device)
    out = [
        ("layer_norm +residual", lambda x, w, bb, r, backend: layer_norm(x, w, bb, r, return_residual=True,
                                                                         backend=backend),
         [t(rows, hidden), t(hidden, scale=0.5), t(hidden, scale=0.1), t(rows, hidden)]),
        ("rms_norm", lambda x, w, backend: rms_norm(x, w, backend=backend), [t(rows, hidden), t(hidden, scale=0.5)]),
        ("bias_act gelu", lambda x, bb, backend: bias_act(x, bb, "gelu", backend=backend), [t(rows, ffn), t(ffn)]),
        ("bias_act swiglu", lambda x, bb, backend: bias_act(x, bb, "swiglu", backend=backend), [t(rows, ffn), t(ffn)]),
        ("bias_dropout_add p=0.1", lambda x, bb, r, backend: bias_dropout_add(x, bb, r, 0.1, seed, backend=backend),
         [t(rows, hidden), t(hidden), t(rows, hidden)]),
        ("bias_dropout_add_layer_norm p=0.1",
         lambda x, bb, r, w, lb, backend: bias_dropout_add_layer_norm(x, bb, r, w, lb, 1e-5, 0.1, seed, backend=backend),
         [t(rows, hidden), t(hidden), t(rows, hidden), t(hidden, scale=0.5), t(hidden, scale=0.1)]),
        ("mlp gelu (epilogue GEMMs)", lambda x, w1, b1, w2, backend: mlp(x, w1, b1, "gelu", w2, None, backend=backend),
         [t(rows, hidden), t(ffn, hidden, scale=0.03), t(ffn), t(hidden, ffn, scale=0.03)]),
        ("attention padding mask, dropout", lambda q, k, v, backend: attention(
            q, k, v, key_padding_bias=torch.where(torch.arange(s, device=q.device) < s - 3, 0.0, float("-inf")
                                                  ).expand(b, s).contiguous(), dropout_p=0.1, seed=seed,
            one_kernel_backward=True, backend=backend),
         [t(b, h, s, d), t(b, h, s, d), t(b, h, s, d)]),
        ("attention causal GQA", lambda q, k, v, backend: attention(q, k, v, causal=True, backend=backend),
         [t(b, h, s, d), t(b, max(1, h // 2), s, d), t(b, max(1, h // 2), s, d)]),
        ("attention_qkvpacked + qkv_bias", lambda qkv, qb, backend: attention_qkvpacked(
            qkv, h, qkv_bias=qb, dropout_p=0.1, seed=seed, one_kernel_backward=True, backend=backend),
         [t(b, s, 3 * h * d), t(3 * h * d, scale=0.1)]),
    ]
    cos, sin = rope_frequencies(s, d)
    cos, sin = cos.to(device), sin.to(device)
    out.append(("rope", lambda q, k, backend: apply_rotary(q, k, cos, sin, backend=backend),
                [t(b, s, h, d), t(b, s, h, d)]))
    out += inference_cases(device, small, t)
    return out


def inference_cases(device: str, small: bool, t: Callable) -> list:
    """The kernels without a backward (decode, KV append, INT8 GEMMs, FP8 casts) and fused Adam."""
    from tachyon.kernels.adam import multi_tensor_adam
    from tachyon.kernels.decode_attention import decode_attention
    from tachyon.kernels.fp8_cast import cast_to_fp8
    from tachyon.kernels.int8_linear import int8_linear
    from tachyon.kernels.int8_linear.reference import quantize_symmetric
    from tachyon.kernels.kv_append import rotary_kv_append
    from tachyon.kernels.rope import rope_frequencies

    b, h, kvh, cap, d = (2, 4, 2, 32, 16) if small else (16, 32, 8, 2048, 128)
    lengths = torch.tensor([cap // 2, cap - 3][:2] * (b // 2), device=device)
    cos, sin = rope_frequencies(cap, d)
    cos, sin = cos.to(device), sin.to(device)

    def decode(q, kc, vc, backend):
        return decode_attention(q, kc, vc, lengths, backend=backend)

    def append(qkv, kc, vc, backend):
        kc, vc = kc.clone(), vc.clone()
        positions = lengths[:, None].clone()
        q = rotary_kv_append(qkv, positions, cos, sin, kc, vc, lengths, heads=h, kv_heads=kvh, backend=backend)
        return q, kc, vc

    n, k = (64, 32) if small else (4096, 4096)
    qweight, scales = quantize_symmetric(torch.randn(n, k, device=device) * 0.05, 8)

    def int8(x, backend):
        return int8_linear(x, qweight, scales, None, backend=backend)

    def fp8(x, backend):
        amax = torch.zeros((), device=x.device)
        out = cast_to_fp8(x, torch.tensor(4.0, device=x.device), torch.float8_e4m3fn, amax, backend=backend)
        return out.float(), amax

    def adam(p, gr, backend):
        p = p.detach().clone()
        m, v = torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32)
        for step in (1, 2):
            multi_tensor_adam([p], [gr.detach()], [m], [v], [step], lr=1e-2, weight_decay=0.01, backend=backend)
        return p, m, v

    no_grad = {"grad": False}
    return [
        ("decode_attention GQA", decode, [t(b, h, 1, d, **no_grad), t(b, kvh, cap, d, **no_grad),
                                          t(b, kvh, cap, d, **no_grad)]),
        ("rotary_kv_append", append, [t(b, 1, (h + 2 * kvh) * d, **no_grad), t(b, kvh, cap, d, **no_grad),
                                      t(b, kvh, cap, d, **no_grad)]),
        ("int8_linear decode", int8, [t(b, k, **no_grad)]),
        ("fp8 cast e4m3 + amax", fp8, [t(b * 16, k, **no_grad)]),
        ("fused adam", adam, [t(n, k, **no_grad), t(n, k, scale=0.1, **no_grad)]),
    ]


def layer_checks(device: str, small: bool, dtype: torch.dtype) -> list[dict]:
    """The BERT layer's one-node eager path vs op by op, and graphed vs eager (GPU only), bit for bit."""
    import tachyon
    from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer

    hidden, heads, ffn, batch, seq = (32, 2, 64, 2, 8) if small else (1024, 16, 4096, 8, 128)
    rows = []
    for pre_ln in (True, False):
        name = f"BERT layer {'pre' if pre_ln else 'post'}-LN: one node == op by op"
        row = {"case": name, "dtype": str(dtype).removeprefix("torch."), "result": "ERROR", "worst": "", "detail": ""}
        try:
            config = TransformerKernelConfig(batch_size=batch, max_seq_length=seq, hidden_size=hidden,
                                             intermediate_size=ffn, heads=heads, attn_dropout_ratio=0.1,
                                             hidden_dropout_ratio=0.1, num_hidden_layers=2, initializer_range=0.02,
                                             seed=5, pre_layer_norm=pre_ln, fp16=dtype == torch.float16,
                                             bf16=dtype == torch.bfloat16)
            fused = TransformerKernelLayer(config).to(device)
            ops = copy.deepcopy(fused)
            ops.layer_id, ops.dropout_seed, ops.fused_eager = fused.layer_id, fused.dropout_seed, False
            x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
            grad = torch.randn_like(x)
            got = []
            for layer in (fused, ops):
                xi = x.clone().requires_grad_()
                y = layer(xi)
                y.backward(grad)
                got.append([y.detach(), xi.grad, *(p.grad for p in layer.parameters())])
            bad = [i for i, (a, c) in enumerate(zip(*got)) if not torch.equal(a, c)]
            row.update(result="FAIL" if bad else "PASS", detail=f"tensors differ: {bad}" if bad else "")
            if device == "cuda" and not bad:
                eager = copy.deepcopy(ops)
                eager.fused_eager = True
                graphed = copy.deepcopy(eager)
                graphed.layer_id = eager.layer_id
                tachyon.make_graphed_callables(graphed, (x.clone().requires_grad_(),))
                outs = []
                for layer in (graphed, eager):
                    xi = x.clone().requires_grad_()
                    y = layer(xi)
                    y.backward(grad)
                    outs.append([y.detach().clone(), xi.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
                bad = [i for i, (a, c) in enumerate(zip(*outs)) if not torch.equal(a, c)]
                row["detail"] = f"graphed != eager in tensors {bad}" if bad else "graphed == eager"
                row["result"] = "FAIL" if bad else "PASS"
        except Exception as exc:
            row["detail"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
            traceback.print_exc(limit=3)
        print(f"{row['result']:5s} {name} {row['dtype']} {row['detail']}", flush=True)
        rows.append(row)
    return rows


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard(spec: str) -> tuple[int, int]:
    """"I/N" -> (I, N) with 0 <= I < N."""
    try:
        index, count = (int(v) for v in spec.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N (e.g. 0/4); got {spec!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N; got {spec!r}")
    return index, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="toy shapes on CPU (TRITON_INTERPRET=1): checks the script")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None,
                        help="the dtypes to check, in order (default: bf16 fp16 on a GPU, fp16 with --cpu)")
    parser.add_argument("--shard", type=shard, default=(0, 1), help="I/N: every N-th case from the I-th (default 0/1)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_smoke needs a CUDA GPU (or --cpu under TRITON_INTERPRET=1 to check the script)")
    device = "cpu" if args.cpu else "cuda"
    names = args.dtype or (["fp16"] if args.cpu else ["bf16", "fp16"])
    index, count = args.shard
    out = Stream(None if args.cpu else "gpu_smoke.csv", "gpu_smoke",
                 ["case", "dtype", "result", "worst", "seconds", "detail"], title="GPU smoke", echo=False)
    for dtype in (DTYPES[n] for n in names):
        todo = cases(device, args.cpu)
        for position, (name, fn, inputs) in enumerate(todo):
            if position % count == index:
                out.add(check(name, fn, inputs, dtype))
        if len(todo) % count == index:  # the layer checks: one more case
            for row in layer_checks(device, args.cpu, dtype):
                out.add(row)
    out.table()
    rows = out.rows
    failed = [r for r in rows if r["result"] != "PASS"]
    print(f"{len(rows) - len(failed)} of {len(rows)} cases passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
