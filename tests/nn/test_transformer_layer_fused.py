"""TransformerLayer's eager path as one autograd node (nn/transformer_layer_fused.py) against its
module path (``one_node_eager = False``, the path torch.compile traces): the same values bit for
bit, forward and every gradient, over several steps of dropout, and the same bytes saved for
backward; the configurations it does not cover take the module path."""

from __future__ import annotations

import copy

import pytest
import torch

import tachyon
from tachyon.nn import TransformerLayer
from tachyon.nn.transformer_kernel import saved_tensor_bytes

HIDDEN, FFN, HEADS, SEQ, BATCH = 32, 64, 4, 8, 2


def _pair(dtype=torch.float32, **kwargs):
    kwargs.setdefault("hidden_dropout", 0.1)
    kwargs.setdefault("attention_dropout", 0.1)
    torch.manual_seed(0)
    one = TransformerLayer(HIDDEN, FFN, HEADS, params_dtype=dtype, **kwargs)
    with torch.no_grad():  # norm weights and biases away from their 1 / 0 initialization
        for param in one.parameters():
            param.add_(0.05 * torch.randn_like(param))
    mod = copy.deepcopy(one)
    mod.one_node_eager = False
    return one, mod


def _step(layer, x, seed, **kwargs):
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)  # the dropout seeds' draw
    out = layer(x, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    values = [out.detach(), x.grad] + [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return values, out.grad_fn


def _assert_same(one, mod, steps=1, dtype=torch.float32, **kwargs):
    shape = (SEQ, BATCH, HIDDEN) if one.attn_input_format == "sbhd" else (BATCH, SEQ, HIDDEN)
    x = torch.randn(shape).to(dtype)
    names = ["out", "dx"] + [n for n, _ in one.named_parameters()]
    for step in range(steps):
        got, grad_fn = _step(one, x, 100 + step, **kwargs)
        want, _ = _step(mod, x, 100 + step, **kwargs)
        for name, a, b in zip(names, got, want):
            if a is None or b is None:
                assert a is None and b is None, f"step {step}: {name}: a gradient on one path only"
                continue
            assert torch.equal(a, b), f"step {step}: {name} differs by {(a.float() - b.float()).abs().max().item():.3g}"
    return grad_fn


def _is_one_node(grad_fn) -> bool:
    return grad_fn is not None and type(grad_fn).__name__ == "TransformerLayerFunctionBackward"


CASES = [
    {},  # GPT: LayerNorm, tanh GELU, biases, causal, sbhd
    {"normalization": "RMSNorm", "activation": "swiglu", "bias": False, "num_gqa_groups": 2,
     "attn_input_format": "bshd"},
    {"self_attn_mask_type": "no_mask", "activation": "relu", "hidden_dropout": 0.0, "attention_dropout": 0.0},
    {"hidden_dropout": 0.2, "attention_dropout": 0.0, "layernorm_epsilon": 1e-6},
    {"zero_centered_gamma": True},  # the norms take 1 + gamma in fp32
    {"zero_centered_gamma": True, "normalization": "RMSNorm", "bias": False, "dtype": torch.bfloat16},
]


@pytest.mark.parametrize("kwargs", CASES, ids=["gpt", "llama-gqa-bshd", "no-mask-relu-p0", "hidden-dropout-only",
                                               "zero-centered", "zero-centered-rmsnorm-bf16"])
def test_one_node_equals_module_path_torch_backend(kwargs):
    one, mod = _pair(backend="torch", **kwargs)
    x = torch.randn(SEQ, BATCH, HIDDEN) if one.attn_input_format == "sbhd" else torch.randn(BATCH, SEQ, HIDDEN)
    x.requires_grad_()
    saved = [saved_tensor_bytes(lambda layer=layer: layer(x), exclude=layer.parameters())[1] for layer in (one, mod)]
    assert saved[0] == saved[1], f"saved for backward: one node {saved[0]} bytes, module path {saved[1]}"
    grad_fn = _assert_same(one, mod, steps=2 if not kwargs else 1)  # two steps: new dropout seeds
    assert _is_one_node(grad_fn)


def test_one_node_equals_module_path_triton_interpreter():
    one, mod = _pair(backend="triton")
    assert _is_one_node(_assert_same(one, mod))


ROPE_CASES = {
    "gpt-rope": {},
    "llama-gqa-bshd-rope-half": {"normalization": "RMSNorm", "activation": "swiglu", "bias": False,
                                 "num_gqa_groups": 2, "attn_input_format": "bshd"},
    "rope-interleaved-no-mask": {"self_attn_mask_type": "no_mask"},
}


def _backends(triton_default: str, names) -> list:
    """(name, backend) cases: the torch backend for every name; the Triton interpreter (seconds per
    case) for ``triton_default`` (None: none) in the default suite and for the others under ``-m slow``."""
    cases = [pytest.param(name, "torch", id=f"{name}-torch") for name in names]
    cases += [pytest.param(name, "triton", id=f"{name}-triton",
                           marks=() if name == triton_default else pytest.mark.slow) for name in names]
    return cases


@pytest.mark.parametrize("name,backend", _backends(None, ROPE_CASES))  # Triton + RoPE by default: the padding test
def test_one_node_with_rope_equals_module_path(backend, name):
    """RoPE (one table for queries and keys, TE's angle tensor or (cos, sin) tables): the one-node
    path runs the module path's packed RoPE (the QKV GEMM adds the bias, the attention op rotates
    q and k): the same values bit for bit, every gradient, and the same bytes saved."""
    one, mod = _pair(backend=backend, **ROPE_CASES[name])
    interleaved = name.startswith("rope-interleaved")
    for layer in (one, mod):
        layer.self_attention.rotary_pos_interleaved = interleaved
    rope = tachyon.nn.RotaryPositionEmbedding(HIDDEN // HEADS, rotary_percent=0.5 if "half" in name else 1.0,
                                              interleaved=interleaved)
    emb = rope(SEQ + 3)  # longer than the sequence: the tables take its first SEQ positions
    if name == "llama-gqa-bshd-rope-half":
        emb = rope.cos_sin(SEQ)  # (cos, sin) tables
    x = torch.randn(SEQ, BATCH, HIDDEN) if one.attn_input_format == "sbhd" else torch.randn(BATCH, SEQ, HIDDEN)
    x.requires_grad_()
    saved = [saved_tensor_bytes(lambda layer=layer: layer(x, rotary_pos_emb=emb), exclude=layer.parameters())[1]
             for layer in (one, mod)]
    assert saved[0] == saved[1], f"saved for backward: one node {saved[0]} bytes, module path {saved[1]}"
    assert _is_one_node(_assert_same(one, mod, steps=2 if backend == "torch" else 1, rotary_pos_emb=emb))


def _padding(sbhd_batch: int = BATCH) -> torch.Tensor:
    mask = torch.zeros(sbhd_batch, 1, 1, SEQ, dtype=torch.bool)  # TE's mask: True = padded
    mask[1, ..., 5:] = True
    return mask


PADDING_CASES = {
    "padding-sbhd": ({"self_attn_mask_type": "padding"}, {}),
    "padding-causal-gqa-bshd-rmsnorm": ({"self_attn_mask_type": "padding_causal", "num_gqa_groups": 2,
                                         "attn_input_format": "bshd", "normalization": "RMSNorm",
                                         "activation": "swiglu", "bias": False}, {}),
    "padding-per-call-with-rope": ({}, {"self_attn_mask_type": "padding", "rope": True}),
    "padding-query-key-pair": ({"self_attn_mask_type": "padding", "hidden_dropout": 0.0}, {"pair": True}),
}


@pytest.mark.parametrize("name,backend", _backends("padding-per-call-with-rope", PADDING_CASES))
def test_one_node_with_padding_masks_equals_module_path(backend, name):
    """Padding masks (TE's [b, 1, 1, s] bool mask, or a (query mask, key mask) pair; the mask type
    from the layer or from the call, with and without causal, with RoPE): the module path's values
    bit for bit (the padded queries' context rows zeroed before the projection) and its saved bytes."""
    layer_kwargs, call = PADDING_CASES[name]
    one, mod = _pair(backend=backend, **layer_kwargs)
    mask = _padding()
    if call.get("pair"):
        key = mask.clone()
        key[0, ..., 6:] = True
        mask = (mask, key)
    kwargs = {"attention_mask": mask}
    if "self_attn_mask_type" in call:
        kwargs["self_attn_mask_type"] = call["self_attn_mask_type"]
    if call.get("rope"):
        kwargs["rotary_pos_emb"] = tachyon.nn.RotaryPositionEmbedding(HIDDEN // HEADS)(SEQ)
    x = torch.randn(SEQ, BATCH, HIDDEN) if one.attn_input_format == "sbhd" else torch.randn(BATCH, SEQ, HIDDEN)
    x.requires_grad_()
    saved = [saved_tensor_bytes(lambda layer=layer: layer(x, **kwargs), exclude=layer.parameters())[1]
             for layer in (one, mod)]
    assert saved[0] == saved[1], f"saved for backward: one node {saved[0]} bytes, module path {saved[1]}"
    assert _is_one_node(_assert_same(one, mod, steps=2 if backend == "torch" else 1, **kwargs))


def test_masks_the_module_path_refuses_are_refused_the_same_way():
    one, _ = _pair(backend="torch", self_attn_mask_type="padding")
    x = torch.randn(SEQ, BATCH, HIDDEN)
    with pytest.raises(ValueError, match="needs attention_mask"):
        one(x)
    causal, _ = _pair(backend="torch")  # a mask with a mask type that reads none
    with pytest.raises(ValueError, match="only used with attn_mask_type 'padding'"):
        causal(x, attention_mask=_padding())


class _Autocast(torch.nn.Module):
    """The layer's forward under torch.autocast (CPU, bf16): fp32 parameters, bf16 compute."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.layer(x, **kwargs)


@pytest.mark.parametrize("name,backend", [("gpt", "torch"), ("llama-gqa-bshd", "torch"), ("gpt", "triton")])
def test_one_node_under_autocast_equals_module_path(name, backend):
    """fp32 parameters under torch.autocast(bf16): the one-node path casts them as the module path
    does (graph nodes whose backward casts the gradients back to fp32) and computes in bf16: the
    module path's values and fp32 gradients bit for bit."""
    kwargs = {"gpt": {}, "llama-gqa-bshd": CASES[1]}[name]
    one, mod = _pair(backend=backend, **kwargs)
    a, b = _Autocast(one), _Autocast(mod)
    a.attn_input_format = b.attn_input_format = one.attn_input_format
    assert _is_one_node(_assert_same(a, b, steps=2 if backend == "torch" else 1))
    x = torch.randn(SEQ, BATCH, HIDDEN) if one.attn_input_format == "sbhd" else torch.randn(BATCH, SEQ, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = one(x.requires_grad_())
    assert out.dtype == torch.bfloat16 and _is_one_node(out.grad_fn)
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in one.parameters())


@pytest.mark.parametrize("name,backend", [("gpt", "torch"), ("llama-gqa-bshd-p0", "torch"),
                                         pytest.param("gpt", "triton", marks=pytest.mark.slow)])
def test_one_node_with_progressive_layer_drop_equals_module_path(name, backend):
    """Progressive layer drop: a kept layer scales both residual branches and their biases by 1 / p
    (the bias gradients after the deferred reductions); steps that drop the layer return x on both
    paths. The module path's values bit for bit over steps that keep and drop."""
    kwargs = {"gpt": {}, "llama-gqa-bshd-p0": {**CASES[1], "hidden_dropout": 0.0}}[name]
    from tachyon.nn import transformer_layer_fused as one_node

    one, mod = _pair(backend=backend, layer_number=3, num_layers=4, **kwargs)
    runs = []
    real_run = one_node.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(one_node, "run", lambda *a: runs.append(a[1].scale) or real_run(*a))
        steps = 6 if backend == "torch" else 3
        _assert_same(one, mod, steps=steps, progressive_layer_drop=True, pld_theta=0.5)
    # some steps kept the layer (the one node ran, scale 1 / p > 1) and, on the torch backend, some dropped it
    assert runs and all(scale > 1.0 for scale in runs), runs
    assert backend != "torch" or len(runs) < steps, runs


def test_rope_with_separate_query_and_key_angles_takes_the_module_path():
    one, mod = _pair(backend="torch")
    rope = tachyon.nn.RotaryPositionEmbedding(HIDDEN // HEADS)
    emb = (rope(SEQ), rope(SEQ, offset=2))  # TE's (query, key) angles: the module path's unpacked RoPE
    assert not _is_one_node(_assert_same(one, mod, rotary_pos_emb=emb))
    with pytest.raises(ValueError, match="covers 4 positions"):  # the module path's error, not a one-node one
        one(torch.randn(SEQ, BATCH, HIDDEN), rotary_pos_emb=rope(4))


def test_one_node_eval_and_no_grad_and_frozen_params():
    one, mod = _pair(backend="torch")
    x = torch.randn(SEQ, BATCH, HIDDEN)
    for layer in (one, mod):
        layer.eval()
    with torch.no_grad():
        assert torch.equal(one(x), mod(x))
    one.train(), mod.train()
    for layer in (one, mod):  # a frozen input norm and QKV weight: no gradient for them on either path
        layer.self_attention.layernorm_qkv.weight.requires_grad_(False)
        layer.self_attention.layernorm_qkv.layer_norm_weight.requires_grad_(False)
    assert _is_one_node(_assert_same(one, mod, steps=1))


def test_other_configurations_take_the_module_path():
    """Separate query and key RoPE angles, post-LN, decoders, FP8, forward hooks and subclasses run
    through the submodules (the one-node path does not cover them); the values stay the module path's."""
    x = torch.randn(SEQ, BATCH, HIDDEN)
    one, _ = _pair(backend="torch", apply_residual_connection_post_layernorm=True)
    assert not _is_one_node(one(x).grad_fn)
    one, _ = _pair(backend="torch")
    rope = tachyon.nn.RotaryPositionEmbedding(HIDDEN // HEADS)
    assert not _is_one_node(one(x, rotary_pos_emb=(rope(SEQ), rope(SEQ, offset=1))).grad_fn)  # (query, key) angles
    handle = one.layernorm_mlp.register_forward_hook(lambda module, args, out: None)
    assert not _is_one_node(one(x).grad_fn)
    handle.remove()
    assert _is_one_node(one(x).grad_fn)
    with tachyon.fp8_autocast(enabled=True):
        assert not _is_one_node(one(torch.randn(16, 2, HIDDEN)).grad_fn)

    class Sub(TransformerLayer):
        pass

    sub = Sub(HIDDEN, FFN, HEADS, backend="torch")
    assert not _is_one_node(sub(x).grad_fn)


def test_a_changed_shape_dtype_or_parameter_is_checked_again():
    """Nothing is cached across calls by shape: a new sequence length and batch, or a new dtype,
    gives the module path's values; a dtype or a parameter shape the kernels do not take is
    refused with the module path's error."""
    one, mod = _pair(backend="torch")
    for shape in ((SEQ, BATCH, HIDDEN), (SEQ + 3, BATCH + 1, HIDDEN)):
        x = torch.randn(shape)
        assert torch.equal(one.eval()(x), mod.eval()(x))
    one.train(), mod.train()
    one16, mod16 = _pair(torch.bfloat16, backend="torch")
    assert _is_one_node(_assert_same(one16, mod16, steps=1, dtype=torch.bfloat16))
    one64 = _pair(backend="torch")[0].double()
    with pytest.raises(ValueError, match="float64"):
        one64(torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64))
    one.layernorm_mlp.fc1_bias = torch.nn.Parameter(torch.zeros(FFN + 1))
    with pytest.raises(ValueError, match="bias1"):
        one(torch.randn(SEQ, BATCH, HIDDEN))


@pytest.fixture
def auto_on_sm90(monkeypatch):
    """backend "auto" as on an sm_90 GPU for the input norm (tachyon.kernels.dispatch picks torch's
    LayerNorm there: fp32 is not measured), the rest of the layer on the torch backend."""
    from tachyon.kernels import dispatch
    from tachyon.kernels.layernorm import op as norm_op
    from tachyon.nn import transformer_layer_fused as one_node

    for module in (norm_op, one_node):
        real = module.resolve
        monkeypatch.setattr(module, "resolve", lambda t, backend=None, real=real:
                            "triton" if backend in (None, "auto") else real(t, backend))
        monkeypatch.setattr(module, "auto_on_cuda", lambda t, backend: backend in (None, "auto"))
    monkeypatch.setattr(dispatch, "arch_of", lambda t: "sm_90")


def _graph_names(grad_fn) -> set[str]:
    names, stack, seen = set(), [grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def test_one_node_with_torchs_layernorm_under_auto_on_cuda(auto_on_sm90):
    one, mod = _pair()
    for layer in (one, mod):
        layer.backend = layer.self_attention.core_attention.backend = layer.layernorm_mlp.backend = "torch"
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    assert "NativeLayerNormBackward0" in _graph_names(mod(x).grad_fn)  # the module path takes torch's norm
    saved = [saved_tensor_bytes(lambda layer=layer: layer(x), exclude=layer.parameters())[1] for layer in (one, mod)]
    assert saved[0] == saved[1], f"saved for backward: one node {saved[0]} bytes, module path {saved[1]}"
    assert _is_one_node(_assert_same(one, mod, steps=1))
    grads = []
    for layer in (one, mod):  # an input without a gradient: the norm's input gradient is not formed
        torch.manual_seed(5)
        layer(x.detach()).sum().backward()
        grads.append([p.grad for p in layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    one_rms, _ = _pair(normalization="RMSNorm")
    one_rms.backend = "torch"
    assert not _is_one_node(one_rms(x).grad_fn)  # torch's RMSNorm there: the module path


def test_saves_what_the_module_path_saves_biases_included():
    """The projection, fc1 and fc2 biases are not saved for backward on the module path (only their
    dtypes are read), so updating them in place before the backward is allowed there and here."""
    one, mod = _pair(backend="torch")
    x = torch.randn(SEQ, BATCH, HIDDEN)
    for layer in (one, mod):
        torch.manual_seed(7)  # the same dropout seeds on both paths
        out = layer(x)
        with torch.no_grad():
            for bias in (layer.self_attention.proj.bias, layer.layernorm_mlp.fc1_bias, layer.layernorm_mlp.fc2_bias):
                bias.add_(1.0)
        out.sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(one.parameters(), mod.parameters()))
