"""Counting the memory traffic of Triton kernels under Triton's CPU interpreter.

Under ``TRITON_INTERPRET=1`` every ``tl.load`` / ``tl.store`` / atomic of a kernel reaches one of a
few methods of the interpreter's builder (``interpreter_builder``) with the block of addresses it
touches and the mask of active lanes, and every launch goes through ``GridExecutor.__call__``,
which runs the whole grid. Those are the only places that see both the addresses and the masks,
so this module wraps them (Triton has no hook or profiler API for its interpreter; its own
``pre_run_hooks`` see a launch's arguments but no memory access).

Per launch (one launch per grid) it records, separately for loads and stores:

- the distinct addresses the active lanes touched, times the element size: the launch's
  compulsory traffic (what a kernel must move at least once from or to memory, whatever cache it
  has), which masks and tails change and which the interpreter's block sizes do not;
- the requested bytes: active lanes times element size summed over every load / store executed,
  so a K/V block that several query blocks read counts once per read (what only a cache saves).

An atomic read-modify-write counts as a load and a store of its active lanes. Addresses are
byte addresses of elements (the CPU tensors' own memory, which the interpreter uses in place);
each element access covers [address, address + element size), and the distinct bytes are the
size of the union of those ranges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

_COMPACT_AT = 1 << 20  # merge a launch's pending byte ranges into a sorted disjoint set past this many


def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of half-open byte ranges [starts, ends) as sorted disjoint ranges."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    new = np.empty(starts.size, dtype=bool)
    new[:1] = True
    np.greater(starts[1:], reach[:-1], out=new[1:])  # a gap before this range: a new disjoint one
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, starts.size - 1)
    return starts[first], reach[last]


class _AddressSet:
    """The distinct bytes a launch touched, kept as byte ranges (a block of addresses is mostly
    runs of consecutive elements: one range per row, not one entry per element), with the
    requested total beside."""

    def __init__(self) -> None:
        self._starts: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []
        self._pending = 0
        self.requested = 0

    def add(self, addresses: np.ndarray, element_size: int) -> None:
        if addresses.size == 0:
            return
        self.requested += int(addresses.size) * element_size
        a = addresses.astype(np.uint64, copy=False).ravel()
        # split into runs of consecutive elements (in the order the lanes hold them)
        breaks = np.flatnonzero(np.diff(a) != element_size)
        first = np.concatenate(([0], breaks + 1))
        last = np.append(breaks, a.size - 1)
        self._starts.append(a[first])
        self._ends.append(a[last] + np.uint64(element_size))
        self._pending += first.size
        if self._pending > _COMPACT_AT:
            self._compact()

    def _compact(self) -> None:
        starts, ends = _merge(np.concatenate(self._starts), np.concatenate(self._ends))
        self._starts, self._ends, self._pending = [starts], [ends], starts.size

    def distinct_bytes(self) -> int:
        if not self._starts:
            return 0
        self._compact()
        return int((self._ends[0] - self._starts[0]).sum())


@dataclasses.dataclass
class LaunchCount:
    """The memory traffic of one Triton launch (bytes)."""

    kernel: str
    grid: tuple[int, int, int]
    read: int
    written: int
    requested_read: int
    requested_written: int


class _Launch:
    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self.loads = _AddressSet()
        self.stores = _AddressSet()
        self.grid: tuple[int, int, int] = (0, 0, 0)

    def finish(self) -> LaunchCount:
        return LaunchCount(self.kernel, self.grid, self.loads.distinct_bytes(), self.stores.distinct_bytes(),
                           self.loads.requested, self.stores.requested)


def _element_size(pointer_handle) -> int:
    # as the interpreter's pointer arithmetic (create_addptr): int1 elements take one byte
    return max(1, pointer_handle.get_element_ty().primitive_bitwidth // 8)


def _active(pointers: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    if mask is None:
        return pointers
    pointers, mask = np.broadcast_arrays(pointers, mask)
    return pointers[mask.astype(bool, copy=False)]


class InterpreterHooks:
    """Wraps the interpreter's memory ops and grid executor while installed; ``on_launch`` gets a
    LaunchCount after each launch and ``in_launch`` is True while a grid runs (the executor's own
    host copies of the arguments are then not the program's traffic)."""

    def __init__(self, on_launch: Callable[[LaunchCount], None]) -> None:
        self.on_launch = on_launch
        self.in_launch = False
        self._launch: _Launch | None = None
        self._undo: list[tuple[object, str, object, bool]] = []

    # --- wrappers ---------------------------------------------------------------------------------

    def _record(self, pointers, mask, *, load: bool, store: bool) -> None:
        launch = self._launch
        if launch is None:  # a jit function called outside a grid: nothing to attribute it to
            return
        addresses = _active(pointers.data, None if mask is None else mask.data)
        size = _element_size(pointers)
        if load:
            launch.loads.add(addresses, size)
        if store:
            launch.stores.add(addresses, size)

    def install(self) -> None:
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        load, store = builder.create_masked_load, builder.create_masked_store
        rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
        hooks = self

        def create_masked_load(ptrs, mask, other, *args, **kwargs):
            hooks._record(ptrs, mask, load=True, store=False)
            return load(ptrs, mask, other, *args, **kwargs)

        def create_masked_store(ptrs, value, mask, *args, **kwargs):
            hooks._record(ptrs, mask, load=False, store=True)
            return store(ptrs, value, mask, *args, **kwargs)

        def create_atomic_rmw(rmw_op, ptr, val, mask, *args, **kwargs):
            hooks._record(ptr, mask, load=True, store=True)
            return rmw(rmw_op, ptr, val, mask, *args, **kwargs)

        def create_atomic_cas(ptr, cmp, val, *args, **kwargs):
            hooks._record(ptr, None, load=True, store=True)
            return cas(ptr, cmp, val, *args, **kwargs)

        executor_call = interpreter.GridExecutor.__call__

        def grid_call(executor, *args, **kwargs):
            if hooks._launch is not None:  # not expected: kernels do not launch kernels
                return executor_call(executor, *args, **kwargs)
            hooks._launch = _Launch(getattr(executor.fn, "__name__", "triton_kernel"))
            hooks.in_launch = True
            set_grid_dim = builder.set_grid_dim

            def record_grid(nx, ny, nz):
                hooks._launch.grid = (nx, ny, nz)
                return set_grid_dim(nx, ny, nz)

            builder.set_grid_dim = record_grid
            try:
                result = executor_call(executor, *args, **kwargs)
                count = hooks._launch.finish()
            finally:
                del builder.set_grid_dim
                hooks._launch, hooks.in_launch = None, False
            hooks.on_launch(count)
            return result

        self._set(builder, "create_masked_load", create_masked_load, instance=True)
        self._set(builder, "create_masked_store", create_masked_store, instance=True)
        self._set(builder, "create_atomic_rmw", create_atomic_rmw, instance=True)
        self._set(builder, "create_atomic_cas", create_atomic_cas, instance=True)
        self._set(interpreter.GridExecutor, "__call__", grid_call, instance=False)

    def _set(self, owner: object, name: str, value: object, *, instance: bool) -> None:
        self._undo.append((owner, name, getattr(owner, name), instance))
        setattr(owner, name, value)

    def uninstall(self) -> None:
        while self._undo:
            owner, name, original, instance = self._undo.pop()
            if instance:
                delattr(owner, name)  # back to the class's method
            else:
                setattr(owner, name, original)


def refuse_compiled_launches(reason: str) -> Callable[[], None]:
    """Make a compiled (non-interpreted) Triton launch raise ``reason``; returns the undo."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self, *args, **kwargs):
        raise RuntimeError(f"{reason} (kernel {getattr(self, '__name__', self)})")

    JITFunction.run = run

    def undo() -> None:
        JITFunction.run = original

    return undo


__all__ = ["InterpreterHooks", "LaunchCount", "refuse_compiled_launches"]
