"""Launch shapes and the one-launch partial-sum reduction (kernels/tiling.py)."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels import tiling
from tachyon.kernels.layernorm import layer_norm
from tests.utils.asserts import assert_close

CPU = torch.device("cpu")


def test_row_programs_fill_the_gpu_then_add_programs_only_while_each_sums_enough_rows(monkeypatch):
    assert tiling.row_programs(5, CPU, 8) == 5 and tiling.row_programs(500, CPU, 8) == 8  # interpreter
    monkeypatch.setattr(tiling, "INTERPRETER_AS_SMS", 132)  # an H100's grid
    assert tiling.row_programs(50, CPU, 8) == 50  # fewer rows than SMs: one row each
    assert tiling.row_programs(512, CPU, 8) == 132  # one per SM (not 512 one-row partial sums)
    assert tiling.row_programs(4096, CPU, 8) == 512  # 8 rows each
    assert tiling.row_programs(10**6, CPU, 8) == 4 * 132  # at most 4 per SM


def test_row_split_fills_the_gpu_and_keeps_partial_rows_few(monkeypatch):
    assert tiling.row_split(512, 4, 4, CPU) == (1, 512)  # interpreter: 4 programs in all
    monkeypatch.setattr(tiling, "INTERPRETER_AS_SMS", 132)
    assert tiling.row_split(512, 4, 4, CPU) == (64, 8)  # 8 rows each; 256 programs fill 132 SMs
    assert tiling.row_split(64, 4, 4, CPU) == (16, 4)  # too few rows to keep 8 each: fill the SMs
    assert tiling.row_split(10**6, 4, 4, CPU)[0] == 8 * 132 // 4  # at most 8 programs per SM


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("shape", [(1, 5), (7, 100), (33, 1500)], ids=["1x5", "7x100", "33x1500"])
def test_sum_partials_sums_each_group_in_fp32_into_its_dtype(shape, groups):
    p, n = shape
    part = torch.randn(p, groups * n)
    dtypes = [torch.float32, torch.bfloat16, torch.float16][:groups]
    outs = tiling.sum_partials(part, dtypes)
    for g, (out, dtype) in enumerate(zip(outs, dtypes)):
        want = part[:, g * n:(g + 1) * n].double().sum(0)
        assert out.dtype == dtype and out.shape == (n,)
        assert_close(out.double(), want.to(dtype).double(), dtype=dtype, name=f"group {g}")


def test_sum_partials_refuses_a_shape_it_cannot_split():
    with pytest.raises(ValueError, match=r"part \[P, G \* n\] with G in 1..3 groups; got shape \(2, 7\), G=2"):
        tiling.sum_partials(torch.zeros(2, 7), [torch.float32, torch.float32])


def test_norm_backward_with_a_gpu_grid_gives_the_same_gradients(monkeypatch):
    """Under an H100's grid (more programs, more partial rows) the LayerNorm gradients match the
    interpreter's small grid within the fp32 table (sums in another order)."""
    x, w, b = torch.randn(300, 64, requires_grad=True), torch.randn(64, requires_grad=True), torch.randn(64)
    b.requires_grad_()
    dy = torch.randn(300, 64)
    small = torch.autograd.grad(layer_norm(x, w, b, backend="triton"), (x, w, b), dy)
    monkeypatch.setattr(tiling, "INTERPRETER_AS_SMS", 132)
    big = torch.autograd.grad(layer_norm(x, w, b, backend="triton"), (x, w, b), dy)
    for name, a, c in zip(("dx", "dweight", "dbias"), big, small):
        assert_close(a, c, name=name)


def _reductions(seed: int) -> list[tuple[torch.Tensor, list[torch.dtype]]]:
    """Seven partial-sum buffers of different rows, widths and groups (a layer backward's mix)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 1, 64), (12, 2, 64), (3, 3, 40), (9, 1, 256), (1, 1, 7), (20, 2, 33), (4, 1, 1500)]
    kinds = [torch.float32, torch.bfloat16, torch.float16]
    return [(torch.randn(p, g * n, generator=gen), kinds[:g]) for p, g, n in shapes]


@pytest.mark.parametrize("sms", [None, 132], ids=["interpreter grid", "H100 grid"])
@pytest.mark.parametrize("count", [2, 5, 7])
def test_deferred_sums_give_each_reduction_the_bits_of_its_own_launch(monkeypatch, sms, count):
    """Inside deferred_sums the reductions are queued and launched together (five per launch, so
    seven take two); each output equals, bit for bit, what sum_partials launched alone gives, and
    nothing is written before the block ends."""
    monkeypatch.setattr(tiling, "INTERPRETER_AS_SMS", sms)
    cases = _reductions(0)[:count]
    alone = [tiling.sum_partials(part, dtypes) for part, dtypes in cases]
    launched = []
    real = tiling._sum_segments
    monkeypatch.setattr(tiling, "_sum_segments", lambda segments: (launched.append(len(segments)), real(segments)))
    with tiling.deferred_sums():
        together = [tiling.sum_partials(part, dtypes) for part, dtypes in cases]
        assert launched == []  # queued, not launched
        for outs in together:
            for out in outs:
                out.fill_(float("nan"))  # unwritten until the block ends: the kernel overwrites every element
    assert launched == [min(count, 5)] + ([count - 5] if count > 5 else [])
    for (part, dtypes), want, got in zip(cases, alone, together):
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and torch.equal(g, w), (tuple(part.shape), dtypes)


def test_deferred_sums_launch_nothing_on_an_exception_and_nest(monkeypatch):
    launched = []
    monkeypatch.setattr(tiling, "_sum_segments", lambda segments: launched.append(len(segments)))
    part = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="inside"):
        with tiling.deferred_sums():
            tiling.sum_partials(part, [torch.float32])
            raise RuntimeError("inside")
    assert launched == [] and tiling._deferred.queue is None
    with tiling.deferred_sums():
        tiling.sum_partials(part, [torch.float32])
        with tiling.deferred_sums():  # an inner block flushes its own queue at its end
            tiling.sum_partials(part, [torch.float32])
            tiling.sum_partials(part, [torch.float32])
        assert launched == [2]
    assert launched == [2, 1] and tiling._deferred.queue is None


def test_immediate_sums_inside_deferred_sums_launch_at_once(monkeypatch):
    """Code that reads its sums before returning them (Triton's interpreter casting bf16 attention's
    fp32 bias gradient) runs them at once inside a deferred block; the rest still waits."""
    part = torch.randn(6, 40)
    want = tiling.sum_partials(part, [torch.float32])[0]
    with tiling.deferred_sums():
        late = tiling.sum_partials(part, [torch.float32])[0].fill_(float("nan"))
        with tiling.immediate_sums():
            now = tiling.sum_partials(part, [torch.float32])[0]
        assert torch.equal(now, want)  # written before the deferred block ends
        assert bool(late.isnan().all())
    assert torch.equal(late, want)
