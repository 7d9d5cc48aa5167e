"""``deepspeed.module_inject``: injection policies for the inference engine (tachyon.inference when it exists).

``module_inject.replace_policy.<Policy>`` and ``module_inject.<Policy>`` resolve from
tachyon.inference (or its ``injection`` module); until the inference engine exists, using them
raises NotImplementedError.
"""

from __future__ import annotations

import importlib

from tachyon.compat._names import module_getattr
from tachyon.compat.deepspeed.module_inject.replace_policy import POLICIES, policy_target

_TABLE = {name: policy_target(name) for name in POLICIES}
_lookup = module_getattr(__name__, "deepspeed.module_inject", _TABLE, lambda: ["replace_policy"])


def __getattr__(name: str):
    if name == "replace_policy":
        return importlib.import_module(f"{__name__}.replace_policy")
    return _lookup(name)


__all__ = ["replace_policy", *POLICIES]
