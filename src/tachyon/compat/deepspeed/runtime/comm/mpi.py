"""``deepspeed.runtime.comm.mpi``: DeepSpeed's ``MpiBackend`` is not provided (see ``deepspeed.runtime.comm``)."""

from tachyon.compat._names import module_getattr, unsupported
from tachyon.compat.deepspeed.runtime.comm import WHY

_TABLE = {"MpiBackend": unsupported(WHY)}
__getattr__ = module_getattr(__name__, "deepspeed.runtime.comm.mpi", _TABLE)
__all__ = list(_TABLE)
