"""Which implementation of a kernel runs: Triton or the PyTorch reference.

tachyon has two implementations of every kernel: a Triton kernel for GPUs and a pure-PyTorch
reference that runs anywhere and serves as the test oracle. The choice is explicit, never read
from an environment variable at import time:

- ``"auto"`` (default): Triton when the tensor is on CUDA and Triton imports, else the reference;
  for ops with a torch twin of the same contract (the norms, attention without dropout), on CUDA
  the Triton kernel only where a committed measurement shows it faster (``tachyon.kernels.dispatch``).
- ``"triton"``: always Triton (on CPU tensors this needs Triton's interpreter, TRITON_INTERPRET=1).
- ``"torch"``: always the PyTorch reference.

    tachyon.set_backend("torch")           # process-wide
    with tachyon.use_backend("triton"):    # scoped; restores the previous choice
        ...
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "torch")

_state = threading.local()
_global_backend = "auto"


def _check(name: object) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not a tachyon backend; allowed: {', '.join(map(repr, BACKENDS))}")
    return name


def set_backend(name: str) -> None:
    """Set the process-wide backend: "auto", "triton" or "torch"."""
    global _global_backend
    _global_backend = _check(name)


def get_backend() -> str:
    """The backend in force in this thread (a ``use_backend`` scope wins over ``set_backend``)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else _global_backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager form of :func:`set_backend`, scoped to this thread."""
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(_check(name))
    try:
        yield
    finally:
        stack.pop()


def _probe_triton() -> tuple[str | None, bool]:
    """(why Triton does not import, or None; whether it runs under its CPU interpreter)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return f"triton does not import: {type(exc).__name__}: {exc}", False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return None, bool(knobs.runtime.interpret)
    import os

    return None, os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Probed once, when this module is imported (Triton fixes its interpreter mode at its own import):
# plain constants, so torch.compile reads them without tracing into triton.
_TRITON_ERROR, _TRITON_INTERPRETING = _probe_triton()

# Set by `tachyon.profiling.launch_stub.StubLaunches`: CPU tensors take the GPU (Triton) path, whose
# launches are stubbed, so its host time can be measured on a machine without a GPU.
_launch_stub = False


def triton_import_error() -> str | None:
    """None when Triton imports, else the reason it does not."""
    return _TRITON_ERROR


def triton_interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return _TRITON_INTERPRETING


def auto_on_cuda(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """True where the choice is "auto" and the tensor is on CUDA: an op with a torch twin then
    consults the measured table (``tachyon.kernels.dispatch``) before running its Triton kernel."""
    return (get_backend() if backend is None else backend) == "auto" and tensor.is_cuda


def resolve(tensor: torch.Tensor, backend: str | None = None) -> str:
    """Pick "triton" or "torch" for an op on ``tensor``.

    ``backend`` (an op's own argument) wins over the global/scoped choice. Asking for Triton where
    it cannot run raises a ValueError that says why, instead of silently falling back.
    """
    name = get_backend() if backend is None else _check(backend)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if (tensor.is_cuda or _launch_stub) and _TRITON_ERROR is None else "torch"
    reason = triton_import_error()
    if reason is not None:
        raise ValueError(f"backend='triton' was requested but {reason}")
    if not tensor.is_cuda and not triton_interpreting() and not _launch_stub:
        raise ValueError(
            f"backend='triton' was requested for a tensor on {tensor.device}; Triton runs on CUDA "
            "tensors, or on CPU tensors only under its interpreter (TRITON_INTERPRET=1 set before "
            "triton is imported); use backend='auto' or 'torch' for CPU tensors"
        )
    return "triton"
