"""TransformerKernelLayer against a plain-PyTorch BERT layer (nn.Linear / nn.LayerNorm / softmax)
with shared weights: pre-LN and post-LN, fp32 and bf16, odd shapes, masks, dropout with the
masks regenerated from the layer's Philox seeds, reproducibility, inference mode, bad input.
Torch backend on realistic odd shapes; Triton (interpreted on CPU) on tiny ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tachyon.kernels.random import dropout_keep_mask
from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
from tachyon.nn.transformer_kernel import _kernels, saved_tensor_bytes
from tests.nn.test_transformer_layer import _seed_with_draw
from tests.utils import assert_close, assert_close_to_reference

PARAM_GRAD_ATOL = 1e-4  # parameter gradients are sums over batch * seq rows, summed in another order


def make_config(**overrides) -> TransformerKernelConfig:
    values = dict(batch_size=4, max_seq_length=128, hidden_size=32, heads=4, attn_dropout_ratio=0.0,
                  hidden_dropout_ratio=0.0, num_hidden_layers=2, initializer_range=0.02, seed=1234)
    values.update(overrides)
    return TransformerKernelConfig(**values)


@torch.no_grad()
def randomize(layer: TransformerKernelLayer) -> TransformerKernelLayer:
    """Weights of trained size, LN weights away from 1 and biases away from 0 (so a swapped
    parameter shows)."""
    gen = torch.Generator().manual_seed(7)
    for name, p in layer.named_parameters():
        if name in ("attn_nw", "norm_w"):
            v = torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen)
        elif name.endswith("w"):
            v = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
        else:
            v = 0.1 * torch.randn(p.shape, generator=gen)
        p.copy_(v.to(p.dtype))
    return layer


class PlainBertLayer(nn.Module):
    """The layer written with torch.nn, the oracle. Same math as the docstring of layer.py.
    ``drop``: {site: (keep bool tensor, p)} applies explicit dropout masks."""

    def __init__(self, layer: TransformerKernelLayer, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = layer.config
        self.c = c
        h, i = c.hidden_size, c.intermediate_size
        self.qkv, self.attn_out = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.inter, self.out = nn.Linear(h, i), nn.Linear(i, h)
        self.ln_attn, self.ln_out = nn.LayerNorm(h, eps=c.layer_norm_eps), nn.LayerNorm(h, eps=c.layer_norm_eps)
        with torch.no_grad():
            for ours, theirs in PLAIN_NAMES.items():
                self.get_parameter(theirs).copy_(getattr(layer, ours))
        self.to(dtype or c.dtype)

    def forward(self, x, keep_mask=None, drop=None):
        c, drop = self.c, drop or {}
        b, s, h = x.shape

        def dropout(t, site):
            if site not in drop:
                return t
            keep, p = drop[site]
            return t * keep.to(t.dtype) / (1 - p)

        a_in = self.ln_out(x) if c.pre_layer_norm else x
        q, k, v = self.qkv(a_in).view(b, s, 3, c.heads, c.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
        if keep_mask is not None:
            scores = scores.masked_fill(~keep_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        probs = dropout(torch.softmax(scores, dim=-1), 0)
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, h)
        z1 = x + dropout(self.attn_out(ctx), 1)
        y1 = self.ln_attn(z1)
        f = dropout(self.out(F.gelu(self.inter(y1))), 2)
        return z1 + f if c.pre_layer_norm else self.ln_out(y1 + f)


PLAIN_NAMES = {"attn_qkvw": "qkv.weight", "attn_qkvb": "qkv.bias", "attn_ow": "attn_out.weight",
               "attn_ob": "attn_out.bias", "attn_nw": "ln_attn.weight", "attn_nb": "ln_attn.bias",
               "inter_w": "inter.weight", "inter_b": "inter.bias", "output_w": "out.weight",
               "output_b": "out.bias", "norm_w": "ln_out.weight", "norm_b": "ln_out.bias"}


def padding_mask(batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] bool, True = keep: row r keeps its first seq - 3r tokens (at least 1)."""
    lengths = torch.tensor([max(1, seq - 3 * r) for r in range(batch)])
    return torch.arange(seq)[None, :] < lengths[:, None]


def run_both(layer, plain, x, mask, grad, drop=None, layer_mask=None):
    """Forward + backward of the kernel layer and the plain one; returns ({name: tensor}, {...})."""
    layer.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    xk = x.detach().clone().requires_grad_()
    xp = x.detach().clone().to(next(plain.parameters()).dtype).requires_grad_()
    out_k = layer(xk, mask if layer_mask is None else layer_mask)
    out_p = plain(xp, mask, drop)
    out_k.backward(grad.to(out_k.dtype))
    out_p.backward(grad.to(out_p.dtype))
    got = {"out": out_k, "dx": xk.grad, **{n: getattr(layer, n).grad for n in PLAIN_NAMES}}
    want = {"out": out_p, "dx": xp.grad, **{n: plain.get_parameter(t).grad for n, t in PLAIN_NAMES.items()}}
    return got, want


def assert_fp32_match(got, want):
    for name in got:
        atol = PARAM_GRAD_ATOL if name in PLAIN_NAMES else None
        assert_close(got[name], want[name], atol=atol, name=name)


# --- parity with dropout off ------------------------------------------------------------------

TORCH_SHAPES = [  # batch, seq, hidden, heads
    (2, 51, 64, 2), (1, 119, 32, 1), (3, 7, 192, 12), (2, 13, 64, 16), (1, 381, 32, 2), (1, 511, 32, 4),
]
TRITON_CASES = [(True, (2, 7, 32, 2)), (False, (2, 7, 32, 2)), (True, (1, 13, 48, 12))]


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
@pytest.mark.parametrize("shape", TORCH_SHAPES, ids=str)
def test_torch_backend_matches_plain_layer_fp32(pre_ln, shape):
    batch, seq, hidden, heads = shape
    config = make_config(hidden_size=hidden, heads=heads, pre_layer_norm=pre_ln, max_seq_length=512)
    layer = randomize(TransformerKernelLayer(config, backend="torch"))
    plain = PlainBertLayer(layer)
    x, grad = torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden)
    assert_fp32_match(*run_both(layer, plain, x, padding_mask(batch, seq), grad))


@pytest.mark.parametrize("pre_ln,shape", TRITON_CASES, ids=str)
def test_triton_backend_matches_plain_layer_fp32(pre_ln, shape):
    batch, seq, hidden, heads = shape
    layer = randomize(TransformerKernelLayer(make_config(hidden_size=hidden, heads=heads, pre_layer_norm=pre_ln),
                                             backend="triton"))
    plain = PlainBertLayer(layer)
    x, grad = torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden)
    assert_fp32_match(*run_both(layer, plain, x, padding_mask(batch, seq), grad))


def _lowp_case(backend, pre_ln, shape, dtype, device="cpu"):
    batch, seq, hidden, heads = shape
    config = make_config(hidden_size=hidden, heads=heads, pre_layer_norm=pre_ln, batch_size=batch, max_seq_length=seq,
                         bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    layer32 = randomize(TransformerKernelLayer(make_config(hidden_size=hidden, heads=heads, pre_layer_norm=pre_ln)))
    layer = TransformerKernelLayer(config, backend=backend)
    layer.load_state_dict(layer32.state_dict())
    layer.to(device)
    x, grad = torch.randn(batch, seq, hidden).to(device, dtype), torch.randn(batch, seq, hidden, device=device)
    mask = padding_mask(batch, seq).to(device)
    got, lowp = run_both(layer, PlainBertLayer(layer, dtype).to(device), x, mask, grad)
    _, oracle = run_both(layer, PlainBertLayer(layer, torch.float64).to(device), x, mask, grad)
    for name in got:
        assert got[name].dtype == dtype, f"{name}: dtype {got[name].dtype}"
        assert_close_to_reference(got[name], lowp[name], oracle[name], name=name)


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
@pytest.mark.parametrize("shape", [(2, 51, 64, 2), (2, 13, 64, 16)], ids=str)
def test_torch_backend_bf16_within_2x_of_pytorch(pre_ln, shape):
    _lowp_case("torch", pre_ln, shape, torch.bfloat16)


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
def test_triton_backend_fp16_within_2x_of_pytorch(pre_ln):
    _lowp_case("triton", pre_ln, (2, 7, 32, 2), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
@pytest.mark.parametrize("shape", [(4, 128, 1024, 16), (2, 381, 256, 4), (1, 511, 768, 12)], ids=str)
def test_gpu_lowp_within_2x_of_pytorch(dtype, pre_ln, shape):
    _lowp_case("triton", pre_ln, shape, dtype, device="cuda")


# --- masks ------------------------------------------------------------------------------------

def test_every_mask_form_gives_the_same_result():
    layer = randomize(TransformerKernelLayer(make_config(), backend="torch"))
    x = torch.randn(3, 11, 32)
    keep = padding_mask(3, 11)
    extended = (1.0 - keep[:, None, None, :].float()) * torch.finfo(torch.float32).min
    forms = {
        "bool [b, s]": keep, "0/1 long [b, s]": keep.long(), "0/1 float [b, s]": keep.float(),
        "extended [b, 1, 1, s]": extended, "eager 4D [b, 1, s, s]": extended.expand(3, 1, 11, 11),
        "sdpa bool 4D [b, 1, s, s]": keep[:, None, None, :].expand(3, 1, 11, 11),
    }
    want = layer(x, keep)
    assert not torch.equal(want, layer(x, None)), "the mask must change the result"
    for name, mask in forms.items():
        assert_close(layer(x, mask), want, name=name)


@pytest.mark.parametrize("name,make,match", [
    ("additive -1e4 in [b, s]", lambda keep: (1.0 - keep.float()) * -1e4, "negative values: an additive mask"),
    ("additive finfo.min in [b, s]", lambda keep: (1.0 - keep.float()) * torch.finfo(torch.float32).min,
     "additive mask"),
    ("0/2 long [b, s]", lambda keep: keep.long() * 2, "values 0 and 1"),
    ("0/1 float keep mask in [b, 1, 1, s]", lambda keep: keep[:, None, None, :].float(), "0/1 values: a keep mask"),
    ("positive additive [b, 1, 1, s]", lambda keep: keep[:, None, None, :].float() * 3.0, "no positive values"),
    ("0/1 long in [b, 1, 1, s]", lambda keep: keep[:, None, None, :].long(), "must be float"),
])
def test_masks_read_by_the_wrong_convention_are_refused(name, make, match):
    """A plausible mask whose values do not fit the convention of its shape is refused, naming it;
    before, an additive [b, s] mask was read as a 0/1 keep mask (padding inverted) and a 0/1 float
    [b, 1, 1, s] mask as an additive bias (padding not masked)."""
    layer = randomize(TransformerKernelLayer(make_config(), backend="torch"))
    keep = padding_mask(3, 11)
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(3, 11, 32), make(keep))


# --- dropout ----------------------------------------------------------------------------------

def _site_masks(layer, batch, seq, call):
    """The keep masks of the layer's three dropout sites in its forward number ``call``,
    regenerated from the documented convention: seed = dropout_seed(layer seed, layer_id, call,
    site), keep = tachyon.kernels.random.dropout_keep_mask(seed, shape, p) (the scores as rows of seq
    keys, the hidden states as rows of hidden_size)."""
    c = layer.config
    seed = [_kernels.dropout_seed(layer.dropout_seed, layer.layer_id, call, site) for site in range(3)]
    att, hid = (batch, c.heads, seq, seq), (batch, seq, c.hidden_size)
    pa, ph = c.attn_dropout_ratio, c.hidden_dropout_ratio
    return {0: (dropout_keep_mask(seed[0], att, pa), pa), 1: (dropout_keep_mask(seed[1], hid, ph), ph),
            2: (dropout_keep_mask(seed[2], hid, ph), ph)}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
def test_dropout_equals_the_plain_layer_with_the_regenerated_masks(backend, pre_ln):
    batch, seq = (2, 7) if backend == "triton" else (3, 37)
    layer = randomize(TransformerKernelLayer(
        make_config(attn_dropout_ratio=0.2, hidden_dropout_ratio=0.3, pre_layer_norm=pre_ln), backend=backend))
    x, grad = torch.randn(batch, seq, 32), torch.randn(batch, seq, 32)
    mask = padding_mask(batch, seq)
    first = layer(x, mask)  # call 1; call 2 is checked
    drop = _site_masks(layer, batch, seq, call=2)
    got, want = run_both(layer, PlainBertLayer(layer), x, mask, grad, drop)
    assert layer.dropout_calls == 2
    assert_fp32_match(got, want)
    assert not torch.equal(first, got["out"]), "two calls gave the same dropout"
    assert not torch.equal(drop[1][0], _site_masks(layer, batch, seq, call=1)[1][0])


def test_dropout_keep_rates_are_within_statistical_bounds():
    layer = TransformerKernelLayer(make_config(attn_dropout_ratio=0.1, hidden_dropout_ratio=0.25), backend="torch")
    masks = _site_masks(layer, 2, 48, call=1)
    for site, (keep, p) in masks.items():
        n = keep.numel()
        rate = keep.float().mean().item()
        bound = 5 * math.sqrt(p * (1 - p) / n)
        assert abs(rate - (1 - p)) < bound, f"site {site}: keep rate {rate:.4f}, expected {1 - p} +- {bound:.4f}"
        if site > 0:  # the seeds of the two hidden sites differ: their masks are independent
            assert (keep != masks[3 - site][0]).float().mean() > 0.2


def test_same_seed_is_bit_identical_run_to_run_and_restores_from_a_checkpoint(monkeypatch):
    config = make_config(attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1)
    x = torch.randn(2, 19, 32)

    def run(layer, calls):
        outs = []
        for _ in range(calls):
            xx = x.clone().requires_grad_()
            out = layer(xx)
            out.backward(torch.ones_like(out))
            outs.append((out.detach(), xx.grad, layer.attn_qkvw.grad.clone()))
        return outs

    monkeypatch.setattr(TransformerKernelLayer, "layer_id", 5)
    first = randomize(TransformerKernelLayer(config, backend="torch"))
    state = first.state_dict()
    a = run(first, 3)
    monkeypatch.setattr(TransformerKernelLayer, "layer_id", 5)
    second = TransformerKernelLayer(config, backend="torch")
    second.load_state_dict(state)
    b = run(second, 3)
    for (oa, ga, wa), (ob, gb, wb) in zip(a, b):
        assert torch.equal(oa, ob) and torch.equal(ga, gb) and torch.equal(wa, wb)
    assert not torch.equal(a[0][0], a[1][0]), "calls must differ"
    # restore after one call: the next call continues the same stream
    monkeypatch.setattr(TransformerKernelLayer, "layer_id", 5)
    third = TransformerKernelLayer(config, backend="torch")
    third.load_state_dict(first.state_dict())  # counter = 3 now
    first_again = run(first, 1)[0][0]
    assert torch.equal(run(third, 1)[0][0], first_again)
    # another layer id, same seed: other masks
    other = TransformerKernelLayer(config, backend="torch")
    other.load_state_dict({k: v for k, v in state.items() if k != "_extra_state"}, strict=False)
    assert not torch.equal(run(other, 1)[0][0], a[0][0])


def test_seed_minus_one_draws_from_torch_generator():
    torch.manual_seed(3)
    s1 = TransformerKernelLayer(make_config(seed=-1)).dropout_seed
    torch.manual_seed(3)
    s2 = TransformerKernelLayer(make_config(seed=-1)).dropout_seed
    s3 = TransformerKernelLayer(make_config(seed=-1)).dropout_seed
    assert s1 == s2 != s3 and s1 >= 0


def test_stochastic_mode_changes_nothing_on_the_torch_backend(monkeypatch):
    x = torch.randn(2, 9, 32, requires_grad=True)
    results = []
    for stochastic in (False, True):
        monkeypatch.setattr(TransformerKernelLayer, "layer_id", 0)
        layer = randomize(TransformerKernelLayer(
            make_config(stochastic_mode=stochastic, attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1), backend="torch"))
        out = layer(x)
        results.append((out, *torch.autograd.grad(out.sum(), [x, layer.attn_qkvw])))
    for name, a, b in zip(["out", "dx", "d attn_qkvw"], *results):
        assert torch.equal(a, b), f"{name} depends on stochastic_mode on the torch backend"


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
def test_stochastic_mode_uses_the_atomic_attention_backward_and_matches(monkeypatch, pre_ln):
    """Triton backend (interpreted): stochastic_mode=True passes deterministic=False to the
    attention op (the atomic-dQ backward); forward and dropout masks are identical, gradients
    equal the deterministic layer's within the fp32 table."""
    from tachyon.kernels.attention import triton as attention_triton

    flags = []
    original = attention_triton.attention_bwd
    monkeypatch.setattr(attention_triton, "attention_bwd",
                        lambda *a, **kw: flags.append(a[-1]) or original(*a, **kw))
    x, grad = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    mask = padding_mask(2, 7)
    results = []
    for stochastic in (False, True):
        monkeypatch.setattr(TransformerKernelLayer, "layer_id", 0)
        layer = randomize(TransformerKernelLayer(make_config(
            stochastic_mode=stochastic, attn_dropout_ratio=0.2, hidden_dropout_ratio=0.1, pre_layer_norm=pre_ln),
            backend="triton"))
        xx = x.clone().requires_grad_()
        out = layer(xx, mask)
        out.backward(grad)
        results.append((out.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}))
    assert flags == [True, False], f"deterministic flags passed to the Triton backward: {flags}"
    (out0, dx0, g0), (out1, dx1, g1) = results
    assert torch.equal(out0, out1), "stochastic_mode must not change the forward"
    assert_close(dx1, dx0, name="dx")
    for name, g in g1.items():
        assert_close(g, g0[name], atol=PARAM_GRAD_ATOL, name=name)


# --- inference mode ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["config", "eval"])
def test_inference_mode_has_no_dropout_and_saves_nothing(how):
    config = make_config(attn_dropout_ratio=0.3, hidden_dropout_ratio=0.3, training=how == "eval")
    layer = randomize(TransformerKernelLayer(config, backend="torch"))
    if how == "eval":
        layer.eval()
    x = torch.randn(2, 9, 32, requires_grad=True)
    out, nbytes = saved_tensor_bytes(lambda: layer(x), exclude=layer.parameters())
    assert nbytes == 0 and not out.requires_grad
    no_dropout = TransformerKernelLayer(make_config(), backend="torch")
    no_dropout.load_state_dict(layer.state_dict())
    assert_close(out, no_dropout(x), name="inference output")
    assert layer.dropout_calls == 0


# --- construction -----------------------------------------------------------------------------

def test_layer_ids_count_instances_and_deepcopies(monkeypatch):
    import copy

    monkeypatch.setattr(TransformerKernelLayer, "layer_id", 0)
    config = make_config()
    first, second = TransformerKernelLayer(config), TransformerKernelLayer(config)
    stack = nn.ModuleList([copy.deepcopy(first) for _ in range(3)])
    assert [first.layer_id, second.layer_id] == [0, 1]
    assert [layer.layer_id for layer in stack] == [2, 3, 4]
    assert [layer.config.layer_id for layer in (first, second, *stack)] == [0, 1, 2, 3, 4]
    assert config.layer_id == -1, "the caller's config is not modified"
    assert TransformerKernelLayer.layer_id == 5


def test_initialization_follows_deepspeed():
    torch.manual_seed(0)
    layer = TransformerKernelLayer(make_config(hidden_size=256, intermediate_size=None, heads=4,
                                               num_hidden_layers=8, initializer_range=0.05))
    assert layer.inter_w.shape == (1024, 256) and layer.output_w.shape == (256, 1024)
    assert layer.attn_qkvw.shape == (768, 256) and layer.attn_qkvb.shape == (768,)
    out_std = 0.05 / math.sqrt(16)
    for name, std in (("attn_qkvw", 0.05), ("inter_w", 0.05), ("attn_ow", out_std), ("output_w", out_std)):
        got = getattr(layer, name).std().item()
        assert abs(got - std) < 0.05 * std, f"{name}: std {got}, expected {std}"
    for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
        assert torch.count_nonzero(getattr(layer, name)) == 0, name
    assert torch.all(layer.attn_nw == 1) and torch.all(layer.norm_w == 1)
    flat = TransformerKernelLayer(make_config(hidden_size=256, heads=4, initializer_range=0.05, adjust_init_range=False))
    assert abs(flat.output_w.std().item() - 0.05) < 0.0025


def test_fp16_and_bf16_configs_create_parameters_in_that_dtype():
    assert TransformerKernelLayer(make_config(fp16=True)).attn_qkvw.dtype == torch.float16
    assert TransformerKernelLayer(make_config(bf16=True)).output_w.dtype == torch.bfloat16
    assert TransformerKernelLayer(make_config()).norm_w.dtype == torch.float32


def test_initial_weights_and_biases_in_deepspeed_order():
    h, i = 32, 128
    gen = torch.Generator().manual_seed(1)
    w_shapes = [(h, h), (h, h), (h, h), (h, h), (h,), (i, h), (h, i), (h,)]
    b_shapes = [(h,), (h,), (h,), (h,), (h,), (i,), (h,), (h,)]
    weights = [torch.randn(s, generator=gen) for s in w_shapes]
    biases = [torch.randn(s, generator=gen) for s in b_shapes]
    layer = TransformerKernelLayer(make_config(), initial_weights=weights, initial_biases=biases)
    assert torch.equal(layer.attn_qkvw, torch.cat(weights[:3]))
    assert torch.equal(layer.attn_qkvb, torch.cat(biases[:3]))
    names = ["attn_ow", "attn_nw", "inter_w", "output_w", "norm_w"]
    for name, w, b in zip(names, weights[3:], biases[3:]):
        assert torch.equal(getattr(layer, name), w), name
        assert torch.equal(getattr(layer, name[:-1] + "b"), b), name
    with pytest.raises(ValueError, match=r"initial_weights\[5\] has shape \(32, 32\); expected \(128, 32\)"):
        TransformerKernelLayer(make_config(), initial_weights=weights[:5] + [weights[0]] + weights[6:])
    with pytest.raises(ValueError, match="list of 8 tensors"):
        TransformerKernelLayer(make_config(), initial_biases=biases[:7])


def test_return_tuple():
    layer = TransformerKernelLayer(make_config(return_tuple=True))
    out = layer(torch.randn(1, 5, 32))
    assert isinstance(out, tuple) and len(out) == 1 and out[0].shape == (1, 5, 32)


# --- progressive layer drop -------------------------------------------------------------------

def test_pld_kept_layer_scales_both_residual_branches_and_dropped_layer_is_the_identity():
    layer = randomize(TransformerKernelLayer(make_config(num_hidden_layers=4), backend="torch"))
    layer.layer_number, theta = 2, 0.2
    keep = 1 - 2 / 4 * (1 - theta)
    plain = PlainBertLayer(layer)  # the oracle: Wo, bo, Wout, bout times 1 / keep
    with torch.no_grad():
        for name in ("attn_out.weight", "attn_out.bias", "out.weight", "out.bias"):
            plain.get_parameter(name).mul_(1 / keep)
    x, grad = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    torch.manual_seed(_seed_with_draw(keep, kept=True))
    calls = layer.dropout_calls
    xk, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_k, out_p = layer(xk, progressive_layer_drop=True, pld_theta=theta), plain(xp)
    out_k.backward(grad)
    out_p.backward(grad)
    assert_fp32_match({"out": out_k, "dx": xk.grad, "attn_qkvw": layer.attn_qkvw.grad},
                      {"out": out_p, "dx": xp.grad, "attn_qkvw": plain.qkv.weight.grad})
    assert layer.dropout_calls == calls + 1
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(_seed_with_draw(keep, kept=False))
    assert layer(xk, progressive_layer_drop=True, pld_theta=theta) is xk
    assert layer.dropout_calls == calls + 1, "a dropped layer must not advance the dropout counter"
    assert all(p.grad is None for p in layer.parameters())


def test_pld_is_off_in_inference_and_refused_for_post_ln_or_without_a_position():
    layer = randomize(TransformerKernelLayer(make_config(), backend="torch"))
    x = torch.randn(2, 9, 32)
    with pytest.raises(ValueError, match="needs the layer's position in its stack"):
        layer(x, progressive_layer_drop=True, pld_theta=0.5)
    layer.layer_number = 2
    layer.eval()
    dense = layer(x)
    torch.manual_seed(_seed_with_draw(0.05, kept=False))  # layer 2 of 2 keeps with theta: this draw would drop it
    assert torch.equal(layer(x, progressive_layer_drop=True, pld_theta=0.05), dense)
    post = TransformerKernelLayer(make_config(pre_layer_norm=False), backend="torch")
    post.layer_number = 1
    with pytest.raises(ValueError, match="needs pre_layer_norm=True"):
        post(x, progressive_layer_drop=True, pld_theta=0.5)


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,match", [
    ({"hidden_size": 30, "heads": 4}, r"hidden_size \(30\) must be divisible by heads \(4\)"),
    ({"attn_dropout_ratio": 1.0}, r"attn_dropout_ratio must be a number in \[0, 1\)"),
    ({"hidden_dropout_ratio": -0.1}, r"hidden_dropout_ratio must be a number in \[0, 1\)"),
    ({"batch_size": 0}, "batch_size must be a positive int"),
    ({"max_seq_length": -1}, "max_seq_length must be a positive int"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive int"),
    ({"heads": 2.0}, "heads must be a positive int"),
    ({"fp16": True, "bf16": True}, "fp16 and bf16 cannot both be True"),
    ({"layer_norm_eps": 0.0}, "layer_norm_eps must be a number > 0"),
    ({"seed": -2}, "seed must be an int"),
    ({"pre_layer_norm": 1}, "pre_layer_norm must be True or False"),
])
def test_config_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_config(**overrides)


def test_config_round_trips_through_dict_and_rejects_unknown_keys():
    config = make_config(gelu_checkpoint=True)
    config.layer_id = 3
    again = TransformerKernelConfig.from_dict(config.to_dict())
    assert again == config and again.intermediate_size == 128
    with pytest.raises(ValueError, match="unknown key 'hidden_dropout'; did you mean 'hidden_dropout_ratio'"):
        TransformerKernelConfig.from_dict({**config.to_dict(), "hidden_dropout": 0.1})


@pytest.mark.parametrize("case,match", [
    ("seq", r"sequence length 129; allowed: 1 to config.max_seq_length=128"),
    ("batch", r"batch size 5; allowed: 1 to config.batch_size=4"),
    ("hidden", r"hidden_states must be \[batch, seq, hidden_size=32\]"),
    ("dtype", r"hidden_states has dtype torch.float16 but the layer is configured for torch.float32"),
    ("mask2d", r"attention_mask has shape \(2, 9\); allowed"),
    ("mask4d", r"attention_mask has shape \(2, 1, 3, 8\); allowed"),
    ("causal", "differs between query rows"),
    ("params", r"parameters have dtype torch.float16 but the config says torch.float32"),
    ("encoder", "cross-attention"),
    ("kwarg", "output_attentions=bool is not supported"),
])
def test_layer_rejects_bad_input(case, match):
    layer = TransformerKernelLayer(make_config(), backend="torch")
    x = torch.randn(2, 8, 32)
    call = {
        "seq": lambda: layer(torch.randn(1, 129, 32)),
        "batch": lambda: layer(torch.randn(5, 8, 32)),
        "hidden": lambda: layer(torch.randn(2, 8, 31)),
        "dtype": lambda: layer(x.half()),
        "mask2d": lambda: layer(x, torch.ones(2, 9)),
        "mask4d": lambda: layer(x, torch.zeros(2, 1, 3, 8)),
        "causal": lambda: layer(x, torch.ones(8, 8).tril().bool().expand(2, 1, 8, 8)),
        "params": lambda: layer.half()(x),
        "encoder": lambda: layer(x, None, torch.randn(2, 4, 32)),
        "kwarg": lambda: layer(x, output_attentions=True),
    }[case]
    with pytest.raises(ValueError, match=match):
        call()
