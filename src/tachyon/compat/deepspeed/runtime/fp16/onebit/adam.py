"""``deepspeed.runtime.fp16.onebit.adam``: ``OnebitAdam`` is `tachyon.engine.optim.OneBitAdam`."""

from tachyon.engine.optim import OneBitAdam as OnebitAdam  # noqa: F401

__all__ = ["OnebitAdam"]
