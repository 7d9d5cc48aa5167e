"""``deepspeed.runtime.fp16.onebit.lamb``: ``OnebitLamb`` is `tachyon.engine.optim.OneBitLamb`."""

from tachyon.engine.optim import OneBitLamb as OnebitLamb  # noqa: F401

__all__ = ["OnebitLamb"]
