"""``deepspeed.module_inject``: injection policies for the inference engine (tachyon.inference when it exists).

``module_inject.replace_policy.<Policy>`` and ``module_inject.<Policy>`` resolve from
tachyon.inference (or its ``injection`` module); until the inference engine exists, using them
raises NotImplementedError.
"""

from __future__ import annotations

from tachyon.compat._names import module_getattr
from tachyon.compat.deepspeed.module_inject.replace_policy import POLICIES, policy_target

_TABLE = {name: policy_target(name) for name in POLICIES}
__getattr__ = module_getattr(__name__, "deepspeed.module_inject", _TABLE, submodules=("replace_policy",))


__all__ = ["replace_policy", *POLICIES]
