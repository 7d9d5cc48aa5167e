"""Checks every kernel entry point shares, so bad input fails the same way on every backend."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_dtype(op: str, arg: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{op}: {arg} has dtype {tensor.dtype}, which this kernel does not support; allowed: {_names(allowed)}")


def check_shape(op: str, arg: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{op}: {arg} has shape {tuple(tensor.shape)}; expected {tuple(expected)}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device; got {listing}")


def lazy_module(name: str) -> Callable[[], ModuleType]:
    """A function returning the module ``name``, imported at its first call (an op's Triton
    implementation module, which imports Triton): a cached reference afterwards, where an import
    statement in the op's body would run the import machinery on every call (about 1 us)."""
    module: ModuleType | None = None

    def load() -> ModuleType:
        nonlocal module
        if module is None:
            module = importlib.import_module(name)
        return module

    return load
