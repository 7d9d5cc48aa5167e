"""``deepspeed.runtime.fp16.onebit``: DeepSpeed's 1-bit optimizers' modules (``adam.OnebitAdam``,
``lamb.OnebitLamb``, ``zoadam.ZeroOneAdam``), tachyon's `tachyon.engine.optim` classes."""

from . import adam, lamb, zoadam  # noqa: F401
from .adam import OnebitAdam  # noqa: F401
from .lamb import OnebitLamb  # noqa: F401
from .zoadam import ZeroOneAdam  # noqa: F401

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam", "adam", "lamb", "zoadam"]
