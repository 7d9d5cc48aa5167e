"""What ``backend="auto"`` runs on a CUDA tensor, for ops that have a torch twin: chosen by measurement.

Some of tachyon's ops have a torch implementation with the same contract on a GPU: the norms
(``F.layer_norm`` / ``F.rms_norm``, after the residual add), attention without dropout or
padding (``F.scaled_dot_product_attention``, which picks flash / cuDNN / efficient itself), and
the MLP block's epilogue GEMMs (cuBLAS's GEMMs with tachyon's bias-activation kernel between
them, saving the same tensors: backend "cublas" of the block's two GEMM ops). For
those, ``backend="auto"`` on CUDA runs tachyon's Triton kernel only where a committed GPU result
shows it clearly faster than the torch twin for that op, GPU architecture, dtype and shape class,
and for how the call runs; everywhere else, the torch twin. How a call runs has two parts:

- eager, or recorded into a CUDA graph by :func:`tachyon.make_graphed_callables` (its warm-up and
  capture run under :func:`graph_capture_choices`). An eager call costs the larger of its host time
  and its GPU time; a replayed graph costs GPU time alone. The two rank the implementations
  differently: measured on an H100, tachyon's Triton norms need less GPU time than torch's at every
  shape but more host time per call, so eager calls take torch's norm and graphed calls the kernel.
- forward only (no gradient needed: inference, ``torch.no_grad``) or forward and backward (training):
  the choice of the forward decides the backward.

Each choice cites the rows of the results file it comes from (the Triton kernel's and the twin's,
same run, both eager quantiles and the graph time); the implementation is derived from them, never
written by hand: eager, the Triton kernel only where its 80th percentile is below the twin's 20th
(the two distributions do not overlap; a smaller difference is noise); graphed, only where its graph
time is at least 3% below the twin's (graph replays repeat within about 1%). ``tachyon info`` prints
the table, and a CPU test checks every cited number against the file. The way torch's SDPA and
Transformer Engine pick an attention backend (a support matrix and a preference order) is the
model; the preference here comes from measurements.

``backend="triton"`` and ``backend="torch"`` are not affected: they still mean the Triton kernel
and the PyTorch reference (the test oracle). Ops without a torch twin of the same contract
(attention with dropout, whose mask is tachyon's seeded one; packed QKV with bias and rotary; the
fused layers, which choose once per layer) keep Triton under "auto" on CUDA.

What the torch twin gives up: ``invertible=True`` norms save what torch saves (the norm input, not
the output), and attention's fully masked rows are whatever SDPA gives (the twin is used only
without a padding bias, where no row is fully masked unless causal with seq_q > seq_k, which also
stays on Triton). A module captured by ``make_graphed_callables`` may therefore run a different
implementation in its graph than the same module eager: results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch

TRITON, TWIN = "triton", "torch"  # a choice: the Triton kernel, or the op's torch twin
EAGER, GRAPH = "eager", "graph"  # how the call runs
FWD, FWD_BWD = "fwd", "fwd+bwd"  # what it runs: the forward alone, or forward then backward
GRAPH_MARGIN = 0.97  # graphed: the kernel only where its graph time is below 97% of the twin's


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a committed results table: its leading cells (enough to find it) and its timings (ms):
    the eager median and 20th / 80th percentiles, and the CUDA-graph replay median."""

    cells: tuple[str, ...]
    median_ms: float
    p20_ms: float
    p80_ms: float
    graph_ms: float


@dataclasses.dataclass(frozen=True)
class Evidence:
    """The Triton kernel's row and the torch twin's row for one mode, from the same run."""

    mode: str  # FWD / FWD_BWD
    triton: Row
    twin: Row

    def faster(self, timing: str) -> str:
        """TRITON where the kernel measured clearly faster run this way (module docstring), else TWIN."""
        if timing == GRAPH:
            return TRITON if self.triton.graph_ms < GRAPH_MARGIN * self.twin.graph_ms else TWIN
        return TRITON if self.triton.p80_ms < self.twin.p20_ms else TWIN


@dataclasses.dataclass(frozen=True)
class Choice:
    op: str
    arch: str  # "sm_90": torch.cuda.get_device_capability as sm_<major><minor>
    dtype: str  # torch dtype name without the "torch." prefix
    shape_class: str  # see norm_class / attention_class
    results: str  # the results file under benchmarks/results/ the evidence comes from
    evidence: tuple[Evidence, ...]  # one per mode (FWD, FWD_BWD)

    def impl(self, mode: str, timing: str) -> str:
        """What runs for a call of this mode (FWD / FWD_BWD) and timing (EAGER / GRAPH)."""
        return next(e for e in self.evidence if e.mode == mode).faster(timing)

    def line(self) -> str:
        picks = " ".join(f"{mode}/{timing}={self.impl(mode, timing)}" for timing in (EAGER, GRAPH)
                         for mode in (FWD, FWD_BWD))
        measured = "; ".join(f"{e.mode} triton {e.triton.median_ms:g} (graph {e.triton.graph_ms:g}) vs torch "
                             f"{e.twin.median_ms:g} (graph {e.twin.graph_ms:g}) ms" for e in self.evidence)
        return f"{self.op:<10} {self.arch} {self.dtype:<8} {self.shape_class:<20} {picks} ({measured}; {self.results})"


def norm_class(n: int) -> str:
    """Norms by row width: the power-of-two bucket that holds it (one Triton block per row)."""
    return f"n<={max(1, 1 << (int(n) - 1).bit_length())}"


def attention_class(causal: bool, seq_q: int, seq_k: int, head_dim: int) -> str:
    """Attention without dropout or padding, by mask, the longer sequence's power-of-two bucket and head dim."""
    seq = max(int(seq_q), int(seq_k), 1)
    return f"{'causal' if causal else 'full'} s<={1 << (seq - 1).bit_length()} d{int(head_dim)}"


def mlp_class(m: int, k: int, f: int) -> str:
    """The MLP block by rows (tokens), input features and hidden features: power-of-two buckets."""
    def bucket(n: int) -> int:
        return max(1, 1 << (int(n) - 1).bit_length())
    return f"m<={bucket(m)} k<={bucket(k)} f<={bucket(f)}"


_H100 = "2026-11-28-h100-run.md"


def _norm(op: str, dtype: str, shape: str, triton: tuple[tuple[float, ...], tuple[float, ...]],
          twin: tuple[tuple[float, ...], tuple[float, ...]]) -> tuple[Evidence, ...]:
    """Evidence from bench_layernorm rows; per mode (median, p20, p80, graph) of the kernel and of torch."""
    return tuple(Evidence(mode, Row((op, dtype, shape, "tachyon", mode), *t), Row((op, dtype, shape, "torch", mode), *c))
                 for mode, t, c in zip((FWD, FWD_BWD), triton, twin))


def _attention(shape: str, dims: str, causal: str, triton, twin) -> tuple[Evidence, ...]:
    """Evidence from bench_attention rows (bf16): the kernel against SDPA-flash."""
    return tuple(Evidence(mode, Row((shape, dims, causal, "bfloat16", "tachyon", mode), *t),
                          Row((shape, dims, causal, "bfloat16", "sdpa-flash", mode), *c))
                 for mode, t, c in zip((FWD, FWD_BWD), triton, twin))


def _mlp(shape: str, dtype: str, triton, twin) -> tuple[Evidence, ...]:
    """Evidence from bench_mlp rows: the epilogue GEMMs against cuBLAS GEMMs + the bias-activation kernel."""
    return tuple(Evidence(mode, Row((shape, dtype, "tachyon mlp (Triton epilogue GEMMs)", mode), *t),
                          Row((shape, dtype, "cuBLAS + bias_act + cuBLAS", mode), *c))
                 for mode, t, c in zip((FWD, FWD_BWD), triton, twin))


# The measured choices: one H100 (sm_90), bench_layernorm / bench_attention --quick, M = 4096 rows for the
# norms; each tuple is (median, p20, p80, graph) in ms, forward then forward+backward.
TABLE: tuple[Choice, ...] = (
    Choice("layer_norm", "sm_90", "float16", norm_class(1024), _H100, _norm(
        "layernorm", "float16", "4096x1024",
        ((0.0295, 0.02465, 0.03786, 0.005298), (0.3613, 0.3542, 0.3854, 0.02967)),
        ((0.01651, 0.01597, 0.01693, 0.01098), (0.05878, 0.05443, 0.06688, 0.0393)))),
    Choice("layer_norm", "sm_90", "float16", norm_class(4096), _H100, _norm(
        "layernorm", "float16", "4096x4096",
        ((0.06026, 0.0297, 0.07033, 0.02623), (0.342, 0.3099, 0.3966, 0.09745)),
        ((0.03859, 0.03798, 0.03914, 0.03354), (0.1365, 0.1357, 0.1375, 0.1208)))),
    Choice("layer_norm", "sm_90", "bfloat16", norm_class(1024), _H100, _norm(
        "layernorm", "bfloat16", "4096x1024",
        ((0.02286, 0.02055, 0.03265, 0.005533), (0.3422, 0.3134, 0.3751, 0.02966)),
        ((0.01654, 0.01597, 0.01693, 0.01117), (0.05837, 0.05418, 0.07119, 0.04009)))),
    Choice("layer_norm", "sm_90", "bfloat16", norm_class(4096), _H100, _norm(
        "layernorm", "bfloat16", "4096x4096",
        ((0.03042, 0.02998, 0.03107, 0.02673), (0.3933, 0.3643, 0.426, 0.09856)),
        ((0.03891, 0.03827, 0.03946, 0.03374), (0.1372, 0.1364, 0.138, 0.1211)))),
    Choice("rms_norm", "sm_90", "float16", norm_class(1024), _H100, _norm(
        "rmsnorm", "float16", "4096x1024",
        ((0.01136, 0.01069, 0.01217, 0.004528), (0.2209, 0.2082, 0.2785, 0.025)),
        ((0.01286, 0.01232, 0.01325, 0.006096), (0.09395, 0.08737, 0.1042, 0.02947)))),
    Choice("rms_norm", "sm_90", "float16", norm_class(4096), _H100, _norm(
        "rmsnorm", "float16", "4096x4096",
        ((0.02851, 0.02822, 0.02923, 0.02478), (0.3562, 0.314, 0.4275, 0.08024)),
        ((0.03318, 0.03254, 0.03379, 0.02886), (0.1191, 0.1182, 0.1201, 0.1043)))),
    Choice("rms_norm", "sm_90", "bfloat16", norm_class(1024), _H100, _norm(
        "rmsnorm", "bfloat16", "4096x1024",
        ((0.0116, 0.01098, 0.01226, 0.00458), (0.3328, 0.2932, 0.4038, 0.02503)),
        ((0.01216, 0.0119, 0.01242, 0.006104), (0.1356, 0.1041, 0.1834, 0.02988)))),
    Choice("rms_norm", "sm_90", "bfloat16", norm_class(4096), _H100, _norm(
        "rmsnorm", "bfloat16", "4096x4096",
        ((0.02931, 0.02865, 0.02979, 0.02486), (0.5072, 0.4407, 0.6153, 0.08045)),
        ((0.03254, 0.03216, 0.03322, 0.02889), (0.126, 0.1249, 0.1268, 0.1109)))),
    Choice("attention", "sm_90", "bfloat16", attention_class(False, 512, 512, 64), _H100, _attention(
        "bert", "16,16,16,512,64", "False",
        ((0.05891, 0.0583, 0.05949, 0.05614), (0.6337, 0.576, 0.6639, 0.2561)),
        ((0.07565, 0.07517, 0.07619, 0.0692), (0.3539, 0.3515, 0.5438, 0.3457)))),
    Choice("attention", "sm_90", "bfloat16", attention_class(True, 2048, 2048, 128), _H100, _attention(
        "gpt-causal", "4,32,32,2048,128", "True",
        ((0.3576, 0.3552, 0.3703, 0.3714), (1.511, 1.48, 1.517, 1.508)),
        ((0.4821, 0.4778, 0.4868, 0.4905), (2.112, 2.108, 2.119, 2.087)))),
    # the MLP block (gelu) at BERT-Large's 8192 tokens, 1024 -> 4096 -> 1024; the twin is cuBLAS's GEMMs
    # with tachyon's bias-activation kernel between them (same saved tensors). The benchmark's chain
    # adds b1 in the activation kernel; the twin adds it in the first GEMM (addmm: no extra pass) so
    # that the saved pre-activation includes it, as the epilogue GEMM's does
    Choice("mlp", "sm_90", "bfloat16", mlp_class(8192, 1024, 4096), _H100, _mlp(
        "BERT-Large", "bfloat16",
        ((0.2843, 0.2832, 0.2894, 0.2963), (0.8731, 0.8642, 0.877, 0.8707)),
        ((0.2476, 0.2458, 0.2497, 0.2611), (0.7885, 0.7827, 0.8049, 0.7923)))),
)

_BY_KEY = {(c.op, c.arch, c.dtype, c.shape_class): c for c in TABLE}
if len(_BY_KEY) != len(TABLE):
    raise RuntimeError("tachyon.kernels.dispatch: two table rows for one (op, arch, dtype, shape class)")
# the same table, resolved: (op, arch, dtype, shape class, mode, timing) -> TRITON / TWIN
_IMPL = {(*key, mode, timing): c.impl(mode, timing) for key, c in _BY_KEY.items()
         for mode in (FWD, FWD_BWD) for timing in (EAGER, GRAPH)}
_graph_depth = 0  # > 0 inside graph_capture_choices()


@contextlib.contextmanager
def graph_capture_choices() -> Iterator[None]:
    """Inside: "auto" chooses for calls that will be replayed from a CUDA graph (GPU time alone).
    :func:`tachyon.make_graphed_callables` runs its warm-up and capture in it, so that the kernels it
    captures were compiled and tuned in the warm-up. Code capturing graphs itself can do the same:
    warm up and capture inside this context."""
    global _graph_depth
    _graph_depth += 1
    try:
        yield
    finally:
        _graph_depth -= 1


def timing() -> str:
    """GRAPH inside :func:`graph_capture_choices`, else EAGER."""
    return GRAPH if _graph_depth else EAGER


_ARCHS: dict[int, str] = {}  # device index -> "sm_XY", filled on first use


# A device's architecture is fixed for the process: torch.compile takes the value as a constant (it
# calls the function while tracing), so neither this cache nor the CUDA query is traced into the graph
@torch._dynamo.assume_constant_result
def _arch_of_index(index: int) -> str:
    arch = _ARCHS.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = _ARCHS[index] = f"sm_{major}{minor}"
    return arch


def arch_of(tensor: torch.Tensor) -> str:
    """The GPU architecture of a CUDA tensor's device, as "sm_<major><minor>"."""
    return _arch_of_index(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def lookup(op: str, arch: str, dtype: torch.dtype, shape_class: str) -> Choice | None:
    """The measured choice for this op, architecture, dtype and shape class, or None (not measured)."""
    return _BY_KEY.get((op, arch, str(dtype).removeprefix("torch."), shape_class))


def choose(op: str, tensor: torch.Tensor, shape_class: str, backward: bool) -> str:
    """TRITON where the table says the kernel measured clearly faster for this call (``backward``: the
    call's output will be differentiated; eager or graph: :func:`timing`), else TWIN (measured slower
    or within noise, or not measured)."""
    key = (op, arch_of(tensor), str(tensor.dtype).removeprefix("torch."), shape_class,
           FWD_BWD if backward else FWD, GRAPH if _graph_depth else EAGER)
    return _IMPL.get(key, TWIN)


_CHOICES: dict[tuple, str] = {}
_is_compiling = torch.compiler.is_compiling  # choose_by's answers; arch_of (the function) is part of the key


def choose_by(op: str, tensor: torch.Tensor, classify: Callable[..., str], args: tuple, backward: bool) -> str:
    """:func:`choose` for the shape class ``classify(*args)``, remembered per op, device, dtype, ``args``,
    mode, timing and :func:`arch_of` itself (so that a replaced ``arch_of`` asks again): an eager call
    seen before costs one dict lookup instead of the architecture query and the class's string."""
    if _is_compiling():  # torch.compile traces choose itself (a cache filled while tracing would recompile)
        return choose(op, tensor, classify(*args), backward)
    key = (op, tensor.device, tensor.dtype, args, backward, _graph_depth, arch_of)
    choice = _CHOICES.get(key)
    if choice is None:
        if len(_CHOICES) >= 4096:  # many distinct shapes (inference with varying lengths): start over
            _CHOICES.clear()
        choice = _CHOICES[key] = choose(op, tensor, classify(*args), backward)
    return choice


def needs_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on these tensors will be differentiated: grad mode on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def describe(arch: str | None = None) -> list[str]:
    """``tachyon info``'s lines: every measured choice (this GPU's first when ``arch`` is given)."""
    rows = sorted(TABLE, key=lambda c: (c.arch != arch, c.op, c.arch, c.dtype, c.shape_class))
    head = ("backend 'auto' on CUDA, ops with a torch twin (norms; attention without dropout or padding): the Triton "
            "kernel only where measured clearly faster for the call's mode (fwd or fwd+bwd) and timing (eager, or "
            "graph under make_graphed_callables), else torch")
    if arch is not None:
        head += f"; this GPU is {arch}" + ("" if any(c.arch == arch for c in TABLE) else " (nothing measured on it: torch)")
    return [head, *(f"  {c.line()}" for c in rows), "  anything not listed: torch (not measured)"]


__all__ = ["EAGER", "FWD", "FWD_BWD", "GRAPH", "TABLE", "TRITON", "TWIN", "Choice", "Evidence", "Row", "arch_of",
           "attention_class", "choose", "choose_by", "describe", "graph_capture_choices", "lookup", "mlp_class", "needs_backward",
           "norm_class", "timing"]
