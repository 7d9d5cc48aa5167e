"""Layouts ``tachyon.initialize`` refuses, in one process, before any state changes: the
environment says 4 (or 8) ranks, so a layout that passed would start torch.distributed; each of
these must fail first, naming the problem, with the model untouched and no process group."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tachyon
from tachyon.config import ConfigError
from tachyon.nn import TransformerLayer
from tachyon.parallel.pipeline import PipelineModule
from tachyon.parallel.pipeline.gpt import gpt_layer_specs, gpt_loss
from tests.parallel import _engine_training as E
from tests.parallel import _pp_training as T
from tests.utils import run_distributed


@pytest.fixture
def world(monkeypatch):
    """A planned job of ``n`` ranks (RANK / WORLD_SIZE set, torch.distributed not started). A
    layout that passed every check would start torch.distributed and wait for the other ranks:
    that step fails the test instead."""

    def planned(n: int) -> None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(n))

    def reached() -> None:
        raise AssertionError("initialize accepted the layout and went on to start torch.distributed")

    monkeypatch.setattr("tachyon.engine.start._init_distributed", reached)
    assert not dist.is_initialized()
    return planned


class Stack(nn.Module):
    """Two TransformerLayers (the shapes tensor parallelism checks), hidden 32."""

    def __init__(self, heads: int = 4, kv_heads: int | None = None, ffn: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(32, ffn, heads, num_gqa_groups=kv_heads, hidden_dropout=0.0,
                                                      attention_dropout=0.0) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class TiedLM(nn.Module):
    """An embedding whose weight is also the LM head's (parallelize's default plan splits the
    vocabulary of such a pair)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, 32)
        self.head = nn.Linear(32, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        return self.head(self.embedding(ids))


def _refused(model: nn.Module, config: dict, error: type, message: str, **kw) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    classes = [type(m) for m in model.modules()]
    with pytest.raises(error, match=re.escape(message)):
        tachyon.initialize(model=model, config=config, **kw)
    assert not dist.is_initialized(), "refused after torch.distributed was started"
    assert [type(m) for m in model.modules()] == classes, "the model was (partly) made tensor parallel"
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items()), "parameters changed"
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("ranks", "model", "sections", "message"), [
    (4, T.build_gpt, {"tensor_parallel": {"tp_size": 3}},
     "pipeline stages x tensor-parallel size = 1 x 3 = 3 (from the config) does not divide the world size 4"),
    (8, T.build_gpt, {"tensor_parallel": {"tp_size": 8}},
     "num_attention_heads=4 is not divisible by the tensor-parallel size tp=8"),
    (4, lambda: Stack(heads=4, kv_heads=2), {"tensor_parallel": {"tp_size": 4}},
     "num_gqa_groups (key/value heads)=2 is not divisible by the tensor-parallel size tp=4"),
    (4, lambda: Stack(ffn=66), {"tensor_parallel": {"tp_size": 4}},
     "ffn_hidden_size=66 is not divisible by the tensor-parallel size tp=4"),
    (4, lambda: TiedLM(66), {"tensor_parallel": {"tp_size": 4}},
     "num_embeddings (vocab)=66 is not divisible by the tensor-parallel size tp=4"),
    (4, T.build_gpt, {"pipeline": {"stages": 2}},
     "pipeline parallelism over 2 stages needs the model as a tachyon.parallel.pipeline.PipelineModule"),
    (4, T.build_gpt, {"tensor_parallel": {"tp_size": 2}, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}},
     "LAMB with tensor parallelism (tp=2) is not supported"),
    (4, T.build_gpt, {"tensor_parallel": {"sequence_parallel": True}},
     "`tensor_parallel.sequence_parallel: true` needs a tensor-parallel size > 1"),
])
def test_bad_layouts_are_refused_before_anything_changes(world, ranks, model, sections, message):
    world(ranks)
    config = {"train_micro_batch_size_per_gpu": 1, **sections}
    error = ValueError  # ConfigError is a ValueError; each message names its key or module
    _refused(model(), config, error, message)


def _one_stage(**kw) -> PipelineModule:
    return PipelineModule(gpt_layer_specs(**T.CFG), loss_fn=gpt_loss, **kw)


@pytest.mark.parametrize(("sections", "message"), [
    ({"pipeline": {"stages": 2}}, "`pipeline.stages: 2` but the PipelineModule has num_stages=1"),
    ({"pipeline": {"schedule": "interleaved_1F1B"}, "gradient_accumulation_steps": 2},
     "`pipeline.schedule: 'interleaved_1F1B'` with gradient_accumulation_steps=2 (the micro-batches per batch): "
     "PipelineSchedule: interleaved_1F1B needs a PipelineModule with stages_per_rank >= 2"),
    ({"data_types": {"grad_accum_dtype": "fp32"}, "bf16": {"enabled": True}},
     '`data_types.grad_accum_dtype: "fp32"` with a PipelineModule'),
    ({"progressive_layer_drop": {"enabled": True}},
     "`progressive_layer_drop.enabled: true` makes the engine call the model's forward with progressive_layer_drop="
     "True, pld_theta=<theta>, but PipelineModule.forward takes no progressive_layer_drop"),
])
def test_pipeline_settings_that_do_not_fit_the_module_are_refused(world, sections, message):
    world(2)
    _refused(_one_stage(), {"train_micro_batch_size_per_gpu": 1, **sections}, ConfigError, message)


def test_dist_init_required_false_in_a_multi_rank_job_without_a_process_group_is_refused(world):
    """Each rank would otherwise train alone; DeepSpeed refuses too. One process (no WORLD_SIZE)
    still trains with dist_init_required=False."""
    world(2)
    _refused(T.build_gpt(), E.config(), ValueError, "dist_init_required=False but torch.distributed is not "
             "initialized and the environment says WORLD_SIZE=2", dist_init_required=False)


def test_an_mpu_must_be_one_and_needs_torch_distributed(world):
    world(4)
    _refused(T.build_gpt(), E.config(), ValueError, "mpu should be a model-parallel unit", mpu=object())
    _refused(T.build_gpt(), E.config(), ValueError, "mpu= needs torch.distributed initialized before initialize()",
             mpu=E.MegatronMpu(None))


def _onebit_with_tied_stages() -> str | None:
    """On each of 2 ranks: initialize a 2-stage GPT (tied embedding) with OneBitAdam; the error."""
    net = PipelineModule(gpt_layer_specs(**T.CFG), num_stages=2, loss_fn=gpt_loss)
    config = {**E.config(gas=2, stage=0, stages=2),
              "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "comm_backend_name": "gloo"}}}
    try:
        tachyon.initialize(model=net, config=config)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_one_bit_optimizers_are_refused_with_tied_weights_across_stages():
    for message in run_distributed(_onebit_with_tied_stages, 2):
        assert message is not None and "1-bit optimizer with a PipelineModule whose stages share tied weights (embed)" \
            in message, message


def test_more_stages_than_layers_and_no_loss_fn_are_refused_by_the_module():
    with pytest.raises(ValueError, match=r"PipelineModule needs loss_fn"):
        PipelineModule(gpt_layer_specs(**T.CFG), num_stages=2)
    with pytest.raises(ValueError, match="12 stages .* but only 8 layers; every stage needs at least one layer"):
        PipelineModule(gpt_layer_specs(**T.CFG), num_stages=12, loss_fn=gpt_loss)


def test_pipeline_engine_refuses_the_micro_step_api_and_plain_engines_refuse_train_batch():
    """DeepSpeed's PipelineEngine: train_batch / eval_batch only. One stage, one process."""
    engine, *_ = tachyon.initialize(model=_one_stage(), config=E.config(gas=2), dist_init_required=False)
    for call in (lambda: engine(torch.zeros(1, 4, dtype=torch.long)), lambda: engine.backward(torch.ones(())),
                 engine.step):
        with pytest.raises(RuntimeError, match="only train_batch\\(\\) and eval_batch\\(\\)"):
            call()
    loss = engine.train_batch(E.micro_batch_iter(engine, 0))
    assert loss.dtype == torch.float32 and loss.dim() == 0 and engine.global_steps == 1 and engine.micro_steps == 2
    assert engine.is_first_stage() and engine.is_last_stage() and engine.mpu is None
    plain, *_ = tachyon.initialize(model=T.build_gpt(), config=E.config(), dist_init_required=False)
    with pytest.raises(RuntimeError, match="train_batch\\(\\) trains a PipelineModule; this engine's model is a GPT"):
        plain.train_batch(iter([]))
