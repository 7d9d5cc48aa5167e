"""init_inference's arguments and refusals: DeepSpeed's names and old names, errors that name the
setting and what is allowed, unsupported models and settings refused before any weight is read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tachyon
from tachyon.config.errors import ConfigError
from tachyon.inference import build_config
from tests.inference.models import make_model, prompts


def test_defaults_follow_deepspeed():
    cfg = build_config()
    assert cfg.dtype == torch.float16 and cfg.tp_size == 1 and cfg.max_out_tokens == 1024
    assert cfg.replace_with_kernel_inject and cfg.quant is None and not cfg.enable_cuda_graph


def test_old_and_alternative_names():
    cfg = build_config(mp_size=2, kernel_inject=True, max_tokens=64, dtype="bf16")
    assert (cfg.tp_size, cfg.max_out_tokens, cfg.dtype) == (2, 64, torch.bfloat16)
    assert build_config(config={"dtype": "fp16", "tensor_parallel": {"tp_size": 4}}, dtype="fp16").tp_size == 4
    assert build_config(config={"dtype": "torch.float32"}).dtype == torch.float32  # DeepSpeed's DtypeEnum strings
    assert build_config(tensor_parallel={"tp_size": 2, "enabled": False}).tp_size == 1
    int8 = build_config(dtype=torch.int8)
    assert int8.int8 and int8.quant.num_bits == 8 and int8.quant.group_size is None
    assert build_config(quant={"enabled": True, "weight": {"num_bits": 8, "group_size": 64}}).quant.group_size == 64
    assert build_config(return_tuple=True).ignored == ("return_tuple",)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.float64), "dtype.*allowed: torch.float32, torch.float16, torch.bfloat16, torch.int8"),
    (dict(dtype="fp8"), "allowed"),
    (dict(mp_size=2, tensor_parallel={"tp_size": 4}), "disagree"),
    (dict(config={"dtype": "fp16"}, dtype=torch.float32), "`dtype` is given in config= .*different values"),
    (dict(tensor_paralel={"tp_size": 2}), "did you mean 'tensor_parallel'"),
    (dict(tensor_parallel={"tp_sise": 2}), "did you mean 'tensor_parallel.tp_size'"),
    (dict(tensor_parallel={"tp_size": 0}), "tp_size` must be an int >= 1"),
    (dict(moe=True), "moe.*not support"),
    (dict(mpu=object()), "tp_group"),
    (dict(replace_with_kernel_inject=True, injection_policy={nn.Linear: ("a",)}), "cannot be combined"),
    (dict(quant={"activation": {"enabled": True}}), "activation quantization is not implemented"),
    (dict(quant={"weight": {"num_bits": 9}}), "num_bits"),
    (dict(quant={"weight": {"q_type": "asymmetric"}}), "symmetric"),
    (dict(dtype=torch.int8, replace_with_kernel_inject=False), "need kernel injection"),
    (dict(max_out_tokens=0), "max_out_tokens"),
    (dict(enable_cuda_graph="yes"), "enable_cuda_graph"),
])
def test_bad_arguments_are_refused_with_what_is_allowed(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_config(**kwargs)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        build_config(dtype="fp64", max_out_tokens=-1, bogus=1)
    assert len(info.value.problems) == 3


def test_unsupported_models_are_refused_naming_the_supported_classes():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    for model in (t5, nn.Sequential(nn.Linear(4, 4))):
        with pytest.raises(ValueError, match="supported model classes: .*GPT2LMHeadModel.*LlamaForCausalLM"):
            tachyon.init_inference(model, dtype=torch.float32)


@pytest.mark.parametrize("change,match", [
    (lambda m: setattr(m.config, "rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
     "rope type='dynamic'.*supported: 'default', 'linear', 'llama3', 'yarn'"),
    (lambda m: setattr(m.config, "hidden_act", "gelu"), "hidden_act.*'silu'"),
    (lambda m: m.model.layers.__setitem__(0, nn.Identity()), "custom or patched layer"),
])
def test_what_a_policy_cannot_convert_exactly_is_refused(change, match):
    model = make_model("llama")
    change(model)
    with pytest.raises(ValueError, match=match):
        tachyon.init_inference(model, dtype=torch.float32)


def test_gpt2_with_cross_attention_is_refused():
    model = make_model("gpt2")
    model.config.add_cross_attention = True
    with pytest.raises(ValueError, match="add_cross_attention"):
        tachyon.init_inference(model, dtype=torch.float32)


def test_wrong_dtype_and_tp_size_are_refused_before_any_weight_is_read(tmp_path):
    """The checkpoint does not exist and the model's weights are on the meta device: reading
    either would fail differently, so these errors prove nothing was loaded first."""
    with torch.device("meta"):
        model = make_model("llama")
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="dtype"):
        tachyon.init_inference(model, dtype=torch.float64, checkpoint=missing)
    with pytest.raises(ValueError, match=r"tp_size=3 must divide the model's heads=4, kv_heads=2"):
        tachyon.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 3}, checkpoint=missing)
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        tachyon.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 2}, checkpoint=missing)


def test_slicing_alone_without_a_policy_is_refused():
    with pytest.raises(ValueError, match="injection_policy"):
        tachyon.init_inference(make_model("gpt2"), dtype=torch.float32, replace_with_kernel_inject=False, mp_size=2)


def test_without_injection_the_engine_is_the_hf_model_in_the_dtype():
    model = make_model("gpt2")
    ids, mask = prompts()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    engine = tachyon.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)
    assert engine.kind == "hf" and engine.module is model
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_graphs_need_cuda():
    with pytest.raises(ValueError, match="enable_cuda_graph=True needs a CUDA device"):
        tachyon.init_inference(make_model("gpt2"), dtype=torch.float32, enable_cuda_graph=True)
