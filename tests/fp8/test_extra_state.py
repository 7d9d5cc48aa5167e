"""The FP8 state in saved files: ``_extra_state`` is a uint8 tensor (Transformer Engine's form), so
Hugging Face's save_pretrained / from_pretrained (safetensors) round-trip a model built from
tachyon's TE-style layers with its delayed-scaling scales; the dict form of earlier versions still
loads; and the engine's checkpoints restore the scales (they are the state of the recipe that
has one)."""

from __future__ import annotations

import torch

import tachyon
import tachyon.nn as tnn
from tachyon.fp8 import DelayedScaling, decode_extra_state

HIDDEN, FFN, HEADS = 32, 64, 2


def _train(model, steps: int, recipe=None) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        with tachyon.autocast(recipe=recipe or DelayedScaling()):
            y = model(torch.randn(8, 2, HIDDEN, generator=gen))
        y.float().square().sum().backward()


def _fp8_states(model) -> dict[str, torch.Tensor]:
    return {f"{name}.{gemm}.{role}.{key}": value
            for name, module in model.named_modules() if hasattr(module, "fp8_state_dict")
            for gemm, roles in module.fp8_state_dict()["gemms"].items()
            for role, values in roles.items() for key, value in values.items()}


def test_extra_state_is_a_uint8_tensor_fp8_used_or_not_and_the_old_dict_loads():
    fresh = tnn.LayerNormMLP(HIDDEN, FFN)
    blob = fresh.state_dict()["_extra_state"]
    assert blob.dtype == torch.uint8 and blob.dim() == 1  # never ran FP8: still a tensor
    trained = tnn.LayerNormMLP(HIDDEN, FFN)
    _train(trained, 2)
    old_form = trained.fp8_state_dict()  # the dict tachyon saved before (version 1 had the same layout)
    old_form["version"] = 1
    state = {k: v for k, v in trained.state_dict().items() if k != "_extra_state"}
    fresh.load_state_dict({**state, "_extra_state": old_form})
    for key, value in _fp8_states(trained).items():
        assert torch.equal(_fp8_states(fresh)[key], value), key
    assert decode_extra_state(trained.state_dict()["_extra_state"])["gemms"].keys() == {"fc1", "fc2"}


def test_hugging_face_save_pretrained_and_from_pretrained_round_trip(tmp_path):
    from transformers import PretrainedConfig, PreTrainedModel

    class TinyConfig(PretrainedConfig):
        model_type = "tachyon_fp8_extra_state_test"

        def __init__(self, layers: int = 2, **kwargs):
            self.layers = layers
            super().__init__(**kwargs)

    class TinyModel(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.layers = torch.nn.ModuleList(
                tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
                for _ in range(config.layers))
            self.post_init()

        def _init_weights(self, module):
            pass

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = TinyModel(TinyConfig())
    _train(model, 3)
    model.save_pretrained(tmp_path)  # safetensors: raised on a dict _extra_state
    assert (tmp_path / "model.safetensors").is_file()
    loaded, info = TinyModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        if not key.endswith("_extra_state"):
            assert torch.equal(got[key], want[key]), key
    states, loaded_states = _fp8_states(model), _fp8_states(loaded)
    assert any(v.ne(1.0).any() for k, v in states.items() if k.endswith(".scale"))  # real scales travelled
    for key, value in states.items():
        assert torch.equal(loaded_states[key], value), key
    x = torch.randn(8, 2, HIDDEN)
    with tachyon.autocast(recipe=DelayedScaling()):
        assert torch.equal(loaded(x), model(x))


def test_engine_checkpoint_restores_the_delayed_scaling_state(tmp_path):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(tnn.LayerNormLinear(HIDDEN, HIDDEN), tnn.Linear(HIDDEN, HIDDEN))
        config = {"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        return tachyon.initialize(model=model, config=config)[0]

    engine = make()
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        with tachyon.autocast(recipe=DelayedScaling(amax_history_len=8)):
            loss = engine(torch.randn(16, HIDDEN, generator=gen)).square().mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(tmp_path)
    fresh = make()
    assert not any(v.ne(1.0).any() for k, v in _fp8_states(fresh.module).items() if k.endswith(".scale"))
    fresh.load_checkpoint(tmp_path)
    saved = _fp8_states(engine.module)
    assert any(v.ne(1.0).any() for k, v in saved.items() if k.endswith(".scale"))
    for key, value in _fp8_states(fresh.module).items():
        assert torch.equal(value, saved[key]), key  # the history length (8) came back too
