"""Stand-in for DeepSpeed's tests/unit/util.py: the capability checks its tests call."""

from __future__ import annotations

import torch


def bf16_required_version_check(accelerator_check: bool = True) -> bool:
    return True  # tachyon trains bf16 on CPUs and GPUs


def required_amp_check() -> bool:
    return False  # Apex AMP is not provided


def required_minimum_torch_version(major_version: int, minor_version: int) -> bool:
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (major_version, minor_version)


def required_maximum_torch_version(major_version: int, minor_version: int) -> bool:
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) <= (major_version, minor_version)
