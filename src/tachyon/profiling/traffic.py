"""Bytes read and written and kernel launches, per op and per module, counted exactly on CPU.

    from tachyon.profiling import TrafficCounter, count_traffic

    with TrafficCounter() as counter:
        layer(x).backward(dout)
    print(counter.table())                 # per op: bytes read / written, launches
    counter.total.bytes, counter.total.launches
    counter.by_module()["BertLayer.attention"]

    counter = count_traffic(fn, *args, **kwargs)   # runs fn under a counter; fn's result: counter.result

Why: most of what tachyon fuses (norms, activations, dropout, residual adds, attention's softmax,
the optimizer step, decode) is bound by memory bandwidth, and small batches by launch overhead.
Bytes moved and launches are properties of the program, not of the machine, so they can be
counted exactly on a CPU and compared, by one rule, with the module a user would otherwise run.

How each op is counted:

- Triton kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` before triton is
  imported; tachyon's ``backend="triton"``). Each launch (one per grid) counts the distinct
  addresses its active lanes load and store: its compulsory traffic. Beside it, the requested
  bytes (every active lane of every load and store) show re-reads that only a cache saves, such
  as attention's K/V read once per query block. See traffic_triton.py.
- Every other op (cuBLAS GEMMs behind ``aten.mm``, SDPA, HF's eager ops, the ops tachyon's
  launchers run around their kernels) is seen by a ``TorchDispatchMode``: its tensor inputs are
  read once, its outputs written once, one launch if it writes anything; views and metadata ops
  move nothing. See traffic_torch.py. For these ops requested = compulsory.
- tachyon's custom ops (``torch.ops.tachyon.*``) are opened: the counter runs the op's
  implementation with itself still active, so what runs inside (Triton launches, the launcher's
  torch ops) is counted, and the custom op's own inputs and outputs are not counted again. While
  the counter is active the ops take their dispatcher path (registry.eager_call sees the mode).
- Composite ops (``CompositeImplicitAutograd``: aten.linear, aten.to, ...) that reach the counter
  whole, as they do inside a custom op, are decomposed first, so they count as autograd's path
  counts them (linear as its GEMM, ``to`` as a copy only when it copies).
- Modules: ``torch.utils.module_tracker.ModuleTracker`` says which modules (forward or
  backward) are running; an op counts towards each of them and towards "Global". Its backward
  hooks sit on the modules' outputs, so the backward of the module whose output ``backward()``
  starts from is counted under "Global" only (start from a loss computed from it instead).

What it does not measure: caches (a byte read twice from L2 counts twice in requested, once in
compulsory; neither is what DRAM sees), overlap of kernels, clock speed, time. A compiled
(non-interpreted) Triton launch cannot be counted and raises an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.module_tracker import ModuleTracker

from tachyon.profiling.traffic_torch import op_bytes
from tachyon.profiling.traffic_triton import InterpreterHooks, LaunchCount, refuse_compiled_launches

MIB = float(1 << 20)


@dataclasses.dataclass
class Traffic:
    """Bytes and launches. ``read``/``written``: compulsory bytes; ``requested_*``: with re-reads."""

    read: int = 0
    written: int = 0
    launches: int = 0
    requested_read: int = 0
    requested_written: int = 0

    @property
    def bytes(self) -> int:
        """Compulsory bytes moved: read + written."""
        return self.read + self.written

    @property
    def requested(self) -> int:
        return self.requested_read + self.requested_written

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class TrafficEvent:
    """One counted op: a Triton launch or a torch op that moved bytes.

    op: "triton <kernel name>" or the aten overload ("aten.mm.default"); scope: the tachyon custom
    ops it ran inside, outermost first; backward: run by autograd's backward; modules: the
    modules running (fully qualified, from ModuleTracker)."""

    op: str
    scope: tuple[str, ...]
    backward: bool
    modules: tuple[str, ...]
    traffic: Traffic

    @property
    def label(self) -> str:
        return " > ".join((*self.scope, self.op))


def _without_leaves(value) -> tuple:
    return tuple(t for t in tree_leaves(value) if not (isinstance(t, torch.Tensor) and t.is_leaf))


class _ModuleTracker(ModuleTracker):
    """ModuleTracker that puts no gradient hook on a leaf tensor. A hook on a leaf (a parameter a
    module returns, as TE's ``return_bias``; a leaf input) holds its gradient while AccumulateGrad
    runs, so AccumulateGrad copies the gradient instead of keeping it: a copy the measured
    program does not make. Without those hooks, a module whose only tensors are leaves is
    attributed in backward a little longer (until backward ends)."""

    def _fw_pre_hook(self, mod, input) -> None:
        super()._fw_pre_hook(mod, _without_leaves(input))

    def _fw_post_hook(self, mod, input, output) -> None:
        super()._fw_post_hook(mod, input, _without_leaves(output))


def _triton_state() -> tuple[bool, bool]:
    """(triton imports, it runs under its interpreter)."""
    from tachyon.backend import triton_import_error, triton_interpreting

    return triton_import_error() is None, triton_interpreting()


def _device_key(values) -> str:
    for v in values:
        if isinstance(v, torch.Tensor):
            return "CUDA" if v.is_cuda else "CPU"
        if isinstance(v, (list, tuple)):
            key = _device_key(v)
            if key != "CPU":
                return key
    return "CPU"


class TrafficCounter(TorchDispatchMode):
    """Counts bytes read/written and kernel launches of everything run inside it (see the module
    docstring). Use as a context manager; read ``events``, ``total``, ``by_op()``,
    ``by_module()``, ``table()`` afterwards. One counter can be entered once at a time; entering
    it again adds to its counts.

    ``host_tensors``: tensors that a GPU run keeps on the host (e.g. the optimizers' ``step``
    counts, 0-dim CPU tensors): an op on these (with at most 0-dim scalars beside them) is host
    work, not a kernel, and is not counted. On CPU nothing else tells them apart from the device's tensors."""

    def __init__(self, *, track_modules: bool = True, host_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.events: list[TrafficEvent] = []
        self.result: Any = None
        self._track_modules = track_modules
        self._host = {t.data_ptr() for t in host_tensors}
        self._tracker: _ModuleTracker | None = None
        self._scope: list[str] = []
        self._hooks: InterpreterHooks | None = None
        self._undo_refusal: Callable[[], None] | None = None
        self._depth = 0

    # --- entering and leaving ----------------------------------------------------------------------

    def __enter__(self) -> TrafficCounter:
        self._depth += 1
        if self._depth > 1:  # re-entered around a custom op's implementation: the mode only
            return super().__enter__()
        importable, interpreting = _triton_state()
        if importable and interpreting:
            self._hooks = InterpreterHooks(self._on_launch)
            self._hooks.install()
        elif importable:
            self._undo_refusal = refuse_compiled_launches(
                "TrafficCounter counts Triton kernels only under Triton's CPU interpreter: set TRITON_INTERPRET=1 "
                "before triton is imported and run the kernels on CPU tensors with backend='triton'")
        if self._track_modules:
            self._tracker = _ModuleTracker()
            self._tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth > 0:
            return super().__exit__(*exc)
        try:
            super().__exit__(*exc)
        finally:
            if self._tracker is not None:
                self._tracker.__exit__(*exc)
                self._tracker = None
            if self._hooks is not None:
                self._hooks.uninstall()
                self._hooks = None
            if self._undo_refusal is not None:
                self._undo_refusal()
                self._undo_refusal = None

    # --- counting ------------------------------------------------------------------------------

    def _record(self, op: str, traffic: Traffic) -> None:
        modules = tuple(sorted(self._tracker.parents)) if self._tracker is not None else ("Global",)
        backward = torch._C._current_graph_task_id() != -1
        self.events.append(TrafficEvent(op, tuple(self._scope), backward, modules, traffic))

    def _on_launch(self, launch: LaunchCount) -> None:
        self._record(f"triton {launch.kernel}", Traffic(launch.read, launch.written, 1,
                                                        launch.requested_read, launch.requested_written))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._hooks is not None and self._hooks.in_launch:
            # the interpreter's own host copies of a launch's arguments: not the kernel's traffic
            return func(*args, **kwargs)
        if func.namespace == "tachyon":
            return self._run_custom_op(func, args, kwargs)
        if self._host and self._host_only(args, kwargs):
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
            # reached un-decomposed below autograd (inside a custom op): count what it runs, as
            # autograd's path would (aten.to -> _to_copy only when it copies, linear -> mm, ...)
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        read, written = op_bytes(func, args, kwargs, out)
        if read or written:
            self._record(str(func), Traffic(read, written, int(written > 0), read, written))
        return out

    def _host_only(self, args, kwargs) -> bool:
        """True for an op on host tensors, with at most 0-dim scalars beside them."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = [t.data_ptr() in self._host for t in tensors]
        return any(host) and all(h or t.dim() == 0 for h, t in zip(host, tensors))

    def _run_custom_op(self, func, args, kwargs):
        """Run a tachyon custom op's implementation with this mode active, so its inside is counted
        (and not its boundary: the op is a function call, not a kernel)."""
        kernel = torch.library.get_kernel(func, _device_key((*args, *kwargs.values())))
        keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
        self._scope.append(func.name())
        try:
            with self:
                return kernel.call_boxed(keyset, *args, **kwargs)
        finally:
            self._scope.pop()

    # --- results -------------------------------------------------------------------------------

    @property
    def total(self) -> Traffic:
        return sum((e.traffic for e in self.events), Traffic())

    def phase(self, backward: bool) -> Traffic:
        """The forward (False) or backward (True) part of ``total``."""
        return sum((e.traffic for e in self.events if e.backward == backward), Traffic())

    def by_op(self, *, split_phases: bool = True) -> dict[str, Traffic]:
        """Traffic per op label (custom-op scope > op), in first-run order; with ``split_phases``
        the label starts with "fwd " or "bwd "."""
        table: dict[str, Traffic] = {}
        for e in self.events:
            key = (("bwd " if e.backward else "fwd ") if split_phases else "") + e.label
            table[key] = table.get(key, Traffic()) + e.traffic
        return table

    def by_module(self) -> dict[str, Traffic]:
        """Traffic per module (fully qualified names from ModuleTracker, plus "Global")."""
        table: dict[str, Traffic] = {}
        for e in self.events:
            for m in e.modules:
                table[m] = table.get(m, Traffic()) + e.traffic
        return table

    def table(self, *, unit: float = MIB, unit_name: str = "MiB") -> str:
        """A text table of ``by_op()`` and the total."""
        rows = [(k, t) for k, t in self.by_op().items()] + [("total", self.total)]
        width = max(len(k) for k, _ in rows)
        head = f"{'op':<{width}}  {'read':>10}  {'written':>10}  {'requested':>10}  {'launches':>8}"
        lines = [f"{head}   ({unit_name})", "-" * len(head)]
        for key, t in rows:
            lines.append(f"{key:<{width}}  {t.read / unit:>10.3f}  {t.written / unit:>10.3f}  "
                         f"{t.requested / unit:>10.3f}  {t.launches:>8d}")
        return "\n".join(lines)


def count_traffic(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> TrafficCounter:
    """Run ``fn(*args, **kwargs)`` under a new TrafficCounter and return the counter; fn's return
    value is ``counter.result``."""
    if not callable(fn):
        raise ValueError(f"count_traffic: fn must be callable; got {type(fn).__name__}")
    counter = TrafficCounter()
    with counter:
        counter.result = fn(*args, **kwargs)
    return counter


__all__ = ["Traffic", "TrafficCounter", "TrafficEvent", "count_traffic"]
