"""`MoQConfig`: DeepSpeed's ``quantize_training`` section (MoQ) as one frozen value.

`MoQConfig.from_dict` is the one set of rules for the section: the standalone wrapper
(`tachyon.inference.moq.MoQ`) calls it on the raw section, and the engine config's typed section
(`tachyon.config.sections.QuantizeTrainingConfig`) calls it after type checking, so both refuse
the same sections with the same messages. The schedule itself lives in `tachyon.inference.moq`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .errors import ConfigError, render, unknown_key

KEYS = ("enabled", "quantize_bits", "quantize_schedule", "quantize_groups", "group_size", "quantize-algo",
        "fp16_mixed_quantize", "quantize_verbose", "quantizer_kernel", "eigenvalue")
"""Keys of the ``quantize_training`` section (DeepSpeed's, plus tachyon's ``group_size``)."""


@dataclasses.dataclass(frozen=True)
class MoQConfig:
    """The MoQ schedule's settings (see `tachyon.inference.moq` for what each one does)."""

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
        """Parse DeepSpeed's ``quantize_training`` section (the section itself, or a full config).
        Raises ConfigError listing every problem, each naming its ``quantize_training.*`` key."""
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


__all__ = ["KEYS", "MoQConfig"]
