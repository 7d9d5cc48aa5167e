"""backend="auto" on CUDA for ops with a torch twin: the measured table, its citations, and the routing.

The table's rows must cite rows that exist in the committed results file, with the medians quoted,
and each choice must be the implementation those rows measured faster. The routing is checked on
CPU by making the ops believe they are on an sm_90 GPU under "auto" (the only two questions they
ask: ``resolve``, ``auto_on_cuda`` and ``dispatch.arch_of``): where the table says torch they return exactly
torch's op, where it says Triton (or the twin does not apply) exactly the Triton kernel's result.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tachyon.kernels import dispatch
from tachyon.kernels.attention import op as attention_op
from tachyon.kernels.attention import reference as attention_reference
from tachyon.kernels.layernorm import op as norm_op

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _table_rows(path: Path) -> list[list[str]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _median(rows: list[list[str]], row: dispatch.Row) -> float:
    """The median_ms cell of the one results row whose leading cells are ``row.cells``."""
    found = [r for r in rows if tuple(r[: len(row.cells)]) == row.cells]
    assert len(found) == 1, f"{row.cells}: {len(found)} rows in the results file"
    return float(found[0][len(row.cells)])  # median_ms follows the identifying cells in both tables


@pytest.mark.parametrize("choice", dispatch.TABLE, ids=lambda c: f"{c.op}-{c.arch}-{c.dtype}-{c.shape_class}")
def test_every_choice_cites_measured_rows_and_picks_the_faster(choice):
    path = RESULTS / choice.results
    assert path.is_file(), f"{choice.results} is not a committed results file"
    rows = _table_rows(path)
    assert choice.evidence, "a choice without evidence"
    for evidence in choice.evidence:
        assert _median(rows, evidence.triton) == evidence.triton.median_ms
        assert _median(rows, evidence.twin) == evidence.twin.median_ms
        faster = dispatch.TRITON if evidence.triton.median_ms < evidence.twin.median_ms else dispatch.TWIN
        assert faster == choice.impl, f"{choice.line()}: {evidence.mode} measured {faster} faster"


def test_triton_is_chosen_only_where_measured():
    triton_rows = [c for c in dispatch.TABLE if c.impl == dispatch.TRITON]
    assert triton_rows and all(c.evidence for c in triton_rows)
    like = torch.empty(0, dtype=torch.bfloat16)
    causal = dispatch.attention_class(True, 2048, 2048, 128)
    assert causal == "causal s<=2048 d128" and dispatch.attention_class(True, 1500, 1500, 128) == causal
    original = dispatch.arch_of
    try:
        dispatch.arch_of = lambda t: "sm_90"
        assert dispatch.choose("attention", like, causal) == dispatch.TRITON
        assert dispatch.choose("attention", like.half(), causal) == dispatch.TWIN  # fp16 not measured
        assert dispatch.choose("attention", like, dispatch.attention_class(True, 4096, 4096, 128)) == dispatch.TWIN
        assert dispatch.choose("layer_norm", like, dispatch.norm_class(1024)) == dispatch.TWIN  # measured slower
        dispatch.arch_of = lambda t: "sm_80"  # nothing measured on it
        assert dispatch.choose("attention", like, causal) == dispatch.TWIN
    finally:
        dispatch.arch_of = original
    assert dispatch.norm_class(1024) == "n<=1024" and dispatch.norm_class(1025) == "n<=2048"


def test_describe_lists_this_gpus_rows_first():
    lines = dispatch.describe("sm_90")
    assert "this GPU is sm_90" in lines[0] and len(lines) == len(dispatch.TABLE) + 2
    assert all("sm_90" in line for line in lines[1:-1])
    assert "nothing measured on it" in dispatch.describe("sm_100")[0]


@pytest.fixture
def on_sm90(monkeypatch):
    """The ops see "auto" on an sm_90 GPU; ``table`` overrides the measured choice per op."""
    table: dict[str, str] = {}
    for module in (norm_op, attention_op):
        real_resolve = module.resolve  # "auto" resolves to Triton on a GPU (here: the interpreter)
        monkeypatch.setattr(module, "resolve", lambda t, backend=None, real=real_resolve:
                            "triton" if backend in (None, "auto") else real(t, backend))
        monkeypatch.setattr(module, "auto_on_cuda", lambda t, backend: backend in (None, "auto"))
    monkeypatch.setattr(dispatch, "arch_of", lambda t: "sm_90")
    real = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda op, t, cls: table.get(op) or real(op, t, cls))
    return table


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(0)
    sum((o.float() * torch.randn_like(o.float())).sum() for o in outs).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_take_torchs_op_where_it_measured_faster(on_sm90, dtype):
    torch.manual_seed(0)
    x, r = torch.randn(6, 64, dtype=dtype), torch.randn(6, 64, dtype=dtype)
    w, b = torch.rand(64, dtype=dtype) + 0.5, torch.randn(64, dtype=dtype)
    got = _grads(lambda x, r, w, b: norm_op.layer_norm(x, w, b, residual=r, return_residual=True), x, r, w, b)
    want = _grads(lambda x, r, w, b: (F.layer_norm(x + r, (64,), w, b, 1e-5), x + r), x, r, w, b)
    for g, e in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    got = _grads(lambda x, w: norm_op.rms_norm(x, w), x, w)
    want = _grads(lambda x, w: F.rms_norm(x, (64,), w, 1e-6), x, w)
    for g, e in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # and the twin agrees with tachyon's reference (the test oracle) to rounding
    ref = norm_op.layer_norm(x, w, b, residual=r, backend="torch")
    torch.testing.assert_close(norm_op.layer_norm(x, w, b, residual=r), ref,
                               **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))


def test_norms_keep_triton_where_measured_faster_or_the_twin_does_not_apply(on_sm90):
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 32, dtype=torch.bfloat16), torch.rand(32, dtype=torch.bfloat16) + 0.5, torch.randn(32)
    triton = norm_op.layer_norm(x, w, b.bfloat16(), backend="triton")
    on_sm90["layer_norm"] = dispatch.TRITON
    assert torch.equal(norm_op.layer_norm(x, w, b.bfloat16()), triton)
    on_sm90.clear()
    assert torch.equal(norm_op.layer_norm(x, w, b.bfloat16()), F.layer_norm(x, (32,), w, b.bfloat16()))  # the twin
    # fp32 parameters with a bf16 input: torch's norm takes one dtype, so the Triton kernel runs
    mixed = norm_op.layer_norm(x, w.float(), b, backend="triton")
    assert torch.equal(norm_op.layer_norm(x, w.float(), b), mixed)
    # an explicit backend is never overridden by the table (which says torch's op for this class)
    assert torch.equal(norm_op.layer_norm(x, w, b.bfloat16(), backend="triton"), triton)
    assert torch.equal(norm_op.layer_norm(x, w, b.bfloat16(), backend="torch"),
                       norm_op.reference.layer_norm(x, w, b.bfloat16())[0])


def test_attention_takes_sdpa_only_without_dropout_and_padding(on_sm90):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    for causal in (False, True):
        got = _grads(lambda q, k, v: attention_op.attention(q, k, v, causal=causal), q, k, v)
        want = _grads(lambda q, k, v: attention_reference.sdpa_attention(q, k, v, causal=causal), q, k, v)
        for g, e in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        torch.testing.assert_close(got[0][0], attention_op.attention(q, k, v, causal=causal, backend="torch"),
                                   rtol=1e-5, atol=1e-5)
    # dropout (tachyon's seeded mask) and padding (fully masked rows give zeros) keep the Triton kernel
    kw = {"dropout_p": 0.25, "seed": 7}
    assert torch.equal(attention_op.attention(q, k, v, **kw), attention_op.attention(q, k, v, backend="triton", **kw))
    bias = torch.zeros(1, 16)
    bias[:, -3:] = float("-inf")
    assert torch.equal(attention_op.attention(q, k, v, key_padding_bias=bias),
                       attention_op.attention(q, k, v, key_padding_bias=bias, backend="triton"))
    on_sm90["attention"] = dispatch.TRITON  # measured faster: the kernel
    assert torch.equal(attention_op.attention(q, k, v), attention_op.attention(q, k, v, backend="triton"))
