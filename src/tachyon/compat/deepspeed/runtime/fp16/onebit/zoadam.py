"""``deepspeed.runtime.fp16.onebit.zoadam``: ``ZeroOneAdam`` is `tachyon.engine.optim.ZeroOneAdam`."""

from tachyon.engine.optim import ZeroOneAdam  # noqa: F401

__all__ = ["ZeroOneAdam"]
