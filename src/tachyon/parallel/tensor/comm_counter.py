"""``CommCounter``: every torch.distributed call a block makes, with its bytes and mesh axis.

    with CommCounter(mesh) as comm:
        loss = model(x).backward()
    comm.bytes(axis="tp")                     # payload bytes of all tensor-parallel collectives
    comm.bytes(op="send", axis="pp")          # activations and gradients sent to pipeline neighbours
    print(comm.table())                       # op x axis: calls, payload bytes, bytes sent on a ring

It wraps the torch.distributed functions (in ``torch.distributed`` and in
``torch.distributed.distributed_c10d``, so torch.distributed.pipelining's P2P ops, which call
``dist.isend`` through P2POp, are seen too) for the duration of the block. A call made inside
another counted call (a deprecated name forwarding to its new one) counts once. Code that
imported a collective by name before the block (``from torch.distributed import all_reduce``)
is not seen.

Per call it records the **payload** (exact): the tensor a rank contributes: all_reduce and
broadcast the tensor, all_gather this rank's input, reduce_scatter the full input, send/recv the
tensor. Beside it, **sent** is what this rank puts on the wire with the standard ring algorithms,
g ranks in the group, N the payload: all_reduce 2 (g-1)/g N, all_gather (g-1) N,
reduce_scatter (g-1)/g N, all_to_all (g-1)/g N, broadcast N (at most; the last rank of a
ring sends nothing), send N, recv 0. NCCL's tree all-reduce sends the same amount asymptotically.

The axis of a call is the mesh axis whose group it ran on ("tp", "dp", "pp", "mp"), "world" for
the default group, "other" for any other group.
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# op name -> (argument holding the payload, kind for the wire formula)
_OPS: dict[str, tuple[str, str]] = {
    "all_reduce": ("tensor", "all_reduce"),
    "broadcast": ("tensor", "broadcast"),
    "all_gather_single": ("input_tensor", "all_gather"),
    "all_gather_into_tensor": ("input_tensor", "all_gather"),
    "all_gather": ("tensor", "all_gather"),
    "reduce_scatter_single": ("input", "reduce_scatter"),
    "reduce_scatter_tensor": ("input", "reduce_scatter"),
    "reduce_scatter": ("input_list", "reduce_scatter"),
    "all_to_all_single": ("input", "all_to_all"),
    "isend": ("tensor", "send"),
    "send": ("tensor", "send"),
    "irecv": ("tensor", "recv"),
    "recv": ("tensor", "recv"),
}


@dataclass(frozen=True)
class CommCall:
    """One counted call: op (torch's function name), kind (all_reduce, all_gather, reduce_scatter,
    all_to_all, broadcast, send, recv), axis, group_size, dtype, payload and sent bytes."""

    op: str
    kind: str
    axis: str
    group_size: int
    dtype: str
    payload: int
    sent: float


def _nbytes(value: Any) -> tuple[int, str]:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size(), str(value.dtype).replace("torch.", "")
    if isinstance(value, (list, tuple)) and value:
        sizes = [_nbytes(v) for v in value]
        return sum(s for s, _ in sizes), sizes[0][1]
    return 0, "?"


def wire_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for ``kind`` with ring algorithms (see the module docstring)."""
    g = group_size
    if g <= 1:
        return 0.0
    return {
        "all_reduce": 2 * (g - 1) / g * payload,
        "all_gather": (g - 1) * payload,
        "reduce_scatter": (g - 1) / g * payload,
        "all_to_all": (g - 1) / g * payload,
        "broadcast": float(payload),
        "send": float(payload),
        "recv": 0.0,
    }[kind]


class CommCounter:
    """Counts torch.distributed calls inside a ``with`` block (see the module docstring).

    mesh: a tachyon Mesh or mesh-like view, to name the axis of each call (None: "world" /
    "other" only). Read ``calls`` (list of CommCall), ``bytes(op=, axis=, kind=, field=)``,
    ``count(...)`` and ``table()`` afterwards. Re-entering adds to the counts.
    """

    def __init__(self, mesh: Any = None) -> None:
        self.mesh = mesh
        self.calls: list[CommCall] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._axis_cache: dict[Any, str] = {}

    # ------------------------------------------------------------------ recording
    def _axis(self, group: Any) -> str:
        key = group if group is not None else "world"
        if key in self._axis_cache:
            return self._axis_cache[key]
        # a mesh axis spanning every rank may run on the default group itself (DeviceMesh reuses
        # it), so the mesh's axes are matched first, by identity, then by their ranks
        group = dist.group.WORLD if group is None else group
        axis = "world" if group is dist.group.WORLD else "other"
        if self.mesh is not None:
            names = [n for n in ("tp", "dp", "pp", "mp") if self.mesh.size(n) > 1]
            ranks = sorted(dist.get_process_group_ranks(group))
            by_identity = [n for n in names if self.mesh.group(n) is group]
            by_ranks = [n for n in names if sorted(self.mesh.ranks(n)) == ranks]
            if by_identity or by_ranks:
                axis = (by_identity or by_ranks)[0]
        self._axis_cache[key] = axis
        return axis

    def _record(self, op: str, bound: inspect.BoundArguments) -> None:
        arg, kind = _OPS[op]
        payload, dtype = _nbytes(bound.arguments.get(arg))
        group = bound.arguments.get("group")
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        if kind in ("send", "recv"):
            size = 2
        call = CommCall(op, kind, self._axis(group), size, dtype, payload, wire_bytes(kind, payload, size))
        with self._lock:
            self.calls.append(call)

    def _wrap(self, op: str, original: Any) -> Any:
        signature = inspect.signature(original)
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if depth == 0:
                counter._record(op, signature.bind(*args, **kwargs))
            counter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.depth = depth

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = op
        return wrapper

    def __enter__(self) -> CommCounter:
        if self._saved:
            raise RuntimeError("CommCounter: already active")
        for op in _OPS:
            original = getattr(c10d, op, None) or getattr(dist, op, None)
            if original is None:
                continue
            wrapper = self._wrap(op, original)
            for namespace in (dist, c10d):
                if hasattr(namespace, op):
                    self._saved.append((namespace, op, getattr(namespace, op)))
                    setattr(namespace, op, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for namespace, op, original in reversed(self._saved):
            setattr(namespace, op, original)
        self._saved.clear()

    # ------------------------------------------------------------------ reading
    def select(self, op: str | None = None, axis: str | None = None, kind: str | None = None) -> list[CommCall]:
        return [c for c in self.calls if (op is None or c.op == op) and (axis is None or c.axis == axis)
                and (kind is None or c.kind == kind)]

    def bytes(self, op: str | None = None, axis: str | None = None, kind: str | None = None,
              field: str = "payload") -> float:
        """Sum of ``field`` ("payload" or "sent") over the matching calls."""
        if field not in ("payload", "sent"):
            raise ValueError(f"CommCounter.bytes: field must be 'payload' or 'sent'; got {field!r}")
        return sum(getattr(c, field) for c in self.select(op, axis, kind))

    def count(self, op: str | None = None, axis: str | None = None, kind: str | None = None) -> int:
        return len(self.select(op, axis, kind))

    def summary(self) -> dict[tuple[str, str], dict[str, float]]:
        """{(kind, axis): {"calls", "payload", "sent"}}."""
        out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"calls": 0, "payload": 0, "sent": 0.0})
        for c in self.calls:
            row = out[(c.kind, c.axis)]
            row["calls"] += 1
            row["payload"] += c.payload
            row["sent"] += c.sent
        return dict(out)

    def table(self) -> str:
        lines = ["| kind | axis | calls | payload bytes | sent bytes (ring) |", "|---|---|---|---|---|"]
        for (kind, axis), row in sorted(self.summary().items()):
            lines.append(f"| {kind} | {axis} | {row['calls']} | {row['payload']:.0f} | {row['sent']:.0f} |")
        return "\n".join(lines)


__all__ = ["CommCall", "CommCounter", "wire_bytes"]
