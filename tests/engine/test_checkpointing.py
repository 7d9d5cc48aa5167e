"""Activation checkpointing: same gradients as the plain run (dropout on), fewer saved bytes,
CPU checkpointing, profile counters, boundary synchronization, configure() and its warnings.

`python -m tests.engine.test_checkpointing` prints the saved-bytes table that
docs/activation_checkpointing.md quotes; a test checks the file holds the measured numbers.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tachyon
from tachyon.config import ConfigError, load_config
from tachyon.engine import activation_checkpointing as ckpt
from tests.utils import assert_close

DOC = Path(__file__).resolve().parents[2] / "docs" / "activation_checkpointing.md"
LAYERS, BATCH, SEQ, HIDDEN = 12, 4, 32, 64


@pytest.fixture(autouse=True)
def _fresh_settings():
    ckpt.reset()
    yield
    ckpt.reset()


class Block(torch.nn.Module):
    """A small transformer-ish block: x + LayerNorm(Dropout(GELU(Linear(x)))). x: [batch, seq, hidden]."""

    def __init__(self, hidden: int, p: float = 0.1):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(F.dropout(F.gelu(self.linear(x)), self.p, self.training))


class Model(torch.nn.Module):
    """``mode``: "plain", "every_layer" (checkpoint each block) or "sequential:<segments>"."""

    def __init__(self, layers: int = LAYERS, hidden: int = HIDDEN, p: float = 0.1):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(hidden, p) for _ in range(layers))

    def forward(self, x: torch.Tensor, mode: str = "plain") -> torch.Tensor:
        if mode.startswith("sequential"):
            segments = int(mode.split(":")[1]) if ":" in mode else None
            return ckpt.checkpoint_sequential(list(self.blocks), segments, x)
        for block in self.blocks:
            x = ckpt.checkpoint(block, x) if mode == "every_layer" else block(x)
        return x


def _grads(model, x, mode, seed=1234):
    """Output, input gradient and every parameter gradient of sum(out * fixed weights)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    weights = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
    torch.manual_seed(seed)
    out = model(x, mode)
    (out * weights).sum().backward()
    return {"out": out.detach(), "dx": x.grad, **{n: p.grad.clone() for n, p in model.named_parameters()}}


def _assert_same(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        assert_close(got[name], expected[name], name=name)


def _model_and_input(layers=LAYERS, p=0.1):
    torch.manual_seed(0)
    return Model(layers, HIDDEN, p), torch.randn(BATCH, SEQ, HIDDEN)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("mode", ["every_layer", "sequential:4", "sequential:5"])
def test_gradients_equal_the_plain_run_with_dropout_on(mode):
    model, x = _model_and_input()
    plain = _grads(model, x, "plain")
    # dropout really drops: a different seed changes the output
    assert not torch.equal(_grads(model, x, "plain", seed=99)["out"], plain["out"])
    _assert_same(_grads(model, x, mode), plain)


def test_without_rng_preservation_the_comparison_fails():
    """The control: recomputing with a different dropout mask gives different gradients, so the
    test above would catch a checkpoint that does not restore the RNG state."""
    model, x = _model_and_input(layers=2)
    plain = _grads(model, x, "plain")
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    torch.manual_seed(1234)
    out = xx
    for block in model.blocks:
        out = torch.utils.checkpoint.checkpoint(block, out, use_reentrant=False, preserve_rng_state=False)
    (out * torch.linspace(-1, 1, x.numel()).reshape(x.shape)).sum().backward()
    with pytest.raises(AssertionError, match="elements differ"):
        assert_close(model.blocks[0].linear.weight.grad, plain["blocks.0.linear.weight"])


def test_kwargs_non_tensor_args_and_multiple_outputs():
    lin = torch.nn.Linear(5, 7)
    x = torch.randn(3, 5, requires_grad=True)

    def fn(a, scale, *, bias_shift):
        h = F.gelu(lin(a)) * scale + bias_shift
        return h, h.sum(-1)

    h1, s1 = fn(x, 0.5, bias_shift=1.0)
    g_plain = torch.autograd.grad(h1.sum() + s1.sum(), [x, lin.weight])
    h2, s2 = ckpt.checkpoint(fn, x, 0.5, bias_shift=1.0)
    g_ckpt = torch.autograd.grad(h2.sum() + s2.sum(), [x, lin.weight])
    for a, b in zip(g_ckpt, g_plain):
        assert_close(a, b)


def test_without_grad_it_just_runs_the_function():
    model, x = _model_and_input(layers=2)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x, "every_layer"), model(x, "plain"))


def test_checkpoint_rejects_a_non_callable():
    with pytest.raises(ValueError, match="function must be callable; got Tensor"):
        ckpt.checkpoint(torch.ones(1), torch.ones(1))


# --------------------------------------------------------------------------- memory


class SavedBytes:
    """Counts bytes of unique storages saved for backward (model parameters excluded)."""

    def __init__(self, model):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.skip:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@functools.lru_cache(maxsize=None)  # exact byte counts: the same on every call
def measure_saved_bytes(mode: str) -> int:
    model, x = _model_and_input()
    counter = SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        torch.manual_seed(0)
        out = model(x.requires_grad_(), mode)
    out.sum().backward()
    return counter.total


VARIANTS = [
    ("plain", "no checkpointing"),
    ("every_layer", "`checkpoint` around each of the 12 blocks"),
    ("sequential:4", "`checkpoint_sequential(blocks, 4, x)`: 3 checkpointed segments of 3 blocks + 3 plain blocks"),
]


def saved_bytes_table() -> str:
    """The markdown table quoted in docs/activation_checkpointing.md (bytes are exact, not timings)."""
    plain = measure_saved_bytes("plain")
    lines = ["| variant | saved for backward (bytes) | KiB | vs. plain |", "| --- | ---: | ---: | ---: |"]
    for mode, label in VARIANTS:
        saved = measure_saved_bytes(mode)
        lines.append(f"| {label} | {saved} | {saved / 1024:.1f} | {saved / plain:.3f} |")
    return "\n".join(lines)


def test_checkpointing_every_layer_saves_only_the_layer_inputs():
    plain = measure_saved_bytes("plain")
    every = measure_saved_bytes("every_layer")
    input_bytes = BATCH * SEQ * HIDDEN * 4
    assert every == LAYERS * input_bytes, f"expected only the 12 block inputs saved, got {every} bytes"
    assert every < plain / 4, f"checkpointed {every} bytes is not much below plain {plain} bytes"
    assert every < measure_saved_bytes("sequential:4") < plain


def test_the_docs_table_holds_the_measured_numbers():
    table = saved_bytes_table()
    assert table in DOC.read_text(), (
        "docs/activation_checkpointing.md is out of date; regenerate the table with "
        f"`python -m tests.engine.test_checkpointing`:\n{table}"
    )


# --------------------------------------------------------------------------- configured behaviour


def test_cpu_checkpointing_stores_region_inputs_through_the_hook():
    with pytest.warns(UserWarning, match="partition_activations has no effect"):
        ckpt.configure(partition_activations=True, checkpoint_in_cpu=True)
    model, x = _model_and_input()
    plain = _grads(model, x, "plain")
    got = _grads(model, x, "every_layer")
    _assert_same(got, plain)
    stats = ckpt.get_profile()
    assert stats["offloaded_tensors"] == LAYERS
    assert stats["offloaded_bytes"] == LAYERS * BATCH * SEQ * HIDDEN * 4


@pytest.mark.gpu
def test_cpu_checkpointing_keeps_inputs_in_pinned_host_memory_on_cuda(monkeypatch):
    with pytest.warns(UserWarning):
        ckpt.configure(partition_activations=True, checkpoint_in_cpu=True)
    packed = []
    original = ckpt._pack_to_cpu
    # (torch 2.11's checkpoint also saves an empty holder tensor, which stays where it is)
    monkeypatch.setattr(ckpt, "_pack_to_cpu", lambda t: packed.append(original(t)) or packed[-1] if t.numel()
                        else original(t))
    model, x = _model_and_input()
    model, x = model.cuda(), x.cuda()
    got = _grads(model, x, "every_layer")
    ckpt.configure()
    plain = _grads(model, x, "plain")
    _assert_same(got, plain)
    assert len(packed) == LAYERS
    assert all(t.device.type == "cpu" and t.is_pinned() and dev.type == "cuda" for dev, t in packed)


@pytest.mark.parametrize("profile", [True, False])
def test_profile_counts_recomputations_and_their_time(profile, caplog):
    ckpt.configure(profile=profile)
    model, x = _model_and_input(layers=3)
    _grads(model, x, "every_layer")
    stats = ckpt.get_profile()
    assert stats["calls"] == 3 and stats["recomputes"] == 3
    assert (stats["recompute_s"] > 0) == profile
    with caplog.at_level(logging.INFO, logger=ckpt.__name__):
        line = ckpt.log_profile()
    assert "3 checkpointed calls, 3 recomputations" in line and line in caplog.text
    ckpt.reset_profile()
    assert ckpt.get_profile()["calls"] == 0


@pytest.mark.parametrize("synchronize", [True, False])
def test_synchronize_checkpoint_boundary_calls_cuda_synchronize(synchronize, monkeypatch):
    """No GPU here: pretend CUDA is up and count torch.cuda.synchronize calls."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    ckpt.configure(synchronize=synchronize)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    ckpt.checkpoint(lin, x).sum().backward()
    # before and after the forward, before and after the recomputation
    assert len(calls) == (4 if synchronize else 0)


# --------------------------------------------------------------------------- configure


class FakeMPU:
    def __init__(self, size):
        self.size = size

    def get_tensor_model_parallel_world_size(self):
        return self.size


def test_partition_activations_warns_without_tensor_parallelism():
    with pytest.warns(UserWarning, match="partition_activations has no effect with tensor-parallel size 1"):
        ckpt.configure(FakeMPU(1), partition_activations=True)
    assert ckpt.get_settings().partition_activations


def test_partition_activations_needs_the_tensor_parallel_rank_and_group():
    """A tensor-parallel size > 1 is split over (tests/parallel/test_engine_parallel.py); an mpu
    that reports the size but not the rank and group it splits over is refused."""
    with pytest.raises(ValueError, match=r"get_tensor_model_parallel_world_size\(\) = 2 but not "
                                         r"get_tensor_model_parallel_rank\(\) and get_tensor_model_parallel_group\(\)"):
        ckpt.configure(FakeMPU(2), partition_activations=True)
    with pytest.raises(ValueError, match="mpu_ should have get_tensor_model_parallel_world_size"):
        ckpt.configure(object(), partition_activations=True)
    assert not ckpt.is_configured()


def test_cpu_checkpointing_needs_partition_activations():
    with pytest.raises(ValueError, match="needs partition_activations=True"):
        ckpt.configure(checkpoint_in_cpu=True)


def test_contiguous_memory_optimization_warns_once(recwarn):
    ckpt.configure(contiguous_checkpointing=True)
    ckpt.configure(contiguous_checkpointing=True)
    messages = [str(w.message) for w in recwarn if "contiguous_memory_optimization" in str(w.message)]
    assert len(messages) == 1 and "no effect" in messages[0]


SECTION = {
    "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
    "number_checkpoints": 3, "synchronize_checkpoint_boundary": True, "profile": True,
}


@pytest.mark.parametrize("form", ["dict", "TachyonConfig", "path", "Hjson path"])
def test_configure_reads_the_config_section(form, tmp_path):
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "activation_checkpointing": SECTION}
    if form == "TachyonConfig":
        config = load_config(config, world_size=8)
    elif form == "path":
        (tmp_path / "ds.json").write_text(json.dumps(config))
        config = str(tmp_path / "ds.json")
    elif form == "Hjson path":  # a comment and a trailing comma: Hjson, as DeepSpeed reads config files
        text = json.dumps(config, indent=1).replace('"train_batch_size": 16,', '// the global batch\n "train_batch_size": 16,')
        (tmp_path / "ds.hjson").write_text(text[:-2] + ",\n}")
        config = str(tmp_path / "ds.hjson")
    with pytest.warns(UserWarning, match="partition_activations"):
        ckpt.configure(None, deepspeed_config=config)
    assert ckpt.is_configured()
    assert ckpt.get_settings() == ckpt.CheckpointingSettings(**SECTION)


def test_keywords_override_the_config_and_reset_restores_defaults():
    with pytest.warns(UserWarning):
        ckpt.configure(deepspeed_config={"activation_checkpointing": SECTION}, checkpoint_in_cpu=False,
                       num_checkpoints=6, profile=False, synchronize=False)
    s = ckpt.get_settings()
    assert (s.cpu_checkpointing, s.number_checkpoints, s.profile) == (False, 6, False)
    assert not s.synchronize_checkpoint_boundary
    assert s.partition_activations
    ckpt.reset()
    assert not ckpt.is_configured() and ckpt.get_settings() == ckpt.CheckpointingSettings()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"deepspeed_config": {"activation_checkpointing": {"profil": True}}}, ConfigError, "did you mean"),
        ({"deepspeed_config": {"activation_checkpointing": {"profile": "yes"}}}, ConfigError,
         "activation_checkpointing.profile"),
        ({"deepspeed_config": {"profile": True}}, ValueError, "pass the whole config"),
        ({"deepspeed_config": 3}, ValueError, "should be a TachyonConfig, a dict or a path"),
        ({"deepspeed_config": "/nonexistent/ds.json"}, ConfigError, "file not found"),
        ({"num_checkpoints": 0}, ValueError, "num_checkpoints must be a positive int"),
        ({"profile": "yes"}, ValueError, "profile must be True, False or None"),
    ],
)
def test_bad_configure_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        ckpt.configure(**kwargs)
    assert not ckpt.is_configured()


def test_checkpoint_sequential_uses_number_checkpoints_and_checks_segments():
    model, x = _model_and_input(layers=4)
    with pytest.raises(ValueError, match="give segments or configure number_checkpoints"):
        ckpt.checkpoint_sequential(list(model.blocks), None, x)
    with pytest.raises(ValueError, match=r"segments must be an int in \[1, 4\]"):
        ckpt.checkpoint_sequential(list(model.blocks), 5, x)
    with pytest.raises(ValueError, match="functions is empty"):
        ckpt.checkpoint_sequential([], 1, x)
    ckpt.configure(num_checkpoints=2)
    plain = _grads(model, x, "plain")
    _assert_same(_grads(model, x, "sequential"), plain)
    assert ckpt.get_profile()["calls"] == 1  # 2 segments: the first checkpointed, the last plain
    seq = torch.nn.Sequential(*model.blocks)
    torch.manual_seed(5)
    a = ckpt.checkpoint_sequential(seq, 2, x)
    torch.manual_seed(5)
    assert torch.equal(a, model(x))


def test_fp8_regions_with_cpu_checkpointing_equal_the_plain_run():
    """An FP8 region (fp8_autocast around the forward) with its inputs stored in CPU memory: the
    recompute re-enters the autocast with the forward's scales (tachyon.fp8.checkpoint; the full
    comparison with TransformerLayers is tests/fp8/test_checkpoint.py), so every gradient and the
    FP8 state equal the run without checkpointing."""
    import tachyon.nn as tnn
    from tachyon.fp8 import fp8_autocast

    with pytest.warns(UserWarning, match="partition_activations has no effect"):
        ckpt.configure(partition_activations=True, checkpoint_in_cpu=True)
    torch.manual_seed(0)
    blocks = [tnn.LayerNormMLP(32, 64) for _ in range(3)]
    copies = [[tnn.LayerNormMLP(32, 64) for _ in range(3)] for _ in range(2)]
    results = []
    for mode, modules in zip(("plain", "sequential"), copies):
        for module, block in zip(modules, blocks):
            module.load_state_dict(block.state_dict())
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):  # the second step casts with the scales the first one set
            x = torch.randn(16, 32, generator=gen).requires_grad_()
            with fp8_autocast():
                if mode == "sequential":  # the first two checkpointed, the last plain
                    y = ckpt.checkpoint_sequential(modules, 3, x)
                else:
                    y = modules[2](modules[1](modules[0](x)))
            y.backward(torch.randn(16, 32, generator=gen))
        results.append([x.grad, *(p.grad for m in modules for p in m.parameters()),
                        *(s for m in modules for g in m.fp8_scaling.values() for s in (g.input.scale, g.weight.scale,
                                                                                       g.grad_output.scale))])
    assert ckpt.get_profile()["offloaded_tensors"] == 4  # 2 steps x 2 checkpointed segments
    for k, (got, want) in enumerate(zip(results[1], results[0])):
        assert torch.equal(got, want), f"tensor {k} differs"


def test_public_module_path():
    assert tachyon.checkpointing.checkpoint is ckpt.checkpoint
    assert tachyon.checkpointing.configure is ckpt.configure


if __name__ == "__main__":
    print(saved_bytes_table())
