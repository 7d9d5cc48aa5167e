"""GPU checks of the new recipes (run by benchmarks/gpu.sh with -m gpu; skipped here with the reason):
the block-scaled torch._scaled_mm against the emulation where this torch runs it (else the
reason it does not), the Triton block cast on CUDA bit for bit against its PyTorch reference,
and a TransformerLayer under each recipe on the GPU against the same layer in bf16."""

from __future__ import annotations

import pytest
import torch

import tachyon
import tachyon.nn as tnn
from tachyon.fp8 import (
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, QParams, block_gemm, block_gemm_support, gemm_paths,
    dequantize, native_fp8_supported, quantize_blocks,
)
from tachyon.kernels.fp8_block_cast import block_cast_to_fp8

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _needs_fp8_gpu():
    if not torch.cuda.is_available() or not native_fp8_supported(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")


@pytest.mark.parametrize("a_block,b_block", [((1, 128), (128, 128)), ((128, 128), (1, 128)), ((1, 128), (1, 128))],
                         ids=str)
def test_native_block_gemm_matches_the_emulation_or_says_why_not(a_block, b_block):
    _needs_fp8_gpu()
    runs, reason = block_gemm_support(torch.device("cuda"), a_block, b_block, E4M3, E4M3)
    print(f"blockwise {a_block} x {b_block}: {reason}")
    if not runs:
        assert reason.startswith("emulated:") and reason.count(" ") > 3
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 384, device="cuda", generator=gen) * torch.logspace(-2, 2, 384, device="cuda")
    b = torch.randn(128, 384, device="cuda", generator=gen)
    qa, qb = quantize_blocks(a, E4M3, a_block, QParams(True)), quantize_blocks(b, E4M3, b_block, QParams(True))
    native = block_gemm(qa, qb, torch.float32, native=True)
    emulated = block_gemm(qa, qb, torch.float32, native=False)
    bound = dequantize(qa).abs() @ dequantize(qb).abs().t()  # fp32 accumulation in another order
    assert bool(((native - emulated).abs() <= 1e-4 * bound + 1e-6).all())


@pytest.mark.parametrize("mode", [dict(rows=True, cols=True), dict(square=True, cols=True)], ids=["rows+cols", "square"])
@pytest.mark.parametrize("size", [128, 32])
def test_triton_block_cast_on_cuda_is_the_reference(mode, size):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = (torch.randn(300, 520, device="cuda") * torch.logspace(-3, 3, 520, device="cuda")).to(torch.bfloat16)
    x[5, 7] = float("nan")
    got = block_cast_to_fp8(x, E4M3, size, backend="triton", **mode)
    want = block_cast_to_fp8(x, E4M3, size, backend="torch", **mode)
    for g, w in zip(got, want):
        view = torch.uint8 if g.element_size() == 1 else torch.int32
        assert torch.equal(g.view(view), w.view(view))


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling()],
                         ids=["delayed", "current", "block"])
def test_transformer_layer_runs_each_recipe_on_the_gpu(recipe):
    _needs_fp8_gpu()
    print(gemm_paths())
    torch.manual_seed(0)
    layer = tnn.TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                 params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_ref = layer(x)
    y_ref.float().square().sum().backward()
    grads_ref = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    layer.zero_grad()
    x.grad = None
    for _ in range(2):  # delayed scaling: the second step casts with scales from the first
        layer.zero_grad()
        x.grad = None
        with tachyon.autocast(recipe=recipe):
            y = layer(x)
        y.float().square().sum().backward()
    assert not torch.equal(y, y_ref)
    for got, want in zip([y, x.grad, *(p.grad for p in layer.parameters())], [y_ref, *grads_ref]):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert torch.isfinite(got).all() and err < 0.15, err
