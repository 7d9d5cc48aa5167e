"""How tachyon's ops are registered: a ``torch.library`` custom op, plus a direct eager path.

    @fused_op("tachyon::norm_fwd", mutates_args=())
    def _norm_fwd(x: Tensor, ...) -> tuple[Tensor, ...]: ...     # the implementation
    _norm_fwd.register_fake(...)
    _norm_fwd.register_autograd(backward, setup_context=setup)
    y = _norm_fwd(x, ...)                                          # called like the custom op

Every op is a real custom op (``torch.ops.tachyon.*``), so torch.compile, fake tensors, dispatch
modes and functorch see one opaque op with its fake implementation, exactly as before. What
``fused_op`` adds is the plain eager call: there, going through the dispatcher costs about 25 us
of host time per call with autograd (argument-schema handling, the generated autograd function,
the dynamo-disable wrappers) against about 5 us for a ``torch.autograd.Function`` running the same
implementation with the same ``setup_context`` and ``backward``. A fused layer makes ten or more
such calls per forward and backward, which on a GPU is host time the kernels may wait for. So in
eager mode (not compiling, no dispatch mode active, no functorch transform, only plain tensors
and parameters) the call runs the implementation directly, through an autograd.Function when a
gradient is needed. Both paths save the same tensors for backward and compute the same results.

``fused_op(name, mutates_args=(), triton_op=True)`` registers the op with
``torch.library.triton_op`` instead (where Triton imports): the same custom op to the dispatcher,
fake tensors and autograd, but torch.compile's AOT stage traces its implementation, with every
Triton launch in it as a ``wrap_triton`` call (kernels/launch.py ``wrapped_launches``), so the
compiled graph holds the Triton kernels (``triton_kernel_wrapper_functional`` nodes) instead of
one opaque call, and the other ops of the implementation (allocations, the PyTorch reference
path) as ordinary graph nodes. The implementation must then be traceable with fake tensors: no
reads of tensor data or storage, no device queries that a fake tensor cannot answer. Eager calls
are unchanged (the direct path above, FastKernel launches).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled


def eager_call(args: tuple[Any, ...]) -> bool:
    """True where an op call may bypass the dispatcher: plain eager execution on plain tensors."""
    if _is_compiling() or _dispatch_stack_len() or _functorch_active():
        return False
    for a in args:
        if isinstance(a, _Tensor) and type(a) not in _PLAIN_TENSORS:
            return False
    return True


class FusedOp:
    """A custom op (``self.custom_op``) and its implementation (``self.impl``); see the module
    docstring. Takes positional arguments only, like the ops' internal call sites."""

    def __init__(self, name: str, impl: Callable[..., Any], mutates_args: tuple[str, ...] | str,
                 triton_op: bool = False) -> None:
        self.name, self.impl = name, impl
        self.triton_op = triton_op and _triton_imports()
        if self.triton_op:
            self.custom_op = torch.library.triton_op(name, mutates_args=mutates_args)(_traced(impl, mutates_args))
        else:
            self.custom_op = torch.library.custom_op(name, mutates_args=mutates_args)(impl)
        self._function: type[torch.autograd.Function] | None = None
        self._apply: Callable[..., Any] | None = None
        functools.update_wrapper(self, impl)

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.custom_op.register_fake(fn)

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., None]) -> None:
        """The custom op's autograd, and the same functions as an autograd.Function for eager calls."""
        self.custom_op.register_autograd(backward, setup_context=setup_context)
        impl = self.impl

        # forward(ctx, ...) rather than a separate setup_context staticmethod: with the latter,
        # Function.apply binds the arguments with inspect.signature on every call (~20 us)
        class _EagerFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                output = impl(*args)
                setup_context(ctx, args, output)
                return output

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)

        _EagerFunction.__name__ = _EagerFunction.__qualname__ = f"{self.name.replace('::', '_')}_eager"
        self._function = _EagerFunction
        # The C-level apply that torch.autograd.Function.apply ends in. That Python wrapper also
        # binds default arguments (only with a setup_context staticmethod, which this class has
        # not) and unwraps dead functorch wrappers (none: __call__ takes this path only with no
        # functorch transform active and plain tensors), so calling the C apply is the same call
        # at a few microseconds less host time.
        self._apply = super(torch.autograd.Function, _EagerFunction).apply

    def __call__(self, *args: Any) -> Any:
        # is_compiling first: under torch.compile it is a constant True and nothing else is traced
        if _is_compiling() or _dispatch_stack_len() or _functorch_active():
            return self.custom_op(*args)
        needs_grad = False
        for a in args:
            if isinstance(a, _Tensor):
                if type(a) not in _PLAIN_TENSORS:  # a tensor subclass: the dispatcher handles it
                    return self.custom_op(*args)
                needs_grad = needs_grad or a.requires_grad
        if needs_grad and self._apply is not None and _grad_enabled():
            return self._apply(*args)
        return self.impl(*args)


def _triton_imports() -> bool:
    from tachyon.backend import triton_import_error

    return triton_import_error() is None


def _traced(impl: Callable[..., Any], mutates_args: tuple[str, ...] | str = ()) -> Callable[..., Any]:
    """``impl`` for ``torch.library.triton_op``: its Triton launches inside ``wrapped_launches``.
    Carries impl's signature with the annotations evaluated (triton_op infers the schema from it).

    Traced under Triton's interpreter, the tensor arguments the op does not mutate are given to
    ``impl`` as copies: there torch cannot lower a kernel to find which arguments it writes
    (kernels/launch.py), takes every argument as written and writes each back after the kernel,
    and a write-back into an input of the compiled graph from its backward part (a leaf such as
    a seed or mask tensor read by a backward kernel) is one AOTAutograd cannot partition. On a
    GPU torch's analysis finds the written arguments, and nothing is copied."""
    from tachyon.backend import triton_interpreting
    from tachyon.kernels import launch

    signature = inspect.signature(impl, eval_str=True)
    mutated = set(signature.parameters) if isinstance(mutates_args, str) else set(mutates_args)
    read_only = [name not in mutated for name in signature.parameters]
    interpreting = triton_interpreting()

    def traced(*args: Any, **kwargs: Any) -> Any:
        with launch.wrapped_launches():
            if interpreting and launch._wrapping:
                args = tuple(a.clone() if ro and isinstance(a, _Tensor) else a for a, ro in zip(args, read_only))
            return impl(*args, **kwargs)

    traced.__signature__ = signature  # type: ignore[attr-defined]
    traced.__name__ = traced.__qualname__ = impl.__name__
    traced.__module__ = impl.__module__
    return traced


def fused_op(name: str, *, mutates_args: tuple[str, ...] | str,
             triton_op: bool = False) -> Callable[[Callable[..., Any]], FusedOp]:
    """Decorator: register ``fn`` as the custom op ``name`` with an eager fast path (FusedOp);
    ``triton_op=True``: as a ``torch.library.triton_op`` (see the module docstring)."""
    return lambda fn: FusedOp(name, fn, mutates_args, triton_op)


__all__ = ["FusedOp", "eager_call", "fused_op"]
