"""Kernel tables of one layer's forward + backward on a GPU (torch.profiler): where GPU time goes,
and how long the GPU sits idle between kernels (host time it waits for).

Layers, at the benchmark shapes, in this order (a run cut off by its time limit keeps the first):
the BERT-Large kernel layer pre-LN (seq 128, batch 64, bf16) eager, HF BertLayer (SDPA) eager for
comparison, tachyon.nn.TransformerLayer at the TE tutorial's quick shape (hidden 1024, seq 512,
batch 4) eager, then the BERT layer captured with make_graphed_callables. The tachyon layers run
with their default backend ("auto"). Each layer's rows print and go to the CSV as soon as it is
profiled; the whole table prints at the end.
For each: every kernel's launches per step, total and mean GPU microseconds and share of GPU time;
then GPU busy time (the union of kernel intervals), the step's span from first kernel start to last
kernel end, and their difference (idle gaps: the GPU waiting for the host).

    python benchmarks/gpu_profile.py [--steps 5] [--top 25]

Writes gpu_profile.csv (kernel rows and one summary row per layer). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Stream, warm_mode  # noqa: E402

COLUMNS = ["layer", "kernel", "launches/step", "us/step", "mean_us", "share"]


def _kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of everything the profiler saw run on the GPU (kernels, copies, memsets)."""
    from torch.autograd import DeviceType

    return [(evt.name, evt.time_range.start, evt.time_range.end) for evt in prof.events()
            if getattr(evt, "device_type", None) == DeviceType.CUDA]


def profile(label: str, step, steps: int, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(3):  # compile, autotune, caches
        step()
    torch.cuda.synchronize()
    if warm_mode():  # compiled; nothing to profile
        return []
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = sorted(_kernel_events(prof), key=lambda e: e[1])
    if not events:
        print(f"{label}: the profiler recorded no GPU kernels", flush=True)
        return [{"layer": label, "kernel": "(no kernels recorded)"}]
    per = collections.defaultdict(lambda: [0, 0.0])
    busy, cur_start, cur_end = 0.0, events[0][1], events[0][2]
    for name, start, end in events:
        per[name][0] += 1
        per[name][1] += end - start
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = events[-1][2] - events[0][1]
    total = sum(v[1] for v in per.values())
    rows = []
    for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        rows.append({"layer": label, "kernel": name[:90], "launches/step": count / steps, "us/step": us / steps,
                     "mean_us": us / count, "share": us / total})
    rows.append({"layer": label, "kernel": "== step: GPU busy / span / idle (us), kernels per step",
                 "us/step": busy / steps, "mean_us": span / steps, "share": (span - busy) / span,
                 "launches/step": len(events) / steps})
    print(f"{label}: GPU busy {busy / steps:.0f} us of a {span / steps:.0f} us step span "
          f"({100 * (span - busy) / span:.0f}% idle), {len(events) / steps:.0f} kernels per step", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile needs a CUDA GPU")
    import tachyon
    from benchmarks.bench_te_layer import QUICK
    from benchmarks.bench_transformer_kernel import hf_layer, kernel_config
    from tachyon.nn import TransformerKernelLayer, TransformerLayer

    dtype, seq, batch, hidden = torch.bfloat16, 128, 64, 1024
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    mask = torch.ones(batch, seq, device="cuda", dtype=torch.long)
    ext = torch.zeros(batch, 1, 1, seq, device="cuda", dtype=dtype)

    def stepper(module, *args):
        def step():
            x.grad = None
            module.zero_grad(set_to_none=True)
            out = module(x, *args)
            (out[0] if isinstance(out, tuple) else out).backward(dy)
        return step

    def te_step():
        xs = torch.randn(QUICK["seq"], QUICK["batch"], QUICK["hidden"], device="cuda", dtype=dtype, requires_grad=True)
        te = TransformerLayer(QUICK["hidden"], QUICK["ffn"], QUICK["heads"], hidden_dropout=0.1, attention_dropout=0.1,
                              params_dtype=dtype).cuda()
        dys = torch.randn_like(xs)

        def step():
            xs.grad = None
            te.zero_grad(set_to_none=True)
            te(xs).backward(dys)
        return step

    layers = {  # label -> a builder of the step (built when its turn comes: a failure stays that layer's)
        "BERT-Large pre-LN eager (s128 b64 bf16, backend auto)": lambda: stepper(
            TransformerKernelLayer(kernel_config(batch, seq, dtype, True)).cuda(), mask),
        "HF BertLayer sdpa eager": lambda: stepper(hf_layer("sdpa", dtype, "cuda"), ext),
        "TransformerLayer eager (TE quick shape, bf16, backend auto)": te_step,
        "BERT-Large pre-LN graphed (backend auto)": lambda: stepper(tachyon.make_graphed_callables(
            TransformerKernelLayer(kernel_config(batch, seq, dtype, True)).cuda(), (x, mask)), mask),
    }
    out = Stream("gpu_profile.csv", "gpu_profile", COLUMNS, title="GPU kernels per forward + backward step")
    for label, build in layers.items():
        try:
            rows = profile(label, build(), args.steps, args.top)
        except Exception as exc:
            print(f"{label}: {type(exc).__name__}: {exc}", flush=True)
            rows = [{"layer": label, "kernel": f"ERROR {type(exc).__name__}: {str(exc)[:120]}"}]
        for row in rows:
            out.add(row)
    out.table()


if __name__ == "__main__":
    main()
