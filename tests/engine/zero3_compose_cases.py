"""Stage 3 composed with activation checkpointing and the flops profiler, run inside the 2-rank
launch of tests/engine/test_zero3.py (`compose_scenarios`): the same model, data and steps at
stage 2 and at stage 3, every layer under ``tachyon.checkpointing.checkpoint`` (configured from
the engine config's ``activation_checkpointing`` section) and the flops profiler on at step 1.
The test compares the parameters, losses and profiles."""

from __future__ import annotations

import torch

HIDDEN, FFN, HEADS, SEQ, MICRO, STEPS = 32, 64, 2, 8, 2, 3


class CheckpointedModel(torch.nn.Module):
    """Two tachyon TransformerLayers (stage-3 units) and a head (the root's); with ``ckpt`` each
    layer runs under tachyon.checkpointing.checkpoint (FSDP2 re-gathers it for the recomputation)."""

    def __init__(self, ckpt: bool):
        super().__init__()
        import tachyon.nn

        torch.manual_seed(0)
        self.ckpt = ckpt
        self.layers = torch.nn.ModuleList(
            tachyon.nn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                        attn_input_format="bshd")
            for _ in range(2)
        )
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x):
        import tachyon

        for layer in self.layers:
            x = tachyon.checkpointing.checkpoint(layer, x) if self.ckpt else layer(x)
        return self.head(x).squeeze(-1)


def _train(stage: int, ckpt: bool, root: str) -> dict:
    import torch.distributed as dist

    import tachyon
    from tachyon.zero import GatheredParameters

    rank = dist.get_rank()
    model = CheckpointedModel(ckpt)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
              "flops_profiler": {"enabled": True, "profile_step": 1,
                                 "output_file": f"{root}/flops-stage{stage}-{int(ckpt)}.txt"},
              "activation_checkpointing": {"profile": True}}
    tachyon.checkpointing.reset()
    tachyon.checkpointing.reset_profile()
    if ckpt:
        tachyon.checkpointing.configure(None, deepspeed_config=config)
    engine, *_ = tachyon.initialize(model=model, config=config)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(MICRO, SEQ, HIDDEN, generator=gen), torch.randn(MICRO, SEQ, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with GatheredParameters(list(model.parameters())):
        params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    profile = engine.telemetry.flops_profile
    recomputed = tachyon.checkpointing.get_profile()["recomputes"]
    tachyon.checkpointing.reset()
    stage_run = engine.zero_optimization_stage()
    moved = max(float((params[name] - value).abs().max()) for name, value in initial.items())
    return {"stage": stage_run, "params": params, "moved": moved, "losses": losses,
            "profile": None if profile is None else {k: v for k, v in profile.items() if k != "timings"},
            "recomputes": recomputed}


def compose_scenarios(root: str) -> dict:
    """{stage: result} for stages 2 and 3, each with checkpointing and the profiler on; the
    profiles are written under ``root``."""
    return {stage: _train(stage, True, root) for stage in (2, 3)}
