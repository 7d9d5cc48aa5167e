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


class no_child_process_in_deepspeed_io:
    """DeepSpeed's makes its engine's dataloader use no worker processes (its tests run in pools);
    tachyon's training dataloader starts none (``num_workers=0``), so there is nothing to change."""

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False
