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
2. the arguments' key: per argument a few facts read by C-level passes over them (the tensors'
   dtypes and addresses modulo 16; each integer's value modulo 16 and bit
   length; the exact values of constexpr arguments and keyword arguments) selects the compiled
   kernel's launcher. Those facts determine Triton's specialization (dtype, pointer alignment,
   integer divisibility by 16, the value 1, 32-/64-bit range, constexprs), which is checked against
   Triton's own specializer once per process (:func:`argument_key_holds`); an unseen key, a
   negative integer or an argument of another type goes through Triton's
   generated binder (the specialization key itself, ~1 us per argument) and, for an unseen
   specialization (a new dtype, alignment, stride class, constexpr or device), through
   ``JITFunction.run`` once, which compiles. The key costs a fraction of the binder: a kernel of
   40 arguments, most of them strides, binds in about 30 us;
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
tensors), under an Autotuner with the same configs where the kernel is autotuned. torch finds
which arguments a traced kernel writes by lowering it for the GPU target; under the interpreter
there is none, so torch takes every tensor argument as written (cloned before the kernel and
written back after it; kernels/registry.py gives such a traced op copies of its read-only inputs).
Because every argument a traced kernel may write is cloned and written back, a traced launch
passes no two arguments that alias (they would be written back over each other): a pointer the
kernel does not touch, which an eager launch fills with another argument, is a tensor of its own
(``t.new_empty(0)``) while ``_wrapping`` is set, and partial sums go to buffers of their own
rather than views of one buffer.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
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
_data_ptr = torch.Tensor.data_ptr
_and = operator.and_
_bit_length = int.bit_length
_FIFTEEN = itertools.repeat(15)  # map(_and, ints, _FIFTEEN): each integer modulo 16 (stateless, shared)
_MAX_KEYS = 4096  # argument keys kept per kernel (a bound: e.g. int seeds give a key per residue and bit length)


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
    kernel, or an interpreted ``@triton.jit`` / ``@triton.autotune`` one); raises where there is none."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, (JITFunction, Autotuner)) and _jit_function(kernel) is not None:
        return kernel
    if type(kernel).__name__ == "InterpretedFunction" and hasattr(kernel, "fn"):
        return _interpreted_jit_class()(kernel)
    if isinstance(kernel, Autotuner) and type(kernel.fn).__name__ == "InterpretedFunction":
        # an autotuned kernel under the interpreter: the same configs, key and pruning over the twin
        import triton

        return triton.autotune(configs=kernel.configs, key=kernel.keys, prune_configs_by={
            "early_config_prune": kernel.early_config_prune, "perf_model": kernel.perf_model,
            "top_k": kernel.configs_top_k})(_interpreted_jit_class()(kernel.fn))
    raise RuntimeError(
        f"{getattr(kernel, '__name__', type(kernel).__name__)}: torch.library.wrap_triton traces @triton.jit and "
        "@triton.autotune kernels (and, under TRITON_INTERPRET=1, interpreted ones); this one is neither, so it "
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


class _Form:
    """How to key calls with one tuple of positional argument types and one set of keyword names:
    which positions hold tensors, integers (keyed by value modulo 16 and bit length) and exact values
    (constexpr parameters given positionally). ``ok`` is False where the argument key does not apply:
    an argument of another type at a runtime parameter, or a runtime parameter passed by keyword."""

    __slots__ = ("ok", "tensors", "ints", "exact")

    def __init__(self, jit: Any, types: tuple[type, ...], kw_names: tuple[str, ...]) -> None:
        params = jit.params
        self.ok = len(types) <= len(params) and all(
            p.is_constexpr for p in params if p.name in kw_names)
        tensors, ints, exact = [], [], []
        for i, t in enumerate(types):
            if not self.ok:
                break
            if params[i].is_constexpr:
                exact.append(i)
            elif issubclass(t, _Tensor):
                tensors.append(i)
            elif t is int or t is bool:
                ints.append(i)
            elif t is not float and t is not type(None):
                self.ok = False  # e.g. triton.reinterpret's TensorWrapper: Triton's binder handles it
        self.tensors, self.ints, self.exact = _picker(tensors), _picker(ints), _picker(exact)


def _picker(positions: list[int]) -> Callable[[Sequence[Any]], tuple]:
    """A C-level function returning the arguments (a tuple) at ``positions`` as a tuple (one
    position or none: a slice of the tuple)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    i = positions[0] if positions else 0
    return operator.itemgetter(slice(i, i + len(positions)))


_KEY_CHECK: bool | None = None  # argument_key_holds(), once per process


def argument_key_holds(backend: Any) -> bool:
    """Whether Triton's specializer (``native_specialize_impl``) gives one answer for all integers
    of one class of the argument key (value modulo 16, bit length; non-negative) and for tensors of
    one dtype whose addresses agree modulo 16: the condition for the argument key to select exactly
    the kernel Triton's binder would. Checked at the ends of every class (2,176 integers) and on
    tensors of four dtypes at every address residue, once per process; where it fails (a Triton that specializes on
    something else), every launch goes through the binder."""
    global _KEY_CHECK
    if _KEY_CHECK is None:
        try:
            from triton.runtime.jit import native_specialize_impl as spec
        except ImportError:
            _KEY_CHECK = False
            return False
        ok = True
        for bits in range(65):
            lo, hi = (0, 0) if bits == 0 else (1 << (bits - 1), (1 << bits) - 1)
            for r in range(16):
                values = [v for v in (lo + ((r - lo) % 16), hi - ((hi - r) % 16)) if lo <= v <= hi and v % 16 == r]
                answers = {spec(backend, v, False, True, True) for v in values}
                ok = ok and len(answers) <= 1
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
            bases = [torch.empty(64, dtype=dtype) for _ in range(2)]
            by_residue: dict[int, set] = {}
            for base in bases:
                for i in range(16):
                    view = base[i:]
                    by_residue.setdefault(view.data_ptr() % 16, set()).add(spec(backend, view, False, True, True))
            ok = ok and all(len(answers) == 1 for answers in by_residue.values())
        _KEY_CHECK = ok
    return _KEY_CHECK


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
        # argument key (module docstring) -> (launcher, function, metadata, the launcher's arguments after
        # the positional ones, all parameter names, those after the positional ones with their values);
        # (argument types, keyword names) -> _Form
        self._keyed: dict[tuple, tuple] = {}  # by the integers' exact values
        self._classed: dict[tuple, tuple] = {}  # by the integers' classes
        self._forms: dict[tuple, _Form] = {}
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

    def _plain(self, grid: Any, args: Sequence[Any], kwargs: dict[str, Any]):
        """Triton's own path; returns the compiled kernel it ran."""
        compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if self.autotuner is not None:
            self.best_config = self.autotuner.best_config
        return compiled

    def _tensor_picker(self, types: tuple[type, ...]) -> Callable[[Sequence[Any]], tuple]:
        """For positional arguments of these types: a C-level function picking the tensors out of them."""
        pick = _picker([i for i, t in enumerate(types) if issubclass(t, _Tensor)])
        if len(self._pickers) < 64:
            self._pickers[types] = pick
        return pick

    def _tune_key(self, args: Sequence[Any], kwargs: dict[str, Any], types: tuple[type, ...]) -> tuple:
        """The autotuning key as Autotuner.run builds it: the key arguments' values, then the dtype
        of every argument that has one (tensors), positional then keyword. The tensors are found
        by the arguments' types (one C-level pass; the positions cached per tuple of types)."""
        n = len(args)
        key = [args[i] if i < n else kwargs.get(name) for i, name in self._tune_positions]
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
        types = tuple(map(type, args))
        config, full, tune_key = None, kwargs, None
        if self.autotuner is not None:
            if self._tuned:
                tune_key = self._tune_key(args, kwargs, types)
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
        # the argument key (module docstring, step 2): C-level passes over the arguments. First with the
        # integers' exact values (no per-integer work; shapes and strides repeat), then by their classes
        # (value mod 16, bit length: e.g. int seeds). The autotuning key already holds every tensor's
        # dtype; the config goes by identity (the autotuner keeps its configs; Config.__hash__ is Python)
        form = self._forms.get((types, *kwargs))
        if form is None:
            form = self._form(types, tuple(kwargs))
        akey = ckey = None
        if form.ok:
            tensors, ints = form.tensors(args), form.ints(args)
            facts = (id(config), *(map(_dtype_of, tensors) if tune_key is None else tune_key),
                     *map(_and, map(_data_ptr, tensors), _FIFTEEN), *form.exact(args), *kwargs.values())
            akey = (device, form, ints, *facts)
            keyed = self._keyed.get(akey)
            if keyed is None and (not ints or min(ints) >= 0):
                ckey = (device, form, *map(_and, ints, _FIFTEEN), *map(_bit_length, ints), *facts)
                keyed = self._classed.get(ckey)
                if keyed is not None and len(self._keyed) < _MAX_KEYS:
                    with self._lock:
                        self._keyed[akey] = keyed
            if keyed is not None:
                run, function, metadata, tail, names, meta = keyed
                if callable(grid):  # with the constexprs (what tachyon's grids read: block sizes), else all
                    try:
                        grid = grid(meta)
                    except KeyError:
                        grid = grid(dict(zip(names, (*args, *tail))))
                n = len(grid)
                run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._current_stream(device),
                    function, metadata, None, None, None, *args, *tail)
                return config
        binder = self.jit.device_caches[device][4]
        bound, specialization, options = binder(*args, **full)
        key = (device, *specialization, *options.items())
        entry = self._entries.get(key)
        if entry is None:  # JITFunction.run compiles (or finds) the kernel and launches it
            compiled = self.jit.run(*args, grid=grid, warmup=False, **full)
            compiled.run  # noqa: B018  (loads the binary and builds the launcher)
            with self._lock:
                self._entries[key] = entry = (compiled.run, compiled.function, compiled.packed_metadata)
            self._remember(akey, ckey, entry, bound, len(args))
            return config
        run, function, metadata = entry
        self._remember(akey, ckey, entry, bound, len(args))
        if callable(grid):
            grid = grid(bound)
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._current_stream(device), function,
            metadata, None, None, None, *bound.values())
        return config

    def _form(self, types: tuple[type, ...], kw_names: tuple[str, ...]) -> _Form:
        form = _Form(self.jit, types, kw_names)
        if form.ok:
            try:
                form.ok = argument_key_holds(self._active_backend())
            except Exception:  # a Triton whose specializer or backend lookup differs: the binder decides
                form.ok = False
        if len(self._forms) < 256:
            with self._lock:
                self._forms[(types, *kw_names)] = form
        return form

    def _active_backend(self) -> Any:
        """The compiler backend of the active driver's target (what Triton's binder specializes for)."""
        from triton.compiler import make_backend

        return make_backend(self._active.get_current_target())

    def _remember(self, akey: tuple | None, ckey: tuple | None, entry: tuple, bound: dict[str, Any],
                  positional: int) -> None:
        """Key the launch entry by its argument keys (exact, and by class where computed): the launcher's
        arguments are the positional ones followed by ``tail`` (constexprs and defaults: fixed for
        one argument key), which are also what a grid function reads (``meta``)."""
        if akey is None:
            return
        values = tuple(bound.values())
        names = tuple(bound)
        keyed = (*entry, values[positional:], names, dict(zip(names[positional:], values[positional:])))
        with self._lock:
            if len(self._keyed) < _MAX_KEYS:
                self._keyed[akey] = keyed
            if ckey is not None and len(self._classed) < _MAX_KEYS:
                self._classed[ckey] = keyed

    def cache_sizes(self) -> tuple[int, int]:
        """(autotuning keys seen, compiled specializations launched through the fast path)."""
        return len(self._configs), len(self._entries)

    def argument_keys(self) -> int:
        """Argument keys seen by integer class (each selects one of the compiled specializations)."""
        return len(self._classed)


def fast_launch(kernel: Any) -> Any:
    """Decorator over ``@triton.jit`` / ``@triton.autotune``: a :class:`FastKernel`. Under Triton's
    interpreter, where there is no JITFunction to cache, every launch takes the plain path (the
    wrapper stays, so that :func:`wrapped_launches` can trace the kernel)."""
    return FastKernel(kernel)


__all__ = ["FastKernel", "argument_key_holds", "fast_launch", "fast_launch_enabled", "set_fast_launch",
           "traceable_kernel", "wrapped_launches"]
