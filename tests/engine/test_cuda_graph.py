"""The engine's ``cuda_graph`` section: refusals before any state changes (CPU), and on a GPU
(``-m gpu``) training with the forward and backward replayed from graphs equal to eager training
bit for bit (ZeRO-2, bf16, gradient accumulation, clipping, the BERT kernel layer with dropout)."""

from __future__ import annotations

import copy

import pytest
import torch

import tachyon
from tachyon.config import ConfigError


class _Model(torch.nn.Module):
    """A model whose forward takes progressive layer drop's arguments (the engine passes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, x, progressive_layer_drop=False, pld_theta=None):
        return self.net(x)


def _model():
    return _Model()


@pytest.mark.parametrize("extra,reason", [
    ({}, "CUDA graphs need a CUDA device"),
    ({"progressive_layer_drop": {"enabled": True}}, "progressive_layer_drop draws"),
    ({"flops_profiler": {"enabled": True}}, "flops profiler"),
    ({"activation_checkpointing": {"synchronize_checkpoint_boundary": True}}, "synchronizes the device"),
])
def test_cuda_graph_configs_that_cannot_be_captured_are_refused_before_any_state(extra, reason):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    config = {"train_batch_size": 2, "cuda_graph": {"enabled": True}, **extra}
    with pytest.raises(ConfigError, match=reason):
        tachyon.initialize(model=model, config=config, optimizer=lambda g: torch.optim.SGD(g, lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_cuda_graph_is_off_by_default_and_validated():
    from tachyon.config import load_config

    assert load_config({"train_batch_size": 2}, 1).cuda_graph.enabled is False
    with pytest.raises(ConfigError, match="num_warmup_iters"):
        load_config({"train_batch_size": 2, "cuda_graph": {"enabled": True, "num_warmup_iters": 0}}, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["mlp", "bert"])
def test_graphed_engine_trains_like_the_eager_engine_bit_for_bit(layer):
    if layer == "bert":
        config = tachyon.TransformerKernelConfig(batch_size=4, max_seq_length=64, hidden_size=128,
                                                 intermediate_size=512, heads=4, attn_dropout_ratio=0.1,
                                                 hidden_dropout_ratio=0.1, num_hidden_layers=2,
                                                 initializer_range=0.02, seed=3, bf16=True)
        torch.manual_seed(0)
        eager_model = torch.nn.Sequential(tachyon.TransformerKernelLayer(config), tachyon.TransformerKernelLayer(config))
        inputs = [torch.randn(4, 64, 128) for _ in range(6)]
    else:
        torch.manual_seed(0)
        eager_model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        inputs = [torch.randn(4, 32) for _ in range(6)]
    graphed_model = copy.deepcopy(eager_model)
    if layer == "bert":
        for a, b in zip(eager_model, graphed_model):
            b.layer_id, b.dropout_seed = a.layer_id, a.dropout_seed
    results = []
    for model, graphs in ((eager_model, False), (graphed_model, True)):
        engine, *_ = tachyon.initialize(
            model=model, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3),
            config={"train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                    "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
                    "cuda_graph": {"enabled": graphs}})
        losses = []
        for x in inputs:
            x = x.to(engine.device, torch.bfloat16)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
        engine.destroy()
    (eager_losses, eager_params), (graph_losses, graph_params) = results
    for i, (a, b) in enumerate(zip(eager_losses, graph_losses)):
        assert torch.equal(a, b), f"micro-batch {i}: loss {a.item()} eager vs {b.item()} graphed"
    for i, (a, b) in enumerate(zip(eager_params, graph_params)):
        assert torch.equal(a, b), f"parameter {i} differs after training"
