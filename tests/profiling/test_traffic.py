"""TrafficCounter: exact byte and launch counts on small cases whose answer is known by hand."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tachyon.kernels.dropout import bias_dropout_add
from tachyon.kernels.dropout import reference as dropout_reference
from tachyon.kernels.layernorm import layer_norm
from tachyon.kernels.layernorm import triton as ln_triton
from tachyon.profiling import TrafficCounter, count_traffic
from tachyon.profiling.traffic import Traffic

F32 = 4


def _only(counter: TrafficCounter):
    assert len(counter.events) == 1, f"expected one counted op, got {[e.label for e in counter.events]}"
    return counter.events[0]


def test_layernorm_kernel_with_a_masked_tail_counts_active_lanes_once():
    """[5, 100] rows in a 128-wide block: 28 masked lanes per row move nothing; weight and bias
    are read by every row (requested 5x) but are 100 distinct elements each."""
    m, n = 5, 100
    x, w, b = torch.randn(m, n), torch.randn(n), torch.randn(n)
    with TrafficCounter() as counter:
        ln_triton.norm_fwd(x, w, b, None, 1e-5, False)
    event = _only(counter)
    assert event.op == "triton _norm_fwd_kernel" and event.scope == ()
    expected = Traffic(
        read=(m * n + 2 * n) * F32,           # x, weight, bias
        written=(m * n + 2 * m) * F32,        # y, mean, rstd
        launches=1,
        requested_read=(m * n + 2 * m * n) * F32,  # weight and bias once per row
        requested_written=(m * n + 2 * m) * F32,
    )
    assert event.traffic == expected, f"{event.traffic} != {expected}"


@triton.jit
def _reread_kernel(X, Y, ACC, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(X + offs, mask=mask, other=0.0)
    a += tl.load(X + offs, mask=mask, other=0.0)  # the same addresses again: requested, not compulsory
    tl.store(Y + offs, a, mask=mask)
    tl.atomic_add(ACC + offs, a, mask=mask)  # read-modify-write: read and written


def test_rereads_count_as_requested_and_atomics_as_read_and_write():
    n = 37
    x, y, acc = torch.randn(n), torch.empty(n), torch.zeros(n)
    with TrafficCounter() as counter:
        _reread_kernel[(1,)](x, y, acc, n, BLOCK=64)
    t = _only(counter).traffic
    assert (t.read, t.written, t.launches) == (2 * n * F32, 2 * n * F32, 1), t  # x and acc; y and acc
    assert (t.requested_read, t.requested_written) == (3 * n * F32, 2 * n * F32), t


def test_one_launch_per_grid_whatever_the_number_of_programs():
    m, n = 9, 16
    x, w = torch.randn(m, n), torch.randn(n)
    counter = count_traffic(ln_triton.norm_fwd, x, w, None, None, 1e-5, True)
    assert counter.total.launches == 1
    assert counter.total.read == (m * n + n) * F32 and counter.total.written == (m * n + 2 * m) * F32


def test_gemm_reads_its_operands_and_writes_its_result():
    a, b, bias = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4)
    counter = count_traffic(torch.mm, a, b)
    event = _only(counter)
    assert event.op == "aten.mm.default"
    assert (event.traffic.read, event.traffic.written, event.traffic.launches) == ((8 * 16 + 16 * 4) * F32, 8 * 4 * F32, 1)
    # F.linear on a 2-d input is one addmm: the bias [4] broadcast over rows is read once
    counter = count_traffic(torch.nn.functional.linear, a, b.t(), bias)
    event = _only(counter)
    assert event.op == "aten.addmm.default"
    assert (event.traffic.read, event.traffic.written) == ((8 * 16 + 16 * 4 + 4) * F32, 8 * 4 * F32)
    assert counter.result.shape == (8, 4)


def test_a_view_chain_moves_nothing():
    x = torch.randn(2, 3, 4, 5)

    def views(t):
        t = t.view(6, 20).view(2, 3, 4, 5).permute(0, 2, 1, 3).transpose(1, 2).unsqueeze(0).squeeze(0)
        t = t.select(0, 1).narrow(0, 0, 2).expand(3, 2, 4, 5).detach()
        return t[..., 1:].unbind(0)[0]

    counter = count_traffic(views, x)
    assert counter.events == [], [e.label for e in counter.events]
    assert counter.total == Traffic()
    assert counter.result.data_ptr() != 0  # the chain ran


def test_in_place_factories_copies_and_broadcasts():
    x, y = torch.randn(10, 8), torch.randn(10, 8)
    row = torch.randn(8)
    n = 80 * F32
    cases = {
        "add_": (lambda: x.add_(y), 2 * n, n),            # reads x and y, writes x
        "zero_": (lambda: x.zero_(), 0, n),               # writes only
        "copy_": (lambda: x.copy_(y), n, n),              # reads the source only
        "zeros_like": (lambda: torch.zeros_like(x), 0, n),  # the shape of x, not its values
        "broadcast": (lambda: x + row, n + 8 * F32, n),   # the [8] row is read once
        "same input twice": (lambda: x * x, n, n),
        "clone of a transpose": (lambda: x.t().contiguous(), n, n),
    }
    for name, (fn, read, written) in cases.items():
        t = count_traffic(fn).total
        assert (t.read, t.written, t.launches) == (read, written, 1), f"{name}: {t}"
    item = count_traffic(lambda: x[0, 0].item()).total  # a copy to the host: bytes, no launch
    assert (item.read, item.written, item.launches) == (F32, 0, 0)


def test_a_row_gather_reads_the_rows_it_picks():
    """embedding / index_select read their indices and the distinct rows picked (3 of 50 here,
    one picked twice), not the whole table."""
    table, ids = torch.randn(50, 16), torch.tensor([[4, 9], [4, 31]])
    for fn in (lambda: torch.nn.functional.embedding(ids, table), lambda: table.index_select(0, ids.flatten())):
        t = count_traffic(fn).total
        assert (t.read, t.written, t.launches) == (4 * 8 + 3 * 16 * F32, 4 * 16 * F32, 1), t
    t = count_traffic(lambda: table.index_select(1, torch.tensor([0, 2]))).total  # columns: the whole table
    assert t.read == 50 * 16 * F32 + 2 * 8, t


def test_a_custom_op_is_counted_by_what_runs_inside_it_and_never_twice():
    """The torch backend of bias_dropout_add runs the PyTorch reference inside the custom op: the
    counter sees exactly the reference's ops (as if called directly), and nothing for the op's own
    inputs and outputs; on the Triton backend, exactly one kernel."""
    x, bias, res = torch.randn(6, 32), torch.randn(32), torch.randn(6, 32)
    inside = count_traffic(bias_dropout_add, x, bias, res, 0.1, 7, backend="torch")
    direct = count_traffic(dropout_reference.bias_dropout_add_forward, x, bias, res, 0.1, 7)
    assert [e.label for e in inside.events] == [f"tachyon::bias_dropout_add_fwd > {e.op}" for e in direct.events]
    assert inside.total == direct.total and inside.total.launches > 1
    assert torch.equal(inside.result, direct.result)
    triton_path = count_traffic(bias_dropout_add, x, bias, res, 0.1, 7, backend="triton")
    event = _only(triton_path)
    assert event.label == "tachyon::bias_dropout_add_fwd > triton _bda_fwd_kernel"
    assert (event.traffic.read, event.traffic.written) == ((2 * 6 * 32 + 32) * F32, 6 * 32 * F32)


def test_forward_backward_and_modules():
    """LayerNorm module forward + backward on the Triton backend: each phase and module counted,
    gradients of unused outputs (mean, rstd) are never zero-filled."""
    m, n = 4, 24
    x = torch.randn(m, n, requires_grad=True)
    w, b = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
    dy = torch.randn(m, n)

    class Norm(torch.nn.Module):
        def forward(self, t):
            return layer_norm(t, w, b, backend="triton")

    model = torch.nn.Sequential(Norm())
    with TrafficCounter() as counter:
        out = model(x)
        out.backward(dy)
    labels = [(e.backward, e.label) for e in counter.events]
    assert labels == [
        (False, "tachyon::norm_fwd > triton _norm_fwd_kernel"),
        (True, "tachyon::norm_bwd > triton _norm_bwd_kernel"),
        (True, "tachyon::norm_bwd > triton _sum_partials_kernel"),
    ], labels
    fwd, bwd = counter.phase(False), counter.phase(True)
    assert fwd.launches == 1 and bwd.launches == 2
    # backward: dy, x, weight, bias, mean, rstd in; dx and one fp32 partial row per program (one
    # program per row here: 4 rows) out; then the partials in, dweight and dbias out
    assert bwd.read == (2 * m * n + 2 * n + 2 * m) * F32 + 2 * m * n * F32
    assert bwd.written == m * n * F32 + 2 * m * n * F32 + 2 * n * F32
    assert list(counter.by_op()) == [f"{'bwd' if b else 'fwd'} {label}" for b, label in labels]
    assert "total" in counter.table()
    # modules: the forward is Sequential.0's; its backward is too once the gradient reaches its
    # output through another op (backward() started from the output itself is Global only)
    assert counter.by_module()["Sequential.0"] == fwd and counter.by_module()["Global"] == counter.total
    with TrafficCounter() as counter:
        (model(x) * dy).sum().backward()
    norm_events = [e for e in counter.events if e.label.startswith("tachyon::norm")]
    assert len(norm_events) == 3 and all("Sequential.0" in e.modules for e in norm_events), \
        [(e.label, e.modules) for e in norm_events]


def test_module_tracking_does_not_change_the_counts():
    """A module that returns a parameter (TE's return_bias): a gradient hook on it would make
    AccumulateGrad copy its gradient; the counter's module tracking hooks no leaf tensor."""

    class ReturnsBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 8))
            self.bias = torch.nn.Parameter(torch.randn(8))

        def forward(self, t):
            return t @ self.weight, self.bias

    module, x = ReturnsBias(), torch.randn(4, 8, requires_grad=True)
    totals = []
    for track in (True, False):
        module.zero_grad(set_to_none=True)
        x.grad = None
        with TrafficCounter(track_modules=track) as counter:
            y, b = module(x)
            (y + b).sum().backward()
        assert not [e.op for e in counter.events if "copy" in e.op or "clone" in e.op], counter.table()
        totals.append(counter.total)
    assert totals[0] == totals[1]


def test_bad_input_and_compiled_launches():
    with pytest.raises(ValueError, match="count_traffic: fn must be callable; got int"):
        count_traffic(3)
    from tachyon.profiling.traffic_triton import refuse_compiled_launches
    from triton.runtime.jit import JITFunction

    def kernel(x):
        pass

    undo = refuse_compiled_launches("counted only under the interpreter")
    try:
        with pytest.raises(RuntimeError, match="counted only under the interpreter"):
            JITFunction(kernel).run(grid=(1,), warmup=False)
    finally:
        undo()


def test_host_tensors_are_not_kernels():
    step, x = torch.tensor(0.0), torch.randn(8)
    with TrafficCounter(host_tensors=[step]) as counter:
        step += 1                        # a GPU run does this on the host
        step.add_(torch.tensor(1.0))     # host tensor with a 0-dim scalar beside it: host work too
        x.mul_(step)                     # touches a device tensor: a kernel
    assert [e.op for e in counter.events] == ["aten.mul_.Tensor"]
    assert counter.total.read == 8 * F32 + F32 and counter.total.written == 8 * F32


@pytest.mark.parametrize("tensors", [3, 19], ids=["one-launch", "two-launches"])
def test_fused_adam_step_moves_exactly_its_minimum(tensors):
    """Read param, grad and both moments, write param and both moments, and nothing else: the
    pointers, sizes and step scalars are kernel arguments (no table in memory). One launch per
    MAX_TENSORS tensors."""
    from tachyon.kernels.adam import multi_tensor_adam
    from tachyon.kernels.adam import triton as adam_triton
    from tachyon.profiling.traffic_minimum import adam_minimum

    numels = ([5000, 37, 4096] * 7)[:tensors]
    params = [torch.randn(n) for n in numels]
    grads, ms = ([torch.randn(n) for n in numels] for _ in range(2))
    vs = [torch.rand(n) for n in numels]  # second moments are >= 0

    def step():
        multi_tensor_adam(params, grads, ms, vs, [2] * tensors, weight_decay=0.01, backend="triton")

    counter = count_traffic(step)
    launches = -(-tensors // adam_triton.MAX_TENSORS)
    assert [e.label for e in counter.events] == ["tachyon::adam_step > triton _adam_kernel"] * launches
    minimum = adam_minimum(numels)
    assert counter.total.written == minimum.steps[0].written
    assert counter.total.read == minimum.steps[0].read
    assert counter.total.launches == launches
