"""tachyon: fast, large-scale transformer training and inference in PyTorch, with no build step.

The public API is imported lazily (``tachyon.initialize`` loads the engine on first use), so
``import tachyon`` stays cheap and each piece pulls in only what it needs.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from tachyon.backend import get_backend, set_backend, use_backend  # noqa: E402
from tachyon.capabilities import capabilities  # noqa: E402

# public name -> module that defines it
_LAZY = {
    "initialize": "tachyon.engine",
    "Engine": "tachyon.engine",
    "init_distributed": "tachyon.parallel.distributed",
    "shutdown_distributed": "tachyon.parallel.distributed",
    "TransformerKernelConfig": "tachyon.nn.transformer_kernel",
    "TransformerKernelLayer": "tachyon.nn.transformer_kernel",
    "autocast": "tachyon.fp8",
    "fp8_autocast": "tachyon.fp8",
    "init_inference": "tachyon.inference",
    "make_graphed_callables": "tachyon.cuda_graphs",
}
# public module name -> the module itself
_LAZY_MODULES = {"checkpointing": "tachyon.engine.activation_checkpointing", "profiling": "tachyon.profiling",
                 "zero": "tachyon.zero"}

__all__ = ["__version__", "capabilities", "get_backend", "set_backend", "use_backend", *_LAZY, *_LAZY_MODULES]


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'tachyon' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))
