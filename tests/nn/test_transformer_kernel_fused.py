"""The BERT kernel layer's eager path as one autograd node (nn/transformer_kernel/fused.py) against
its op-by-op path (the path torch.compile traces): the same values bit for bit, forward and every
gradient, and the same bytes saved for backward, over the layer's flags, dropout, progressive layer
drop, dtypes and both backends."""

from __future__ import annotations

import copy

import pytest
import torch

from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
from tachyon.nn.transformer_kernel import saved_tensor_bytes
from tachyon.profiling import TrafficCounter


def _pair(pre_ln=True, invertible=False, gelu_ckpt=False, attn_ckpt=False, p=0.1, dtype=torch.float32, backend=None,
          hidden=32, heads=2):
    config = TransformerKernelConfig(
        batch_size=2, max_seq_length=8, hidden_size=hidden, intermediate_size=2 * hidden, heads=heads,
        attn_dropout_ratio=p, hidden_dropout_ratio=p, num_hidden_layers=4, initializer_range=0.02, seed=3,
        pre_layer_norm=pre_ln, normalize_invertible=invertible, gelu_checkpoint=gelu_ckpt,
        attn_dropout_checkpoint=attn_ckpt, bf16=dtype == torch.bfloat16)
    fused = TransformerKernelLayer(config, backend=backend)
    with torch.no_grad():  # LayerNorm weights and biases away from their 1 / 0 initialization
        for param in fused.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ops = copy.deepcopy(fused)
    ops.layer_id, ops.dropout_seed, ops.dropout_calls = fused.layer_id, fused.dropout_seed, fused.dropout_calls
    ops.fused_eager = False
    fused.layer_number = ops.layer_number = 3
    return fused, ops


def _step(layer, x, mask, seed, **kwargs):
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)  # progressive layer drop's draw
    out = layer(x, mask, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    values = [out.detach(), x.grad] + [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return values, out.grad_fn


def _assert_same(fused, ops, steps=2, **kwargs):
    x = torch.randn(2, 8, fused.config.hidden_size).to(fused.config.dtype)
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    for step in range(steps):
        got, grad_fn = _step(fused, x, mask, 100 + step, **kwargs)
        want, _ = _step(ops, x, mask, 100 + step, **kwargs)
        names = ["out", "dx"] + [n for n, _ in fused.named_parameters()]
        for name, a, b in zip(names, got, want):
            if a is None or b is None:
                assert a is None and b is None, f"step {step}: {name}: a gradient on one path only"
                continue
            assert torch.equal(a, b), f"step {step}: {name} differs by {(a.float() - b.float()).abs().max().item():.3g}"
    return grad_fn


# (pre_ln, normalize_invertible, gelu_checkpoint, attn_dropout_checkpoint, dropout): each flag on and
# off in both layer kinds (every combination passed when written; these keep the suite short)
CPU_CASES = [
    (True, False, False, False, 0.1), (False, False, False, False, 0.1), (True, True, False, False, 0.1),
    (False, True, True, False, 0.1), (True, False, True, True, 0.1), (False, False, False, True, 0.0),
    (True, True, True, True, 0.0), (False, True, True, True, 0.1),
]


@pytest.mark.parametrize("pre_ln,invertible,gelu_ckpt,attn_ckpt,p", CPU_CASES)
def test_fused_equals_op_by_op_torch_backend(pre_ln, invertible, gelu_ckpt, attn_ckpt, p):
    fused, ops = _pair(pre_ln, invertible, gelu_ckpt, attn_ckpt, p, backend="torch")
    x = torch.randn(2, 8, 32, requires_grad=True)
    saved = [saved_tensor_bytes(lambda layer=layer: layer(x), exclude=layer.parameters())[1] for layer in (fused, ops)]
    assert saved[0] == saved[1], f"saved for backward: one node {saved[0]} bytes, op by op {saved[1]}"
    grad_fn = _assert_same(fused, ops)
    assert type(grad_fn).__name__ == "ViewBackward0" and "KernelLayerFunction" in type(grad_fn.next_functions[0][0]).__name__


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_op_by_op_low_precision_and_pld(dtype):
    fused, ops = _pair(True, False, False, False, 0.1, dtype=dtype, backend="torch")
    _assert_same(fused, ops, steps=3, progressive_layer_drop=True, pld_theta=0.6)


def test_fused_equals_op_by_op_triton_backend_with_pld():
    """Progressive layer drop with the Triton kernels: the backward's reductions run in one launch
    (tiling.deferred_sums) and the two output biases' gradients are scaled after it."""
    fused, ops = _pair(True, False, False, False, 0.1, backend="triton", hidden=16, heads=1)
    _assert_same(fused, ops, steps=2, progressive_layer_drop=True, pld_theta=0.6)


@pytest.mark.parametrize("pre_ln,invertible,gelu_ckpt,attn_ckpt", [(True, False, False, False), (False, True, True, True)])
def test_fused_equals_op_by_op_triton_backend(pre_ln, invertible, gelu_ckpt, attn_ckpt):
    """The Triton kernels (under the interpreter on CPU): the same launches in the same order."""
    fused, ops = _pair(pre_ln, invertible, gelu_ckpt, attn_ckpt, 0.1, backend="triton", hidden=16, heads=1)
    _assert_same(fused, ops, steps=1)


def test_eval_and_no_grad_calls_match_and_save_nothing():
    fused, ops = _pair(True, False, False, False, 0.1, backend="torch")
    x = torch.randn(2, 8, 32)
    with torch.no_grad():  # training mode, no autograd graph: dropout on, the fused forward unsaved
        torch.manual_seed(0)
        a = fused(x)
        torch.manual_seed(0)
        b = ops(x)
    assert torch.equal(a, b)
    fused.eval()
    ops.eval()
    assert torch.equal(fused(x), ops(x)) and not fused(x).requires_grad


def test_the_op_by_op_path_runs_where_ops_must_be_seen():
    """Under a dispatch mode (TrafficCounter counts the custom ops) the layer runs op by op."""
    fused, _ = _pair(True, backend="torch")
    x = torch.randn(2, 8, 32, requires_grad=True)
    with TrafficCounter() as counter:
        out = fused(x)
    scopes = {name for event in counter.events for name in event.scope}
    assert {"tachyon::attention_packed_fwd", "tachyon::norm_fwd"} <= scopes, scopes
    assert "KernelLayerFunction" not in type(out.grad_fn.next_functions[0][0]).__name__


def test_frozen_parameters_get_no_gradient_and_torch_checkpoint_recomputes_the_same():
    fused, ops = _pair(True, False, False, False, 0.1, backend="torch")
    for layer in (fused, ops):
        layer.attn_qkvw.requires_grad_(False)
        layer.inter_w.requires_grad_(False)
    _assert_same(fused, ops, steps=1)
    assert fused.attn_qkvw.grad is None and fused.inter_w.grad is None
    # the whole layer under torch.utils.checkpoint (the engine's activation checkpointing)
    x = torch.randn(2, 8, 32)
    grads = []
    for use_checkpoint in (False, True):
        layer = copy.deepcopy(fused)
        layer.layer_id, layer.dropout_seed, layer.dropout_calls = fused.layer_id, fused.dropout_seed, fused.dropout_calls
        xi = x.clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False) if use_checkpoint else layer(xi)
        out.sum().backward()
        grads.append([xi.grad, *(p.grad for p in layer.parameters() if p.grad is not None)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
