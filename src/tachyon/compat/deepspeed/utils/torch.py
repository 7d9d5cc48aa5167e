"""``deepspeed.utils.torch``: torch version checks."""

from __future__ import annotations

import torch


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def required_torch_version(min_version: float | None = None, max_version: float | None = None) -> bool:
    """Whether the installed torch is at least ``min_version`` and at most ``max_version`` (e.g. 2.1)."""
    current = _version(torch.__version__)
    if min_version is not None and current < _version(str(min_version)):
        return False
    return not (max_version is not None and current > _version(str(max_version)))


__all__ = ["required_torch_version"]
