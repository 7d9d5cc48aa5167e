"""What ``backend="auto"`` runs on a CUDA tensor, for ops that have a torch twin: chosen by measurement.

Some of tachyon's ops have a torch implementation with the same contract on a GPU: the norms
(``F.layer_norm`` / ``F.rms_norm``, after the residual add) and attention without dropout or
padding (``F.scaled_dot_product_attention``, which picks flash / cuDNN / efficient itself). For
those, ``backend="auto"`` on CUDA runs tachyon's Triton kernel only where a committed GPU result
shows it faster than the torch twin for that op, GPU architecture, dtype and shape class; everywhere
else, the torch twin. Each choice cites the rows of the results file it comes from (both medians
of the same run); ``tachyon info`` prints the table, and a CPU test checks every citation against
the file. The way torch's SDPA and Transformer Engine pick an attention backend (a support matrix
and a preference order) is the model; the preference here comes from measurements.

``backend="triton"`` and ``backend="torch"`` are not affected: they still mean the Triton kernel
and the PyTorch reference (the test oracle). Ops without a torch twin of the same contract
(attention with dropout, whose mask is tachyon's seeded one; packed QKV with bias and rotary; the
fused layers, which choose once per layer) keep Triton under "auto" on CUDA.

What the torch twin gives up: ``invertible=True`` norms save what torch saves (the norm input, not
the output), and attention's fully masked rows are whatever SDPA gives (the twin is used only
without a padding bias, where no row is fully masked unless causal with seq_q > seq_k, which also
stays on Triton).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

TRITON, TWIN = "triton", "torch"  # a choice: the Triton kernel, or the op's torch twin


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a committed results table: its leading cells (enough to find it) and its median (ms)."""

    cells: tuple[str, ...]
    median_ms: float


@dataclasses.dataclass(frozen=True)
class Evidence:
    """The Triton kernel's row and the torch twin's row for one mode, from the same run."""

    mode: str  # "fwd" / "fwd+bwd"
    triton: Row
    twin: Row


@dataclasses.dataclass(frozen=True)
class Choice:
    op: str
    arch: str  # "sm_90": torch.cuda.get_device_capability as sm_<major><minor>
    dtype: str  # torch dtype name without the "torch." prefix
    shape_class: str  # see norm_class / attention_class
    impl: str  # TRITON or TWIN
    results: str  # the results file under benchmarks/results/ the evidence comes from
    evidence: tuple[Evidence, ...]

    def line(self) -> str:
        measured = "; ".join(f"{e.mode} triton {e.triton.median_ms:g} ms vs torch {e.twin.median_ms:g} ms"
                             for e in self.evidence)
        return (f"{self.op:<10} {self.arch} {self.dtype:<8} {self.shape_class:<28} -> {self.impl:<6} "
                f"({measured}; {self.results})")


def norm_class(n: int) -> str:
    """Norms by row width: the power-of-two bucket that holds it (one Triton block per row)."""
    return f"n<={max(1, 1 << (int(n) - 1).bit_length())}"


def attention_class(causal: bool, seq_q: int, seq_k: int, head_dim: int) -> str:
    """Attention without dropout or padding, by mask, the longer sequence's power-of-two bucket and head dim."""
    seq = max(int(seq_q), int(seq_k), 1)
    return f"{'causal' if causal else 'full'} s<={1 << (seq - 1).bit_length()} d{int(head_dim)}"


_H200 = "2026-11-27-h200-first-gpu-run.md"


def _norm_rows(op: str, dtype: str, shape: str, triton: tuple[float, float], twin: tuple[float, float]):
    return tuple(Evidence(mode, Row((op, dtype, shape, "tachyon", mode), t), Row((op, dtype, shape, "torch", mode), c))
                 for mode, t, c in zip(("fwd", "fwd+bwd"), triton, twin))


def _attention_rows(shape: str, dims: str, causal: str, triton: tuple[float, float], twin: tuple[float, float]):
    return tuple(Evidence(mode, Row((shape, dims, causal, "bfloat16", "tachyon", mode), t),
                          Row((shape, dims, causal, "bfloat16", "sdpa-flash", mode), c))
                 for mode, t, c in zip(("fwd", "fwd+bwd"), triton, twin))


# The measured choices. H200 (sm_90), eager timing (triton.testing.do_bench), M = 4096 rows for the norms.
TABLE: tuple[Choice, ...] = (
    Choice("layer_norm", "sm_90", "float16", norm_class(1024), TWIN, _H200,
           _norm_rows("layernorm", "float16", "4096x1024", (0.07434, 0.8466), (0.01578, 0.1156))),
    Choice("layer_norm", "sm_90", "float16", norm_class(4096), TWIN, _H200,
           _norm_rows("layernorm", "float16", "4096x4096", (0.08518, 1.015), (0.03414, 0.2117))),
    Choice("layer_norm", "sm_90", "bfloat16", norm_class(1024), TWIN, _H200,
           _norm_rows("layernorm", "bfloat16", "4096x1024", (0.08214, 0.687), (0.0153, 0.1134))),
    Choice("layer_norm", "sm_90", "bfloat16", norm_class(4096), TWIN, _H200,
           _norm_rows("layernorm", "bfloat16", "4096x4096", (0.07901, 0.8829), (0.03493, 0.1105))),
    Choice("rms_norm", "sm_90", "float16", norm_class(1024), TWIN, _H200,
           _norm_rows("rmsnorm", "float16", "4096x1024", (0.1029, 0.769), (0.01104, 0.09568))),
    Choice("rms_norm", "sm_90", "float16", norm_class(4096), TWIN, _H200,
           _norm_rows("rmsnorm", "float16", "4096x4096", (0.06003, 0.9696), (0.0273, 0.2068))),
    Choice("rms_norm", "sm_90", "bfloat16", norm_class(1024), TWIN, _H200,
           _norm_rows("rmsnorm", "bfloat16", "4096x1024", (0.05213, 0.6963), (0.01178, 0.07091))),
    Choice("rms_norm", "sm_90", "bfloat16", norm_class(4096), TWIN, _H200,
           _norm_rows("rmsnorm", "bfloat16", "4096x4096", (0.05762, 0.4717), (0.02806, 0.09683))),
    Choice("attention", "sm_90", "bfloat16", attention_class(False, 512, 512, 64), TWIN, _H200,
           _attention_rows("bert", "16,16,16,512,64", "False", (0.09107, 1.076), (0.07344, 0.344))),
    Choice("attention", "sm_90", "bfloat16", attention_class(True, 2048, 2048, 128), TRITON, _H200,
           _attention_rows("gpt-causal", "4,32,32,2048,128", "True", (0.3665, 1.5), (0.4823, 2.052))),
)

_BY_KEY = {(c.op, c.arch, c.dtype, c.shape_class): c for c in TABLE}
if len(_BY_KEY) != len(TABLE):
    raise RuntimeError("tachyon.kernels.dispatch: two table rows for one (op, arch, dtype, shape class)")


@functools.cache
def _arch_of_index(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def arch_of(tensor: torch.Tensor) -> str:
    """The GPU architecture of a CUDA tensor's device, as "sm_<major><minor>"."""
    return _arch_of_index(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def lookup(op: str, arch: str, dtype: torch.dtype, shape_class: str) -> Choice | None:
    """The measured choice for this op, architecture, dtype and shape class, or None (not measured)."""
    return _BY_KEY.get((op, arch, str(dtype).removeprefix("torch."), shape_class))


def choose(op: str, tensor: torch.Tensor, shape_class: str) -> str:
    """TRITON where the table says the kernel measured faster here, else TWIN (measured slower, or not measured)."""
    choice = lookup(op, arch_of(tensor), tensor.dtype, shape_class)
    return TRITON if choice is not None and choice.impl == TRITON else TWIN


def describe(arch: str | None = None) -> list[str]:
    """``tachyon info``'s lines: every measured choice (this GPU's first when ``arch`` is given)."""
    rows = sorted(TABLE, key=lambda c: (c.arch != arch, c.op, c.arch, c.dtype, c.shape_class))
    head = ("backend 'auto' on CUDA, ops with a torch twin (norms; attention without dropout or padding): the Triton "
            "kernel only where measured faster, else torch")
    if arch is not None:
        head += f"; this GPU is {arch}" + ("" if any(c.arch == arch for c in TABLE) else " (nothing measured on it: torch)")
    return [head, *(f"  {c.line()}" for c in rows), "  anything not listed: torch (not measured)"]


__all__ = ["TABLE", "TRITON", "TWIN", "Choice", "Evidence", "Row", "arch_of", "attention_class", "choose",
           "describe", "lookup", "norm_class"]
