"""The BERT kernel layer's dropout seeds as tensors: bit-identical to the Python seed chain,
torch.compile trains with no recompiles and matches eager bit for bit, the counter survives
activation-checkpoint recomputes (eager and compiled) and state_dict round trips."""

from __future__ import annotations

import random

import pytest
import torch
import torch.utils.checkpoint
from torch._dynamo.utils import counters

from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
from tachyon.nn.transformer_kernel import _kernels
from tests.nn.test_transformer_kernel import randomize

BATCH, SEQ, HIDDEN, HEADS = 2, 13, 32, 2
STEPS = 5


def _config(**overrides) -> TransformerKernelConfig:
    values = dict(batch_size=BATCH, max_seq_length=32, hidden_size=HIDDEN, heads=HEADS, attn_dropout_ratio=0.2,
                  hidden_dropout_ratio=0.3, num_hidden_layers=2, initializer_range=0.02, seed=2**62 + 11)
    values.update(overrides)
    return TransformerKernelConfig(**values)


def _layers(n: int = 2, **overrides) -> list[TransformerKernelLayer]:
    """``n`` layers with the same weights, seed and layer_id (hence the same dropout streams)."""
    layers = [TransformerKernelLayer(_config(**overrides), backend="torch") for _ in range(n)]
    randomize(layers[0])
    for layer in layers:
        layer.load_state_dict(layers[0].state_dict())
        layer.layer_id = 3
    return layers


def _steps(fn, layer, steps: int = STEPS, start: int = 0):
    """Training steps ``start .. steps - 1`` (step i's input and upstream gradient are the same for
    every caller); returns [(out, dx, d attn_qkvw)] per step run."""
    gen = torch.Generator().manual_seed(3)
    results = []
    for step in range(steps):
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen).requires_grad_()
        grad = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
        if step < start:
            continue
        out = fn(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, layer.attn_qkvw.grad.clone()))
        layer.zero_grad()
    return results


def _assert_bitwise(got, want, label: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for name, a, b in zip(("out", "dx", "d attn_qkvw"), g, w):
            assert torch.equal(a, b), (f"{label}, step {step}: {name} differs from eager in "
                                       f"{int((a != b).sum())} of {a.numel()} elements")


# --- the seed chain in tensor ops ---------------------------------------------------------------

def test_tensor_seeds_equal_the_python_seed_chain():
    rng = random.Random(0)
    edge = [(0, 0, 0), (0, 0, 1), (2**63 - 1, 0, 2**63 - 1), (2**62 + 11, 2**31 - 1, 2**40), (1234, 5, 2**32)]
    values = edge + [(rng.randrange(2**63), rng.randrange(2**20), rng.randrange(2**63)) for _ in range(300)]
    keys = torch.tensor([_kernels.dropout_key(s, lid) for s, lid, _ in values])
    calls = torch.tensor([c for _, _, c in values])
    seeds = torch.stack([torch.stack(_kernels.dropout_seeds(k, c)) for k, c in zip(keys, calls)])
    want = torch.tensor([[_kernels.dropout_seed(s, lid, c, site) for site in range(3)] for s, lid, c in values])
    bad = (seeds != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"{len(bad)} of {len(values)} (seed, layer_id, call) differ, first {values[bad[0]]}"
    assert bool((seeds >= 0).all()), "seeds must lie in [0, 2**63)"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_next_dropout_seeds_advances_the_counter_and_gives_the_chain(backend):
    """The per-forward op: counter + 1 and the three chained seeds (one Triton launch on GPUs, here
    under the interpreter); inside a backward pass (a recompute) the counter stays."""
    for seed, layer_id, call in [(0, 0, 0), (2**63 - 1, 7, 12345), (2**62 + 11, 3, 2**40), (5, 2**31, 2**63 - 2)]:
        key, calls = torch.tensor(_kernels.dropout_key(seed, layer_id)), torch.tensor(call)
        seeds = _kernels.next_dropout_seeds(key, calls, backend=backend)
        assert int(calls) == call + 1
        assert seeds.tolist() == [_kernels.dropout_seed(seed, layer_id, call + 1, site) for site in range(3)]
    key, calls = torch.tensor(_kernels.dropout_key(1, 2)), torch.tensor(10)
    seen = []

    def hook(grad):
        seen.append(_kernels.next_dropout_seeds(key, calls, backend=backend).tolist())
        return grad

    x = torch.ones(2, requires_grad=True)
    x.register_hook(hook)
    (x * 2).sum().backward()
    assert int(calls) == 10 and seen == [[_kernels.dropout_seed(1, 2, 10, site) for site in range(3)]]


@pytest.mark.parametrize("fused_eager", [True, False])
def test_layer_uses_the_documented_seeds_and_keeps_its_state_on_device(monkeypatch, fused_eager):
    import copy

    from tachyon.nn.transformer_kernel import fused

    layer = TransformerKernelLayer(_config(), backend="torch")
    layer.fused_eager = fused_eager
    layer.layer_id = 9
    assert int(layer._dropout_key) == _kernels.dropout_key(layer.dropout_seed, 9), "setting layer_id refreshes the key"
    layer.dropout_seed = 77
    assert int(layer._dropout_key) == _kernels.dropout_key(77, 9), "setting dropout_seed refreshes the key"
    twin = copy.deepcopy(layer)
    assert twin.layer_id != 9 and int(twin._dropout_key) == _kernels.dropout_key(77, twin.layer_id)
    assert int(layer._dropout_key) == _kernels.dropout_key(77, 9), "the copy has its own buffers"
    layer.dropout_calls = 41
    seen = []
    if fused_eager:  # the one-node path calls the attention op's implementation: seed tensor is argument 9
        original_impl = fused._packed_fwd_impl

        def spy_impl(*args):
            seen.append(args[9])
            return original_impl(*args)

        monkeypatch.setattr(fused, "_packed_fwd_impl", spy_impl)
    else:
        original = _kernels.attention_qkvpacked

        def spy(*args, seed=None, **kwargs):
            seen.append(seed)
            return original(*args, seed=seed, **kwargs)

        monkeypatch.setattr(_kernels, "attention_qkvpacked", spy)
    layer(torch.randn(BATCH, SEQ, HIDDEN))
    assert layer.dropout_calls == 42 and twin.dropout_calls == 0, "the copy has its own counter"
    (seed,) = seen
    assert isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.dim() == 0
    assert int(seed) == _kernels.dropout_seed(77, 9, 42, 0)
    assert "_extra_state" in layer.state_dict() and "_dropout_calls" not in layer.state_dict()
    assert layer.get_extra_state().tolist() == [77, 42]


# --- torch.compile --------------------------------------------------------------------------------

def _compiled_steps_without_recompiles(compiled, layer):
    """Step 1 compiles; steps 2..STEPS must reuse the graph (error_on_recompile)."""
    results = _steps(compiled, layer, steps=1)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        results += _steps(compiled, layer, start=1)
    assert counters["stats"]["unique_graphs"] == graphs, "a step after the first compiled a new graph"
    return results


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
def test_compiled_layer_trains_without_recompiles_and_equals_eager_bitwise(pre_ln):
    torch._dynamo.reset()
    eager_layer, compiled_layer = _layers(pre_layer_norm=pre_ln)
    want = _steps(eager_layer, eager_layer)
    got = _compiled_steps_without_recompiles(torch.compile(compiled_layer, backend="aot_eager"), compiled_layer)
    _assert_bitwise(got, want, "aot_eager")
    assert compiled_layer.dropout_calls == eager_layer.dropout_calls == STEPS
    assert not torch.equal(want[0][0], want[1][0]), "steps must draw different masks"


def test_compiled_layer_with_inductor_equals_eager():
    """Inductor generates its own C++ code for the elementwise ops (GELU, residual adds; the
    splitmix64 seeds): the seeds, hence the masks, are identical; floating-point results agree
    to the fp32 tolerance (its fused kernels may round differently), dropout positions exactly."""
    torch._dynamo.reset()
    eager_layer, compiled_layer = _layers(attn_dropout_checkpoint=True)
    want = _steps(eager_layer, eager_layer)
    got = _compiled_steps_without_recompiles(torch.compile(compiled_layer, backend="inductor"), compiled_layer)
    from tests.utils import assert_close

    for step, (g, w) in enumerate(zip(got, want)):
        for name, a, b in zip(("out", "dx", "d attn_qkvw"), g, w):
            assert_close(a, b, atol=1e-4 if name == "d attn_qkvw" else None, name=f"inductor step {step} {name}")
    assert compiled_layer.dropout_calls == STEPS


def test_stack_with_a_padding_mask_compiles_one_graph_for_every_layer_and_step():
    """Three layers (different layer_ids, so different seeds), each compiled on its own, fed a
    new padding-mask tensor every step: the layers share one graph (nothing layer-specific is a
    constant in it, the mask cache is bypassed under compile) and equal the eager stack bitwise."""
    torch._dynamo.reset()
    eager = _layers(3)
    compiled_layers = _layers(3)
    for i, (e, c) in enumerate(zip(eager, compiled_layers)):
        e.layer_id = c.layer_id = 10 + i
    compiled = [torch.compile(layer, backend="aot_eager") for layer in compiled_layers]
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0

    def stack(layers):
        def run(x):
            for layer in layers:
                x = layer(x, mask.clone())  # a new mask tensor per call
            return x
        return run

    want = _steps(stack(eager), eager[0], steps=3)
    graphs = counters["stats"]["unique_graphs"]
    got = _steps(stack(compiled), compiled_layers[0], steps=1)
    assert counters["stats"]["unique_graphs"] == graphs + 1, "the layers compiled more than one graph"
    with torch._dynamo.config.patch(error_on_recompile=True):
        got += _steps(stack(compiled), compiled_layers[0], steps=3, start=1)
    _assert_bitwise(got, want, "compiled stack")


def test_checkpoint_recompute_does_not_advance_the_counter_eager_and_compiled():
    """An outer activation checkpoint replays the forward during backward: the counter must not
    move, so the replay draws the original masks and the gradients equal the plain run's."""
    torch._dynamo.reset()
    plain, eager_ckpt, compiled_ckpt = _layers(3)
    compiled = torch.compile(compiled_ckpt, backend="aot_eager")
    want = _steps(plain, plain, steps=3)

    def checkpointed(fn):
        return lambda x: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)

    _assert_bitwise(_steps(checkpointed(eager_ckpt), eager_ckpt, steps=3), want, "eager + checkpoint")
    _assert_bitwise(_steps(checkpointed(compiled), compiled_ckpt, steps=3), want, "compiled + checkpoint")
    assert plain.dropout_calls == eager_ckpt.dropout_calls == compiled_ckpt.dropout_calls == 3


def test_restoring_a_state_dict_continues_the_stream_under_compile():
    torch._dynamo.reset()
    trained, resumed, fresh = _layers(3)
    _steps(trained, trained, steps=2)  # forward calls 1, 2
    resumed.load_state_dict(trained.state_dict())  # _extra_state: [seed, 2]
    got = _steps(torch.compile(resumed, backend="aot_eager"), resumed, steps=1)  # call 3
    assert resumed.dropout_calls == 3
    fresh.dropout_calls = 2
    _assert_bitwise(got, _steps(fresh, fresh, steps=1), "resumed at call 3")
    fresh.dropout_calls = 0
    assert not torch.equal(got[0][0], _steps(fresh, fresh, steps=1)[0][0]), "call 1 must differ from call 3"
