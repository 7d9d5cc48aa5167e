"""MoQ (Mixture-of-Quantization): quantization-aware training whose weights INT8 inference loads.

DeepSpeed's ``quantize_training`` config section, same keys (``enabled`` defaults to false)::

    "quantize_training": {
      "enabled": true,
      "quantize_bits": {"start_bits": 16, "target_bits": 8},
      "quantize_schedule": {"quantize_period": 400, "schedule_offset": 0},
      "quantize_groups": 1,                         # DeepSpeed's flat groups; tachyon: "group_size"
      "quantize-algo": {"q_type": "symmetric", "rounding": "nearest"},
      "fp16_mixed_quantize": {"enabled": false, "quantize_change_ratio": 0.001},
      "quantize_verbose": false, "quantizer_kernel": false     # quantizer_kernel: accepted, no effect
    }

How it trains (DeepSpeed's schedule): after ``schedule_offset`` optimizer steps the weights of
every linear layer (not embeddings, norms or the tied LM head) are snapped onto a symmetric
``bits``-bit grid after each step, starting at ``start_bits``; one bit is dropped when the step
count since the offset reaches ``quantize_period``, and the period then doubles (switches at P,
2P, 4P, ... steps) until ``target_bits``. The forward and backward see the quantized weights;
the optimizer updates full-precision master copies (straight-through), which is what DeepSpeed's
fp16 optimizer provides and what :meth:`MoQ.step` does around any torch optimizer. With
``fp16_mixed_quantize`` the weights are ratio * w + (1 - ratio) * Q(w), ratio starting at 1 after
each bit switch and shrinking by ``quantize_change_ratio`` per step.

Grid: W~ = clamp(round(W / s), -qmax, qmax) * s with s = max|W_group| / qmax, qmax = 2^(b-1) - 1,
groups per output channel by default (``quantize_groups`` = DeepSpeed's flat groups of the
[out, in] weight, or ``group_size`` columns). The same grid is what ``init_inference(...,
quant=moq.inference_quant())`` builds, so a model trained to ``target_bits`` <= 8 with per-channel
or group_size groups loads into INT8 inference with its trained weights unchanged.

Usage with the training engine (the section in the config, as in DeepSpeed; `tachyon.engine.moq`
handles fp32/bf16/fp16 masters, ZeRO-1/2, gradient accumulation, skipped fp16 steps and
checkpoints)::

    ds_config = {..., "quantize_training": {"enabled": True, "quantize_bits": {...}, ...}}
    engine, optimizer, _, _ = tachyon.initialize(model=model, config=ds_config)
    for batch in loader:
        engine.backward(engine(**batch).loss)
        engine.step()                        # the linear weights are snapped after each optimizer step
    engine.quantizer.bits                    # the current grid
    infer = tachyon.init_inference(engine.module, quant=engine.quantizer.inference_quant(), dtype=torch.float16)

Standalone, around any torch optimizer (the ``enabled`` key is not needed here)::

    moq = MoQ(model, ds_config["quantize_training"])
    for batch in loader:
        loss = model(**batch).loss; loss.backward()
        moq.step(optimizer)                  # instead of optimizer.step()
        optimizer.zero_grad()
    engine = tachyon.init_inference(model, quant=moq.inference_quant(), dtype=torch.float16)

`MoQConfig` (the parsed section) lives in `tachyon.config.quantize_training`; `MoQSchedule` is the
schedule state and the snap both paths share.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tachyon.config.quantize_training import KEYS, MoQConfig
from tachyon.kernels.int8_linear import fake_quantize

logger = logging.getLogger(__name__)

# GEMM weights ([out, in]) of tachyon's own modules, by class name: (attribute, ...)
_TACHYON_LINEAR_WEIGHTS = {
    "Linear": ("weight",), "LayerNormLinear": ("weight",), "LayerNormMLP": ("fc1_weight", "fc2_weight"),
    "TransformerKernelLayer": ("attn_qkvw", "attn_ow", "inter_w", "output_w"),
}


def _linear_weights(module: nn.Module) -> list[tuple[str, bool]]:
    """(attribute, transposed) of the GEMM weights ``module`` holds itself: an nn.Linear's, an HF
    Conv1D's ([in, out]: transposed) or those of tachyon.nn's fused modules."""
    if isinstance(module, nn.Linear):
        return [("weight", False)]
    kind = type(module).__name__
    if kind == "Conv1D":
        return [("weight", True)]
    if type(module).__module__.startswith("tachyon.nn") and kind in _TACHYON_LINEAR_WEIGHTS:
        return [(attr, False) for attr in _TACHYON_LINEAR_WEIGHTS[kind]
                if isinstance(getattr(module, attr, None), nn.Parameter)]
    return []


def quantizable_weights(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(name, weight, transposed) of every GEMM weight (nn.Linear, HF Conv1D, tachyon.nn's
    Linear / LayerNormLinear / LayerNormMLP / TransformerKernelLayer) not shared with an
    embedding (the tied LM head stays float, as in INT8 inference)."""
    embedding_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    out = []
    for name, module in model.named_modules():
        for attr, transposed in _linear_weights(module):
            weight = getattr(module, attr)
            if weight.data_ptr() not in embedding_ptrs:
                out.append((f"{name}.{attr}" if name else attr, weight, transposed))
    return out


class MoQSchedule:
    """DeepSpeed's MoQ schedule and grid: the state (optimizer steps counted, current bits, the
    current period, the fp16-mixing ratio) and the snap of one full-precision weight. Shared by
    the standalone `MoQ` and the training engine (`tachyon.engine.moq`)."""

    def __init__(self, config: MoQConfig) -> None:
        self.config = config
        self.steps = 0
        self.bits = config.start_bits
        self.period = config.quantize_period
        self.real_ratio = 1.0

    def advance(self) -> None:
        """DeepSpeed's schedule: count a step; drop a bit when the count reaches the period (then double it)."""
        c = self.config
        self.steps += 1
        if c.mixed_fp16:
            self.real_ratio = max(0.0, self.real_ratio - c.change_ratio)
        since = self.steps - c.schedule_offset
        if since >= self.period and self.bits > c.target_bits:
            self.bits -= 1
            self.period <<= 1
            self.real_ratio = 1.0
            if c.verbose:
                logger.info("MoQ: step %d, weights now on a %d-bit grid (next switch at %d)", self.steps, self.bits,
                            c.schedule_offset + self.period)

    @property
    def active(self) -> bool:
        """Whether the offset has passed (weights are snapped after the steps that follow)."""
        return self.steps >= self.config.schedule_offset

    @property
    def quantizing(self) -> bool:
        """Whether the weights the model holds now are snapped (a step was taken, the offset passed)."""
        return self.steps > 0 and self.active

    def snap(self, master: torch.Tensor, transposed: bool) -> torch.Tensor:
        """The model's weight for the full-precision ``master`` (fp32, the parameter's shape; an HF
        Conv1D weight [in, out] is ``transposed``): its ``bits`` grid per output channel or group,
        mixed with ``master`` by ``real_ratio`` under fp16_mixed_quantize. Returns fp32."""
        c = self.config
        w2 = master.t() if transposed else master
        q = fake_quantize(w2, self.bits, group_size=c.group_size, q_groups=c.quantize_groups)
        q = q.t() if transposed else q
        if c.mixed_fp16:
            q = self.real_ratio * master + (1.0 - self.real_ratio) * q.float()
        return q

    def inference_quant(self) -> dict[str, Any]:
        """The ``quant=`` for init_inference that reproduces this model's grid (target bits <= 8)."""
        c = self.config
        if self.bits > 8:
            raise ValueError(f"MoQ: the weights are on a {self.bits}-bit grid; INT8 inference needs <= 8 bits "
                             f"(train until target_bits <= 8 is reached)")
        weight: dict[str, Any] = {"num_bits": self.bits}
        if c.group_size is not None:
            weight["group_size"] = c.group_size
        if c.quantize_groups is not None:
            weight["q_groups"] = c.quantize_groups
        return {"enabled": True, "weight": weight}

    def state_dict(self) -> dict[str, Any]:
        """JSON data: ``steps``, ``bits``, ``period``, ``real_ratio``."""
        return {"steps": self.steps, "bits": self.bits, "period": self.period, "real_ratio": self.real_ratio}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.bits = int(state["steps"]), int(state["bits"])
        self.period, self.real_ratio = int(state["period"]), float(state["real_ratio"])


class MoQ:
    """The MoQ schedule over a model's linear weights, around any torch optimizer (see the module
    docstring; the training engine does the same from the config: `tachyon.engine.moq`)."""

    def __init__(self, model: nn.Module, config: dict[str, Any] | MoQConfig) -> None:
        self.schedule = MoQSchedule(config if isinstance(config, MoQConfig) else MoQConfig.from_dict(config))
        self.weights = quantizable_weights(model)
        if not self.weights:
            raise ValueError(f"MoQ: {type(model).__name__} has no GEMM weights to quantize (nn.Linear, HF Conv1D, "
                             "tachyon.nn's Linear / LayerNormLinear / LayerNormMLP / TransformerKernelLayer)")
        self.master = {id(p): p.detach().float().clone() for _, p, _ in self.weights}

    config = property(lambda self: self.schedule.config)
    steps = property(lambda self: self.schedule.steps)
    bits = property(lambda self: self.schedule.bits)
    period = property(lambda self: self.schedule.period)
    real_ratio = property(lambda self: self.schedule.real_ratio)
    active = property(lambda self: self.schedule.active)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, overflow: bool = False) -> None:
        """optimizer.step() on the full-precision masters, then the weights re-quantized. With
        ``overflow`` (an fp16 step that was skipped) nothing changes, as in DeepSpeed."""
        if overflow:
            return
        for _, p, _ in self.weights:  # the optimizer updates the masters (straight-through gradients)
            p.data.copy_(self.master[id(p)].to(p.dtype))
        optimizer.step()
        self.schedule.advance()
        for _, p, transposed in self.weights:
            master = self.master[id(p)]
            master.copy_(p.data.float())
            if self.schedule.active:
                p.data.copy_(self.schedule.snap(master, transposed).to(p.dtype))

    def inference_quant(self) -> dict[str, Any]:
        """The ``quant=`` for init_inference that reproduces this model's grid (target bits <= 8)."""
        return self.schedule.inference_quant()


__all__ = ["KEYS", "MoQ", "MoQConfig", "MoQSchedule", "quantizable_weights"]
