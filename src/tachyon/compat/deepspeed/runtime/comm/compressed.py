"""``deepspeed.runtime.comm.compressed``: DeepSpeed's ``CompressedBackend`` is not provided (see ``deepspeed.runtime.comm``)."""

from tachyon.compat._names import module_getattr, unsupported
from tachyon.compat.deepspeed.runtime.comm import WHY

_TABLE = {"CompressedBackend": unsupported(WHY)}
__getattr__ = module_getattr(__name__, "deepspeed.runtime.comm.compressed", _TABLE)
__all__ = list(_TABLE)
