"""backend="auto" on CUDA for ops with a torch twin: the measured table, its citations, and the routing.

The table's rows must cite rows that exist in the committed results file, with the medians quoted,
and each choice must be the implementation those rows measured faster. The routing is checked on
CPU by making the ops believe they are on an sm_90 GPU under "auto" (the only two questions they
ask: ``resolve``, ``auto_on_cuda`` and ``dispatch.arch_of``): where the table says torch they return exactly
torch's op, where it says Triton (or the twin does not apply) exactly the Triton kernel's result.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tachyon.kernels import dispatch
from tachyon.kernels.attention import op as attention_op
from tachyon.kernels.attention import reference as attention_reference
from tachyon.kernels.layernorm import op as norm_op

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _tables(path: Path) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table in the file: (header cells, body rows)."""
    tables, header, body = [], None, []
    for line in path.read_text().splitlines() + [""]:
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if set(line) <= set("|- "):
                continue
            if header is None:
                header = cells
            else:
                body.append(cells)
        elif header is not None:
            tables.append((header, body))
            header, body = None, []
    return tables


def _cited(path: Path, row: dispatch.Row) -> dict[str, float]:
    """The timing cells (by column name) of the one results row whose leading cells are ``row.cells``."""
    found = [(header, r) for header, body in _tables(path) for r in body if tuple(r[: len(row.cells)]) == row.cells]
    assert len(found) == 1, f"{row.cells}: {len(found)} rows in {path.name}"
    header, cells = found[0]
    return {name: float(cells[header.index(name)]) for name in ("median_ms", "p20_ms", "p80_ms", "graph_ms")}


@pytest.mark.parametrize("choice", dispatch.TABLE, ids=lambda c: f"{c.op}-{c.arch}-{c.dtype}-{c.shape_class}")
def test_every_choice_cites_measured_rows_and_picks_the_clearly_faster(choice):
    path = RESULTS / choice.results
    assert path.is_file(), f"{choice.results} is not a committed results file"
    assert sorted(e.mode for e in choice.evidence) == [dispatch.FWD, dispatch.FWD_BWD]
    for evidence in choice.evidence:
        kernel, twin = _cited(path, evidence.triton), _cited(path, evidence.twin)
        for row, cells in ((evidence.triton, kernel), (evidence.twin, twin)):
            assert (row.median_ms, row.p20_ms, row.p80_ms, row.graph_ms) == (
                cells["median_ms"], cells["p20_ms"], cells["p80_ms"], cells["graph_ms"]), row.cells
        # the rule, from the file's numbers: eager only without overlap, graphed by 3% or more
        eager = dispatch.TRITON if kernel["p80_ms"] < twin["p20_ms"] else dispatch.TWIN
        graph = dispatch.TRITON if kernel["graph_ms"] < 0.97 * twin["graph_ms"] else dispatch.TWIN
        assert choice.impl(evidence.mode, dispatch.EAGER) == eager, choice.line()
        assert choice.impl(evidence.mode, dispatch.GRAPH) == graph, choice.line()


def test_the_choice_depends_on_the_calls_mode_and_timing():
    like = torch.empty(0, dtype=torch.bfloat16)
    bert, gpt = dispatch.attention_class(False, 512, 512, 64), dispatch.attention_class(True, 2048, 2048, 128)
    assert gpt == "causal s<=2048 d128" and dispatch.attention_class(True, 1500, 1500, 128) == gpt
    original = dispatch.arch_of
    try:
        dispatch.arch_of = lambda t: "sm_90"
        # H100: the kernel's GPU time is lower, its eager fwd+bwd (host-bound) higher than SDPA's
        assert dispatch.choose("attention", like, bert, backward=False) == dispatch.TRITON
        assert dispatch.choose("attention", like, bert, backward=True) == dispatch.TWIN
        assert dispatch.choose("attention", like, gpt, backward=True) == dispatch.TRITON
        ln = dispatch.norm_class(1024)
        assert dispatch.choose("layer_norm", like, ln, backward=True) == dispatch.TWIN
        assert dispatch.choose("layer_norm", like, ln, backward=False) == dispatch.TWIN
        assert dispatch.timing() == dispatch.EAGER
        with dispatch.graph_capture_choices():
            assert dispatch.timing() == dispatch.GRAPH
            assert dispatch.choose("layer_norm", like, ln, backward=True) == dispatch.TRITON
            assert dispatch.choose("attention", like, bert, backward=True) == dispatch.TRITON
            assert dispatch.choose("attention", like.half(), gpt, backward=True) == dispatch.TWIN  # not measured
        assert dispatch.timing() == dispatch.EAGER
        assert dispatch.choose("attention", like, dispatch.attention_class(True, 4096, 4096, 128), True) == dispatch.TWIN
        dispatch.arch_of = lambda t: "sm_80"  # nothing measured on it
        assert dispatch.choose("attention", like, gpt, backward=True) == dispatch.TWIN
        with dispatch.graph_capture_choices():
            assert dispatch.choose("layer_norm", like, ln, backward=True) == dispatch.TWIN
    finally:
        dispatch.arch_of = original
    assert dispatch.norm_class(1024) == "n<=1024" and dispatch.norm_class(1025) == "n<=2048"


def test_needs_backward_follows_grad_mode_and_requires_grad():
    a, b = torch.ones(2), torch.ones(2, requires_grad=True)
    assert not dispatch.needs_backward(a, None) and dispatch.needs_backward(a, b)
    with torch.no_grad():
        assert not dispatch.needs_backward(a, b)


def test_describe_lists_this_gpus_rows_first():
    lines = dispatch.describe("sm_90")
    assert "this GPU is sm_90" in lines[0] and len(lines) == len(dispatch.TABLE) + 2
    assert all("sm_90" in line and "fwd+bwd/graph=" in line for line in lines[1:-1])
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
    monkeypatch.setattr(dispatch, "choose", lambda op, t, cls, backward: table.get(op) or real(op, t, cls, backward))
    monkeypatch.setattr(dispatch, "_CHOICES", _Unremembered())  # the tests change ``table`` between calls
    return table


class _Unremembered(dict):
    """A choose_by cache that keeps nothing: every call asks choose (the fixtures' overridden table)."""

    def __setitem__(self, key, value) -> None:
        pass


def test_choose_by_remembers_each_calls_choice_and_asks_again_for_a_new_architecture(monkeypatch):
    asked = []
    monkeypatch.setattr(dispatch, "arch_of", lambda t: asked.append(t) or "sm_90")
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    x = torch.empty(3, 1024, dtype=torch.bfloat16)
    eager = dispatch.choose_by("layer_norm", x, dispatch.norm_class, (1024,), True)
    assert eager == dispatch.TWIN and len(asked) == 1  # the measured table: torch's op eagerly
    assert dispatch.choose_by("layer_norm", x, dispatch.norm_class, (1024,), True) == eager and len(asked) == 1
    with dispatch.graph_capture_choices():  # graph timing is part of the key: the kernel there
        assert dispatch.choose_by("layer_norm", x, dispatch.norm_class, (1024,), True) == dispatch.TRITON
    assert len(asked) == 2
    for args, backward, dtype in (((1024,), False, torch.bfloat16), ((512,), True, torch.bfloat16),
                                  ((1024,), True, torch.float16)):  # each fact a key of its own, as choose says
        y = x.to(dtype)
        assert dispatch.choose_by("layer_norm", y, dispatch.norm_class, args, backward) == \
            dispatch.choose("layer_norm", y, dispatch.norm_class(*args), backward)
    monkeypatch.setattr(dispatch, "arch_of", lambda t: "sm_80")  # nothing measured there: asked again, the twin
    assert dispatch.choose_by("rms_norm", x.half(), dispatch.norm_class, (1024,), False) == dispatch.TWIN


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


def test_norms_follow_the_measured_table_by_mode_and_timing(on_sm90):
    """The real table (no override): bf16 LayerNorm at width 1024 takes torch's op eagerly and the kernel
    under graph_capture_choices; fp16 RMSNorm at width 1024 takes the kernel for a forward alone."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 1024, dtype=torch.bfloat16), torch.rand(1024, dtype=torch.bfloat16) + 0.5, \
        torch.randn(1024, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    twin, kernel = F.layer_norm(x, (1024,), w, b), norm_op.layer_norm(x, w, b, backend="triton")
    assert not torch.equal(twin, kernel)  # the two implementations are told apart by their rounding
    assert torch.equal(norm_op.layer_norm(xg, w, b), twin)
    with dispatch.graph_capture_choices():
        assert torch.equal(norm_op.layer_norm(xg, w, b), kernel)
    xh, wh = x.half(), w.half()
    assert torch.equal(norm_op.rms_norm(xh, wh), norm_op.rms_norm(xh, wh, backend="triton"))  # forward alone
    assert torch.equal(norm_op.rms_norm(xh.requires_grad_(True), wh), F.rms_norm(xh, (1024,), wh, 1e-6))


@pytest.fixture
def mlp_on_sm90(monkeypatch, on_sm90):
    """As on_sm90, for the MLP block's GEMM backend choice too."""
    mlp_op = importlib.import_module("tachyon.kernels.linear.mlp")  # the package exports the function

    real_resolve = mlp_op.resolve
    monkeypatch.setattr(mlp_op, "resolve", lambda t, backend=None: "triton" if backend in (None, "auto")
                        else real_resolve(t, backend))
    monkeypatch.setattr(mlp_op, "auto_on_cuda", lambda t, backend: backend in (None, "auto"))
    return on_sm90


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_mlp_takes_cublas_and_the_activation_kernel_where_measured_faster(mlp_on_sm90, activation, checkpoint):
    from tachyon.kernels.activation import triton as act_triton

    mlp_op = importlib.import_module("tachyon.kernels.linear.mlp")

    torch.manual_seed(0)
    rows = 48 if activation == "swiglu" else 24
    x, w1, b1 = torch.randn(2, 5, 16), 0.2 * torch.randn(rows, 16), 0.1 * torch.randn(rows)
    w2, b2 = 0.2 * torch.randn(16, 24), 0.1 * torch.randn(16)

    def run(**kw):
        return _grads(lambda *t: mlp_op.mlp(t[0], t[1], t[2], activation, t[3], t[4],
                                            checkpoint_activation=checkpoint, **kw), x, w1, b1, w2, b2)

    mlp_on_sm90["mlp"] = dispatch.TWIN
    got = run()
    want_out = F.linear(act_triton.bias_act_fwd(F.linear(x.view(-1, 16), w1, b1), None, activation), w2, b2)
    assert torch.equal(got[0][0], want_out.view(2, 5, 16))  # exactly the cuBLAS-GEMM + kernel composite
    ref = run(backend="torch")
    for g, e in zip(got[0] + got[1], ref[0] + ref[1]):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    mlp_on_sm90["mlp"] = dispatch.TRITON
    triton = run(backend="triton")
    for g, e in zip(run()[0] + run()[1], triton[0] + triton[1]):
        assert torch.equal(g, e)
    assert mlp_op.gemm_backend(x, "triton", 24, w1) == "triton"  # an explicit backend is never overridden


def test_the_measured_mlp_class_runs_the_twin():
    like = torch.empty(0, dtype=torch.bfloat16)
    cls = dispatch.mlp_class(8192, 1024, 4096)
    assert cls == "m<=8192 k<=1024 f<=4096" and dispatch.mlp_class(5000, 1000, 3000) == cls
    original = dispatch.arch_of
    try:
        dispatch.arch_of = lambda t: "sm_90"
        assert dispatch.choose("mlp", like, cls, backward=True) == dispatch.TWIN
        with dispatch.graph_capture_choices():
            assert dispatch.choose("mlp", like, cls, backward=True) == dispatch.TWIN
    finally:
        dispatch.arch_of = original
