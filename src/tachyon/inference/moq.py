"""MoQ (Mixture-of-Quantization): quantization-aware training whose weights INT8 inference loads.

DeepSpeed's ``quantize_training`` config section, same keys::

    "quantize_training": {
      "enabled": true,
      "quantize_bits": {"start_bits": 16, "target_bits": 8},
      "quantize_schedule": {"quantize_period": 400, "schedule_offset": 0},
      "quantize_groups": 1,                         # DeepSpeed's flat groups; tachyon: "group_size"
      "quantize-algo": {"q_type": "symmetric", "rounding": "nearest"},
      "fp16_mixed_quantize": {"enabled": false, "quantize_change_ratio": 0.001},
      "quantize_verbose": false, "quantizer_kernel": false
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

Usage::

    moq = MoQ(model, ds_config["quantize_training"])
    for batch in loader:
        loss = model(**batch).loss; loss.backward()
        moq.step(optimizer)                  # instead of optimizer.step()
        optimizer.zero_grad()
    engine = tachyon.init_inference(model, quant=moq.inference_quant(), dtype=torch.float16)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from tachyon.config.errors import ConfigError, render, unknown_key
from tachyon.kernels.int8_linear import fake_quantize

logger = logging.getLogger(__name__)

KEYS = ("enabled", "quantize_bits", "quantize_schedule", "quantize_groups", "group_size", "quantize-algo",
        "fp16_mixed_quantize", "quantize_verbose", "quantizer_kernel", "eigenvalue")


@dataclasses.dataclass(frozen=True)
class MoQConfig:
    start_bits: int = 16
    target_bits: int = 8
    quantize_period: int = 100
    schedule_offset: int = 0
    quantize_groups: int | None = None
    group_size: int | None = None
    mixed_fp16: bool = False
    change_ratio: float = 0.001
    verbose: bool = False

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> MoQConfig:
        """Parse DeepSpeed's ``quantize_training`` section (the section itself, or a full config)."""
        if "quantize_training" in section:
            section = section["quantize_training"]
        problems = [unknown_key(f"quantize_training.{k}", "quantize_training", KEYS) for k in section if k not in KEYS]
        bits = section.get("quantize_bits", {})
        schedule = section.get("quantize_schedule", {})
        algo = section.get("quantize-algo", {})
        mixed = section.get("fp16_mixed_quantize", {})
        if algo.get("q_type", "symmetric") != "symmetric":
            problems.append(f"`quantize_training.quantize-algo.q_type` must be \"symmetric\"; got {render(algo['q_type'])}")
        if algo.get("rounding", "nearest") != "nearest":
            problems.append("`quantize_training.quantize-algo.rounding`: only \"nearest\" is implemented; got "
                            f"{render(algo['rounding'])}")
        if (section.get("eigenvalue") or {}).get("enabled", False):
            problems.append("`quantize_training.eigenvalue.enabled: true`: eigenvalue-adaptive periods are not "
                            "implemented; remove it")
        start, target = bits.get("start_bits", 16), bits.get("target_bits", 8)
        for name, value, low, high in (("quantize_bits.start_bits", start, 2, 16),
                                       ("quantize_bits.target_bits", target, 2, 16)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                problems.append(f"`quantize_training.{name}` must be an int in [{low}, {high}]; got {render(value)}")
        if isinstance(start, int) and isinstance(target, int) and start < target:
            problems.append(f"`quantize_training.quantize_bits`: start_bits ({start}) must be >= target_bits ({target})")
        period = schedule.get("quantize_period", 100)
        offset = schedule.get("schedule_offset", 0)
        for name, value, low in (("quantize_schedule.quantize_period", period, 1),
                                 ("quantize_schedule.schedule_offset", offset, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"`quantize_training.{name}` must be an int >= {low}; got {render(value)}")
        groups, group_size = section.get("quantize_groups"), section.get("group_size")
        if groups == 1 and group_size is None:
            groups = None  # DeepSpeed's default; tachyon's default (per output channel) is finer
        if groups is not None and group_size is not None:
            problems.append("`quantize_training`: give quantize_groups or group_size, not both")
        if problems:
            raise ConfigError(problems)
        return cls(start, target, period, offset, groups, group_size, bool(mixed.get("enabled", False)),
                   float(mixed.get("quantize_change_ratio", 0.001)), bool(section.get("quantize_verbose", False)))


def quantizable_weights(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(name, weight, transposed) of every nn.Linear / HF Conv1D weight not shared with an
    embedding (the tied LM head stays float, as in INT8 inference)."""
    embedding_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    out = []
    for name, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D"
        if (isinstance(module, nn.Linear) or conv1d) and module.weight.data_ptr() not in embedding_ptrs:
            out.append((f"{name}.weight", module.weight, conv1d))
    return out


class MoQ:
    """The MoQ schedule over a model's linear weights (see the module docstring)."""

    def __init__(self, model: nn.Module, config: dict[str, Any] | MoQConfig) -> None:
        self.config = config if isinstance(config, MoQConfig) else MoQConfig.from_dict(config)
        self.weights = quantizable_weights(model)
        if not self.weights:
            raise ValueError(f"MoQ: {type(model).__name__} has no nn.Linear / Conv1D weights to quantize")
        self.master = {id(p): p.detach().float().clone() for _, p, _ in self.weights}
        self.steps = 0
        self.bits = self.config.start_bits
        self.period = self.config.quantize_period
        self.real_ratio = 1.0

    def _snap(self, w: torch.Tensor, transposed: bool) -> torch.Tensor:
        c = self.config
        w2 = w.t() if transposed else w
        q = fake_quantize(w2, self.bits, group_size=c.group_size, q_groups=c.quantize_groups)
        return q.t() if transposed else q

    def _advance(self) -> None:
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
        return self.steps >= self.config.schedule_offset

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, overflow: bool = False) -> None:
        """optimizer.step() on the full-precision masters, then the weights re-quantized. With
        ``overflow`` (an fp16 step that was skipped) nothing changes, as in DeepSpeed."""
        if overflow:
            return
        for _, p, _ in self.weights:  # the optimizer updates the masters (straight-through gradients)
            p.data.copy_(self.master[id(p)].to(p.dtype))
        optimizer.step()
        self._advance()
        for _, p, transposed in self.weights:
            master = self.master[id(p)]
            master.copy_(p.data.float())
            if not self.active:
                continue
            q = self._snap(master, transposed)
            if self.config.mixed_fp16:
                q = self.real_ratio * master + (1.0 - self.real_ratio) * q.float()
            p.data.copy_(q.to(p.dtype))

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


__all__ = ["MoQ", "MoQConfig", "quantizable_weights"]
