"""Launching Triton kernels with less host time: a cached handle per kernel and specialization.

A plain ``kernel[grid](*args)`` goes through ``Autotuner.run`` (when autotuned) and
``JITFunction.run`` on every call: the driver's device and stream queries, the knobs, the
pre-run hooks, the argument binding and specialization, a string of the options for the cache key,
a check that no global the kernel read has changed, the launch metadata, and then the launcher.
That is 15-60 us of host time per launch, while many of tachyon's kernels run for less on a GPU.

``@fast_launch`` (on top of ``@triton.jit`` or ``@triton.autotune``) keeps the same call syntax,
``kernel[grid](*args, **constexprs)``, and after the first call with a given specialization does
only what decides which compiled kernel runs and the launch itself:

1. autotuned kernels: the autotuning key (the values of the autotuner's ``key`` arguments and every
   tensor argument's dtype, as ``Autotuner.run`` computes it) selects the config tuned for it;
   an unseen key goes through ``Autotuner.run`` once, which benchmarks and caches the choice;
2. Triton's own generated binder (native specialization: dtypes, 16-byte alignment of pointers,
   integer ranges and divisibility by 16, the value 1, constexprs) gives the specialization key, so
   a kernel is reused exactly where ``JITFunction.run`` would reuse it; an unseen key (a new dtype,
   alignment, stride class, constexpr or device) goes through ``JITFunction.run`` once, which
   compiles;
3. the compiled kernel's launcher is called with the current stream.

What the fast path leaves out: Triton's launch enter/exit hooks (the proton profiler; turn the
fast path off with ``set_fast_launch(False)`` to profile with them) and the per-call check that
globals the kernel read have not changed since it was compiled (tachyon's kernels read only
constants). Under Triton's interpreter (TRITON_INTERPRET=1) every call takes the plain path.

Under torch.compile an op registered with ``torch.library.triton_op`` (``fused_op(...,
triton_op=True)``, kernels/registry.py) is traced through its implementation: inside
:func:`wrapped_launches` every ``kernel[grid](...)`` goes through ``torch.library.wrap_triton``, so
the traced graph holds the Triton kernels themselves (``triton_kernel_wrapper_functional`` nodes,
which Inductor compiles and launches with its own code). Under the interpreter, the kernel given
to ``wrap_triton`` is a ``JITFunction`` over the same Python function whose launch runs the
interpreter (torch's ``wrap_triton`` leaves an interpreted kernel untraced: it would run on fake
tensors).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

_user_enabled = True  # set_fast_launch
_wrapping = 0  # > 0 inside wrapped_launches(): launches go through torch.library.wrap_triton
_enabled = True  # the cached path is taken: _user_enabled and not _wrapping (one global read per launch)
_Tensor = torch.Tensor
_dtype_of = operator.attrgetter("dtype")


def set_fast_launch(enabled: bool) -> None:
    """Turn the cached launch path on (default) or off for the whole process; off, every launch
    goes through Triton's own ``run`` (e.g. for Triton's launch hooks)."""
    global _enabled, _user_enabled
    _user_enabled = bool(enabled)
    _enabled = _user_enabled and not _wrapping


def fast_launch_enabled() -> bool:
    return _user_enabled


@contextlib.contextmanager
def wrapped_launches() -> Iterator[None]:
    """Inside: every FastKernel launch goes through ``torch.library.wrap_triton`` (a traced call to
    the Triton kernel) where wrap_triton is enabled, i.e. while a ``triton_op`` is traced (fake
    tensors, functionalization); where torch disables it (the op running on real tensors) the
    launch is the usual one. Process-wide while active, as torch.compile traces in one thread: a
    launch from another thread meanwhile goes through wrap_triton too, which on real tensors
    launches the same kernel."""
    global _enabled, _wrapping
    from torch._library.triton import is_wrap_triton_enabled

    if not is_wrap_triton_enabled():
        yield
        return
    _wrapping += 1
    _enabled = False
    try:
        yield
    finally:
        _wrapping -= 1
        _enabled = _user_enabled and not _wrapping


@functools.cache
def _interpreted_jit_class() -> type:
    from triton.runtime.jit import JITFunction

    class InterpretedJIT(JITFunction):
        """A JITFunction (what ``wrap_triton`` traces: source, parameters, name) whose launch runs
        Triton's interpreter on the same function, for tracing kernels under TRITON_INTERPRET=1."""

        def __init__(self, interpreted: Any) -> None:
            super().__init__(interpreted.fn)
            self.interpreted = interpreted

        def run(self, *args, grid, warmup, **kwargs):
            return self.interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

        @property
        def cache_key(self) -> str:
            # JITFunction's hashes the @triton.jit functions it calls, which here are interpreted
            # ones (not JITFunctions); this twin is one object per kernel, so its identity will do
            return f"interpreted:{self.fn.__module__}.{self.fn.__qualname__}:{id(self)}"

        def __hash__(self) -> int:
            return id(self)

    return InterpretedJIT


def traceable_kernel(kernel: Any) -> Any:
    """The kernel ``wrap_triton`` takes for ``kernel`` (a ``@triton.jit`` / ``@triton.autotune``
    kernel, or an interpreted ``@triton.jit`` one); raises where there is none."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, (JITFunction, Autotuner)) and _jit_function(kernel) is not None:
        return kernel
    if type(kernel).__name__ == "InterpretedFunction" and hasattr(kernel, "fn"):
        return _interpreted_jit_class()(kernel)
    raise RuntimeError(
        f"{getattr(kernel, '__name__', type(kernel).__name__)}: torch.library.wrap_triton traces @triton.jit and "
        "@triton.autotune kernels (and, under TRITON_INTERPRET=1, @triton.jit ones); this one is neither, so it "
        "cannot be traced into a torch.compile graph"
    )


def _jit_function(fn: Any):
    """The JITFunction under an Autotuner / Heuristics chain, or None (e.g. an InterpretedFunction)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)
        if fn is None:
            return None
    return fn


class FastKernel:
    """A Triton kernel (``@triton.jit``, optionally ``@triton.autotune`` on top) with cached
    launches; see the module docstring. ``kernel[grid](*args, **kwargs)`` launches it and returns
    the autotuner's config used (None for a kernel without autotuning); ``best_config`` is the
    config of the last launch. Other attributes (``configs``, ``fn``, ``arg_names``, ...) are the
    wrapped kernel's."""

    def __init__(self, kernel: Any) -> None:
        from triton.runtime.autotuner import Autotuner

        self.kernel = self.fn = kernel  # .fn as on Triton's Autotuner: the wrapped kernel
        self.jit = _jit_function(kernel)
        self.autotuner = kernel if isinstance(kernel, Autotuner) else None
        self.best_config = None
        # autotuning key -> (config, its keyword arguments); specialization key -> launch entry
        self._configs: dict[tuple, tuple[Any, dict[str, Any]]] = {}
        self._entries: dict[tuple, tuple[Callable, Any, Any]] = {}
        self._lock = threading.Lock()
        self._pickers: dict[tuple[type, ...], Callable[[Sequence[Any]], tuple]] = {}  # see _tensor_picker
        if self.autotuner is not None and self.jit is not None:
            names = self.jit.arg_names
            self._tune_positions = [(names.index(k), k) for k in self.autotuner.keys if k in names]
            self._tuned = len(self.autotuner.configs) > 1
        self._fast = self.jit is not None and (self.autotuner is None or type(kernel).run is Autotuner.run)
        self._traceable: Any = None  # traceable_kernel(kernel), built on the first traced launch
        from triton.runtime.driver import driver

        self._driver = driver  # Triton's DriverConfig: .active is the driver in force at each call
        self._active = None

    def _bind_driver(self, active: Any) -> None:
        """The device and stream queries of Triton's active driver. CUDA's device query is
        torch.cuda.current_device, a Python wrapper (lazy init, then torch._C._cuda_getDevice):
        a launch happens only on an initialized device, so the C function is called directly."""
        self._current_device = active.get_current_device
        self._current_stream = active.get_current_stream
        if self._current_device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
            self._current_device = torch._C._cuda_getDevice
        self._active = active

    def __getattr__(self, name: str) -> Any:
        kernel = self.__dict__.get("kernel")
        if kernel is None:
            raise AttributeError(name)
        return getattr(kernel, name)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self.launch, grid)  # a C-level partial: one Python frame less than a lambda

    def _wrapped(self, grid: Any, args: Sequence[Any], kwargs: dict[str, Any]):
        """Inside wrapped_launches(): the launch as a traced ``wrap_triton`` call."""
        from torch.library import wrap_triton

        if self._traceable is None:
            self._traceable = traceable_kernel(self.kernel)
        wrap_triton(self._traceable)[grid](*args, **kwargs)
        return None

    def _plain(self, grid: Any, args: Sequence[Any], kwargs: dict[str, Any]):
        """Triton's own path; returns the compiled kernel it ran."""
        compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if self.autotuner is not None:
            self.best_config = self.autotuner.best_config
        return compiled

    def _tensor_picker(self, types: tuple[type, ...]) -> Callable[[Sequence[Any]], tuple]:
        """For positional arguments of these types: a C-level function picking the tensors out of them."""
        positions = [i for i, t in enumerate(types) if issubclass(t, _Tensor)]
        if len(positions) >= 2:
            pick = operator.itemgetter(*positions)
        elif positions:
            i = positions[0]
            pick = lambda args: (args[i],)  # noqa: E731
        else:
            pick = lambda args: ()  # noqa: E731
        if len(self._pickers) < 64:
            self._pickers[types] = pick
        return pick

    def _tune_key(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
        """The autotuning key as Autotuner.run builds it: the key arguments' values, then the dtype
        of every argument that has one (tensors), positional then keyword. The tensors are found
        by the arguments' types (one C-level pass; the positions cached per tuple of types)."""
        n = len(args)
        key = [args[i] if i < n else kwargs.get(name) for i, name in self._tune_positions]
        types = tuple(map(type, args))
        pick = self._pickers.get(types) or self._tensor_picker(types)
        key += map(_dtype_of, pick(args))
        if kwargs:
            key += [v.dtype for v in kwargs.values() if isinstance(v, _Tensor)]
        return tuple(key)

    def launch(self, grid: Any, *args: Any, **kwargs: Any):
        """Launch on ``grid`` (a tuple, or a callable of the bound arguments); returns the config."""
        if not (_enabled and self._fast):
            if _wrapping:
                self._wrapped(grid, args, kwargs)
            else:
                self._plain(grid, args, kwargs)
            return self.best_config
        # DriverConfig._active is what its .active property returns once set (saves a Python call)
        active = self._driver._active or self._driver.active
        if active is not self._active:
            self._bind_driver(active)
        device = self._current_device()
        config, full = None, kwargs
        if self.autotuner is not None:
            if self._tuned:
                tune_key = self._tune_key(args, kwargs)
                found = self._configs.get(tune_key)
                if found is None:  # Autotuner.run benchmarks the configs for this key and launches
                    self._plain(grid, args, kwargs)
                    config = self.best_config
                    with self._lock:
                        self._configs[tune_key] = (config, config.all_kwargs())
                    return config
                config, config_kwargs = found
            else:
                config = self.autotuner.configs[0]
                config_kwargs = self._configs.get(())
                if config_kwargs is None:
                    self._configs[()] = config_kwargs = (config, config.all_kwargs())
                config_kwargs = config_kwargs[1]
            full = {**kwargs, **config_kwargs}
            self.best_config = config
            if config.pre_hook is not None:
                config.pre_hook({**dict(zip(self.jit.arg_names, args)), **full})
        binder = self.jit.device_caches[device][4]
        bound, specialization, options = binder(*args, **full)
        key = (device, *specialization, *options.items())
        entry = self._entries.get(key)
        if entry is None:  # JITFunction.run compiles (or finds) the kernel and launches it
            compiled = self.jit.run(*args, grid=grid, warmup=False, **full)
            compiled.run  # noqa: B018  (loads the binary and builds the launcher)
            with self._lock:
                self._entries[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return config
        run, function, metadata = entry
        if callable(grid):
            grid = grid(bound)
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._current_stream(device), function,
            metadata, None, None, None, *bound.values())
        return config

    def cache_sizes(self) -> tuple[int, int]:
        """(autotuning keys seen, compiled specializations launched through the fast path)."""
        return len(self._configs), len(self._entries)


def fast_launch(kernel: Any) -> Any:
    """Decorator over ``@triton.jit`` / ``@triton.autotune``: a :class:`FastKernel`. Under Triton's
    interpreter, where there is no JITFunction to cache, every launch takes the plain path (the
    wrapper stays, so that :func:`wrapped_launches` can trace the kernel)."""
    return FastKernel(kernel)


__all__ = ["FastKernel", "fast_launch", "fast_launch_enabled", "set_fast_launch", "traceable_kernel",
           "wrapped_launches"]
