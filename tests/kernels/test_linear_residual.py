"""linear_with_residual: the gradients of x used by a GEMM and a residual branch, with the sum
done by the dX GEMM (one addmm) instead of a GEMM and an add; bad input named."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.linear import linear_with_residual
from tachyon.profiling import TrafficCounter
from tests.utils.asserts import assert_close


def _plain(x, w, r_scale):
    return (x @ w.t()).tanh().sum() + (x * r_scale).sum()


def _fused(x, w, r_scale):
    y, x_res = linear_with_residual(x, w)
    return y.tanh().sum() + (x_res * r_scale).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(5, 7), (2, 9, 13)], ids=["2d", "3d"])
def test_gradients_equal_autograd_of_the_two_uses(shape, dtype):
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    w = torch.randn(11, shape[-1], dtype=dtype, requires_grad=True)
    r_scale = torch.randn(shape[-1], dtype=dtype)
    want = torch.autograd.grad(_plain(x, w, r_scale), (x, w))
    y, x_res = linear_with_residual(x, w)
    assert x_res.data_ptr() == x.data_ptr() and x_res.shape == x.shape, "the residual branch is x itself"
    assert_close(y, x @ w.t(), name="y")
    got = torch.autograd.grad(_fused(x, w, r_scale), (x, w))
    for name, a, b in zip(("dx", "dweight"), got, want):
        assert_close(a, b, name=name)


def test_one_gemm_instead_of_a_gemm_and_an_add():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    r_scale = torch.randn(8)
    counted = {}
    for name, fn in (("plain", _plain), ("fused", _fused)):
        with TrafficCounter() as counter:
            torch.autograd.grad(fn(x, w, r_scale), (x, w))
        counted[name] = [e.op for e in counter.events if e.backward]
    assert "aten.add.Tensor" in counted["plain"] and "aten.addmm.default" not in counted["plain"], counted["plain"]
    assert "aten.add.Tensor" not in counted["fused"] and "aten.addmm.default" in counted["fused"], counted["fused"]
    assert len(counted["fused"]) == len(counted["plain"]) - 1


def test_only_one_branch_used():
    x = torch.randn(3, 5, requires_grad=True)
    w = torch.randn(2, 5, requires_grad=True)
    y, x_res = linear_with_residual(x, w)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert_close(dx, torch.ones(3, 2) @ w.detach(), name="dx (GEMM branch only)")
    y, x_res = linear_with_residual(x, w)
    dx, dw = torch.autograd.grad((x_res * 3).sum(), (x, w), allow_unused=True)
    assert torch.equal(dx, torch.full_like(x, 3.0)) and dw is None


def test_bad_input_names_what_is_wrong():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"weight must be \[out_features, in_features=5\]; got \(2, 4\)"):
        linear_with_residual(x, torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"weight is torch.float64 on cpu but x is torch.float32 on cpu"):
        linear_with_residual(x, torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must be a tensor \[..., in_features\]; got list"):
        linear_with_residual([1.0], torch.randn(2, 1))
