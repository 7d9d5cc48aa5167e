"""The seed documents' own code, ported by changing its imports to tachyon.compat, runs on tachyon.

Which snippets run (tests/compat/seed_snippets.py has the code and every adaptation):

| snippet | seed | runs here |
| --- | --- | --- |
| transformer-kernel-tutorial | 000 | yes: config + 2 layers (CPU sizes), forward/backward in fp16 |
| transformer-kernel-api | 001 | yes: every documented config parameter, initial_weights/biases |
| te-getting-started | 002 | yes: basic layer, te.Linear/LayerNorm, fused modules, TransformerLayer, FP8 |
| training-guide-activation-checkpointing + -loop | 003 | yes: 1 process (ZeRO-1/2, bf16); 2 gloo ranks (slow) |
| training-guide-hccl | 003 | the HCCL backend is refused with the allowed ones |
| overview-init-inference | 004 | when tachyon.inference exists (else: its NotImplementedError) |
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.compat import seed_snippets as S
from tests.utils import assert_close, assert_close_to_reference, run_distributed

HERE = Path(__file__).parent


def changed_lines(original: str, ported: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in zip(original.splitlines(), ported.splitlines()) if a != b]


@pytest.mark.parametrize("snippet", S.SNIPPETS, ids=lambda s: s.name)
def test_porting_changes_only_import_lines(snippet):
    ported = S.port(snippet.code)
    assert len(ported.splitlines()) == len(snippet.code.splitlines())
    changed = changed_lines(snippet.code, ported)
    assert changed, f"{snippet.name}: nothing to port? (no DeepSpeed / Transformer Engine import)"
    for before, after in changed:
        assert before.lstrip().startswith(("import ", "from ")), f"non-import line changed: {before!r}"
        assert "tachyon.compat." in after, after
    assert "import deepspeed" not in ported.replace("tachyon.compat.deepspeed", "")
    assert "transformer_engine" not in ported.replace("tachyon.compat.transformer_engine", "")


@pytest.fixture
def cpu_cuda_calls(monkeypatch):
    """``.cuda()`` as written in the snippets is a no-op without a GPU (the code stays as written)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
        monkeypatch.setattr(nn.Module, "cuda", lambda self, *a, **k: self)


# ---------------------------------------------------------------------- 000 / 001
def test_transformer_kernel_tutorial(cpu_cuda_calls):
    code = S.KERNEL_TUTORIAL.code
    for before, after in S.KERNEL_TUTORIAL_SIZES.items():
        assert before in code
        code = code.replace(before, after)
    source = S.port(code)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            exec(source, {"self": self, "nn": nn, "copy": copy})

    model = Model()
    assert len(model.layer) == 2
    ids = [layer.layer_id for layer in model.layer]
    assert len(set(ids)) == 2, f"deepcopied layers must have distinct layer ids; got {ids}"
    x = torch.randn(2, 16, 64, dtype=torch.float16, requires_grad=True)
    h = x
    for layer in model.layer:
        h = layer(h, torch.ones(2, 16, dtype=torch.bool))
    h.float().square().mean().backward()
    assert h.shape == (2, 16, 64) and h.dtype == torch.float16
    assert torch.isfinite(h).all() and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_transformer_kernel_api_reference():
    import tachyon.nn as tnn

    h, inter = 64, 256
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(h, h, generator=gen) * 0.02 for _ in range(4)] + [torch.ones(h)] + \
              [torch.randn(inter, h, generator=gen) * 0.02, torch.randn(h, inter, generator=gen) * 0.02, torch.ones(h)]
    biases = [torch.randn(h, generator=gen) * 0.02 for _ in range(4)] + [torch.zeros(h)] + \
             [torch.zeros(inter), torch.zeros(h), torch.zeros(h)]
    scope = {"initial_weights": weights, "initial_biases": biases}
    exec(S.port(S.KERNEL_API.code), scope)
    first, second = scope["first"], scope["second"]
    assert isinstance(first, tnn.TransformerKernelLayer) and isinstance(scope["config"], tnn.TransformerKernelConfig)
    assert second.layer_id == first.layer_id + 1, "layer_id counts every layer built"
    assert_close(second.attn_qkvw.detach(), torch.cat(weights[:3]), name="attn_qkvw from initial_weights")
    assert_close(second.inter_w.detach(), weights[5], name="inter_w from initial_weights")


# ---------------------------------------------------------------------- 002
def test_transformer_engine_getting_started(cpu_cuda_calls, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(HERE))  # the tutorial's `import quickstart_utils as utils`
    code = S.TE_TUTORIAL.code
    assert S.TE_SIZES_ORIGINAL in code
    scope: dict = {}
    exec(S.port(code.replace(S.TE_SIZES_ORIGINAL, S.TE_SIZES_CPU)), scope)
    assert capsys.readouterr().out.count("Mean time:") == 5  # one speedometer per step of the progression
    import tachyon.nn as tnn

    assert isinstance(scope["te_transformer"], tnn.TransformerLayer)
    assert isinstance(scope["fused_te_transformer"].ln_mlp, tnn.LayerNormMLP)
    x = scope["x"]
    # every step of the progression computes the basic layer's function (dropout off to compare):
    # held to the 2x-of-PyTorch rule against the basic layer in float64
    basic = scope["basic_transformer"].eval()
    oracle = copy.deepcopy(basic).double()
    causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).triu(1)
    with torch.no_grad():
        want = basic(x, attention_mask=None)
        for name in ("basic_te_transformer", "fused_te_transformer"):
            got = scope[name].eval()(x, attention_mask=None)
            assert_close_to_reference(got, want, oracle(x.double(), attention_mask=None), name=name)
        got = scope["te_transformer"].eval()(x, attention_mask=None)  # te.TransformerLayer is causal by default
        assert_close_to_reference(got, basic(x, attention_mask=causal), oracle(x.double(), attention_mask=causal),
                                  name="te.TransformerLayer")
    # the FP8 step ran in FP8 (every GEMM's scaling state says so) and stays close to high precision
    gemms = [g for m in scope["te_transformer"].modules() for g in getattr(m, "fp8_scaling", {}).values()]
    assert len(gemms) == 4 and all(g.ran_fp8 for g in gemms), "the TransformerLayer's 4 GEMMs did not run in FP8"
    te_layer, te = scope["te_transformer"].eval(), scope["te"]
    with torch.no_grad():
        high = te_layer(x, attention_mask=None).float()
        with te.fp8_autocast(enabled=True, fp8_recipe=scope["fp8_recipe"]):
            low = te_layer(x, attention_mask=None).float()
    error = (low - high).norm() / high.norm()
    assert 0 < error < 0.05, f"FP8 vs high precision relative error {error:.4f} (E4M3 keeps ~2 significant digits)"


# ---------------------------------------------------------------------- 003
GUIDE_CONFIGS = {
    "bf16-zero1": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "bf16-zero2": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                                      "reduce_bucket_size": 5000}},
}
ACTIVATION_CHECKPOINTING = {  # the guide's validated defaults
    "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": False, "profile": False,
}
HIDDEN, HEADS, SEQ, MICRO = 32, 4, 8, 2


def _guide_model(checkpoint_activations: bool):
    """The guide's BertEncoder (ported) over DeepSpeedTransformerLayer, plus a loss head."""
    import tachyon.compat.deepspeed as deepspeed

    class BertLayer(nn.Module):  # the user's layer: Habana's signature (x, layer_norm_input, mask)
        def __init__(self, config):
            super().__init__()
            self.kernel = deepspeed.DeepSpeedTransformerLayer(config.kernel)

        def forward(self, hidden_states, layer_norm_input, attention_mask):
            return self.kernel(hidden_states, attention_mask), layer_norm_input

    scope = {"nn": nn, "BertLayer": BertLayer}
    exec(S.port(S.GUIDE_MODEL.code), scope)
    kernel = deepspeed.DeepSpeedTransformerConfig(
        batch_size=MICRO, max_seq_length=SEQ, hidden_size=HIDDEN, heads=HEADS, attn_dropout_ratio=0.1,
        hidden_dropout_ratio=0.1, num_hidden_layers=2, initializer_range=0.02, seed=3, bf16=True)
    config = argparse.Namespace(num_hidden_layers=2, output_all_encoded_layers=False, kernel=kernel)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.encoder = scope["BertEncoder"](config).to(torch.bfloat16)
            self.encoder._checkpoint_activations = checkpoint_activations

        def forward(self, batch):
            x, mask = batch
            return self.encoder(x, mask).float().square().mean()

    return Model()


def run_guide(config_name: str, checkpoint_activations: bool, tmp: str, dist_backend: str | None,
              steps: int = 3) -> dict:
    """The guide's loop (ported) for one config; returns the final parameters and losses."""
    import torch.distributed as dist

    config = dict(GUIDE_CONFIGS[config_name], activation_checkpointing=ACTIVATION_CHECKPOINTING,
                  train_micro_batch_size_per_gpu=MICRO,
                  optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    path = Path(tmp) / f"{config_name}-rank{rank}.json"  # one file per rank: no rank reads another's write
    path.write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(10 + rank)
    batch = (torch.randn(MICRO, SEQ, HIDDEN, generator=gen).to(torch.bfloat16), torch.ones(MICRO, SEQ, dtype=torch.bool))
    data = [batch] * steps  # one batch again and again: the loss must go down
    model = _guide_model(checkpoint_activations)
    losses = []

    class Loader(list):
        def __iter__(self):
            for batch in super().__iter__():
                yield batch

    scope = {"argparse": argparse, "argv": ["--deepspeed", "--deepspeed_config", str(path)], "model": model,
             "data_loader": Loader(data), "dist_backend": dist_backend}
    source = S.port(S.GUIDE_LOOP.code).replace("    model_engine.backward(loss)",
                                               "    losses.append(float(loss.detach()))\n    model_engine.backward(loss)")
    scope["losses"] = losses
    if dist_backend is None:  # one process: the call is made, torch.distributed stays off
        source = source.replace("deepspeed.init_distributed(dist_backend=dist_backend)\n", "")
    exec(source, scope)
    engine = scope["model_engine"]
    assert scope["cmd_args"].deepspeed and engine.zero_optimization_stage() == config["zero_optimization"]["stage"]
    return {"losses": losses, "params": [p.detach().float().clone() for p in model.parameters()]}


def _fresh_layer_ids(monkeypatch=None) -> None:
    """Layer ids from 0 again (DeepSpeed's class counter), so rebuilt models draw the same dropout streams."""
    from tachyon.nn import TransformerKernelLayer

    if monkeypatch is None:
        TransformerKernelLayer.layer_id = 0  # in a spawned rank: nothing to restore
    else:
        monkeypatch.setattr(TransformerKernelLayer, "layer_id", 0)


def test_training_guide_loop_one_process(tmp_path, one_thread, monkeypatch):
    runs = {}
    for name, config, checkpointed in (("zero1", "bf16-zero1", False), ("zero1_ckpt", "bf16-zero1", True),
                                       ("zero2", "bf16-zero2", True)):
        _fresh_layer_ids(monkeypatch)
        runs[name] = run_guide(config, checkpointed, str(tmp_path), None)
    zero1, zero1_ckpt, zero2 = runs["zero1"], runs["zero1_ckpt"], runs["zero2"]
    assert zero1["losses"][-1] < zero1["losses"][0], f"the loop does not train: {zero1['losses']}"
    # activation checkpointing (the guide's BertEncoder path) changes nothing numerically
    assert zero1_ckpt["losses"] == zero1["losses"]
    for a, b in zip(zero1_ckpt["params"], zero1["params"]):
        assert torch.equal(a, b)
    for a, b in zip(zero2["params"], zero1["params"]):
        assert_close(a.to(torch.bfloat16), b.to(torch.bfloat16), name="ZeRO-2 vs ZeRO-1")


def _guide_rank(tmp: str) -> dict:
    out = {}
    for name in GUIDE_CONFIGS:
        _fresh_layer_ids()
        out[name] = run_guide(name, True, tmp, "gloo")
    return out


@pytest.mark.distributed
@pytest.mark.slow  # ~20 s: two ranks, two configs
def test_training_guide_loop_two_ranks(tmp_path):
    results = run_distributed(_guide_rank, 2, str(tmp_path), init=False, timeout=240)
    for name in GUIDE_CONFIGS:
        for a, b in zip(results[0][name]["params"], results[1][name]["params"]):
            assert torch.equal(a, b), f"{name}: ranks disagree on the parameters"
        losses = results[0][name]["losses"]
        assert losses[-1] < losses[0], f"{name}: no training progress {losses}"
    for a, b in zip(results[0]["bf16-zero2"]["params"], results[0]["bf16-zero1"]["params"]):
        assert_close(a.to(torch.bfloat16), b.to(torch.bfloat16), name="ZeRO-2 vs ZeRO-1 on 2 ranks")


def test_training_guide_hccl_backend_is_refused_naming_the_allowed_ones():
    scope = {"init_method": None}
    with pytest.raises(ValueError, match=r"dist_backend must be one of .*'nccl'.*'gloo'.*got 'hccl'"):
        exec(S.port(S.GUIDE_HCCL.code), scope)


# ---------------------------------------------------------------------- 004
def _inference_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in S.OVERVIEW_INFERENCE.requires) and \
        hasattr(importlib.import_module("tachyon.inference"), "init_inference")


def test_overview_init_inference():
    transformers = pytest.importorskip("transformers", reason="the snippet injects an HF GPT-2")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        want = hf(ids).logits
    scope = {"model": copy.deepcopy(hf), "parallel_degree": 1, "mpu": None, "checkpoint_list": None,
             "args": argparse.Namespace(dtype=torch.float32),
             "original_layer_implementation": transformers.models.gpt2.modeling_gpt2.GPT2Block}
    source = S.port(S.OVERVIEW_INFERENCE.code)
    if not _inference_available():
        with pytest.raises(NotImplementedError, match="inference engine is not in this version of tachyon"):
            exec(source, scope)
        return
    exec(source, scope)
    with torch.no_grad():
        got = scope["model"](ids).logits
    assert_close(got, want, name="injected GPT-2 vs HF")


def test_snippet_table_lists_every_snippet():
    doc = sys.modules[__name__].__doc__
    for snippet in S.SNIPPETS:
        assert snippet.name.split("-loop")[0].split("-activation")[0] in doc, snippet.name
