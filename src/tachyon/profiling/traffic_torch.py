"""The bytes a PyTorch operator reads and writes, from its schema and its tensors.

The rule (the same for HF's eager ops, cuBLAS GEMMs behind ``aten.mm``/``addmm``, SDPA and the
ops tachyon's launchers run): an op reads each tensor input once and writes each tensor output
once, and that is one kernel launch when it writes anything. Details, all from the op's schema:

- views and metadata ops (``op.is_view``, the ``inplace_view`` tag: view, permute, expand,
  unbind, detach, set_, ...; and ``_unsafe_view``, a view the schema does not mark as one) and
  allocations (empty, empty_like, new_empty, ...) move nothing and launch nothing;
- factories such as ``zeros_like``, ``randn_like``, ``new_zeros`` take only the shape of their
  tensor argument: they write their output and read nothing;
- a mutated argument (``Tensor(a!)``) is written; it is also read, except where the op only
  overwrites it: ``out=`` arguments, ``copy_``, ``fill_``, ``zero_`` and the random fills;
- a return that aliases an input (an in-place op returning self) is not counted again;
- a tensor's bytes are its distinct elements: dimensions of stride 0 (``expand``) add nothing,
  and the same tensor passed twice is read once;
- ``aten._fused_adam(w)_`` writes its grads only when given a ``grad_scale`` (the CUDA kernel
  stores the unscaled gradient only then), though the schema marks them mutable;
- an op that writes nothing (``.item()``, ``equal``) is a copy to the host or a sync, no launch;
- a row gather (``embedding``, ``index_select`` along dim 0) reads its indices and the distinct
  rows they pick, not the whole table (a decode step reads one row of a 50k-row embedding).

Some CUDA implementations launch more than one kernel for one op (LayerNorm backward: dx and the
weight gradients; a large reduction in two passes); the count says one. Host-to-device copies
that only a CUDA run makes (a CPU tensor moved with ``.to("cuda")``) are not seen on CPU.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

_ALLOCATIONS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "resize_as_", "lift_fresh", "_unsafe_view", "_reshape_alias",
}
_WRITE_ONLY_SELF = {
    "copy_", "fill_", "zero_", "random_", "uniform_", "normal_", "bernoulli_", "exponential_",
    "geometric_", "cauchy_", "log_normal_",
}
_FUSED_ADAM = {"_fused_adam_", "_fused_adamw_"}
# factories that take only the shape, dtype and device of their tensor argument
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_full"}


def _shape_only(name: str) -> bool:
    return name.endswith("_like") or name in _SHAPE_ONLY


def moves_nothing(func: torch._ops.OpOverload) -> bool:
    """True for views, metadata-only ops and allocations."""
    name = func.overloadpacket.__name__
    return bool(getattr(func, "is_view", False)) or torch.Tag.inplace_view in func.tags or name in _ALLOCATIONS


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor view addresses (stride-0 dims count once)."""
    if t.numel() == 0:
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # tensors without storage (fake, functional): identity instead
        ptr = -id(t)
    return ptr, t.dtype, tuple(t.shape), tuple(t.stride())


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]


def _row_gather_bytes(name: str, bound: dict) -> int | None:
    """Bytes a row gather reads from its table (the distinct rows it picks), or None if the op is
    not one. (The dispatch mode is off inside its handler: torch.unique here is not counted.)"""
    if name == "embedding":
        table, index = bound.get("weight"), bound.get("indices")
    elif name == "index_select" and isinstance(bound.get("self"), torch.Tensor) \
            and bound.get("dim") in (0, -bound["self"].dim()):
        table, index = bound["self"], bound.get("index")
    else:
        return None
    if not isinstance(table, torch.Tensor) or not isinstance(index, torch.Tensor) or table.dim() < 1:
        return None
    return int(torch.unique(index).numel()) * tensor_bytes(table[0])


def op_bytes(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """(bytes read, bytes written) of one call of ``func`` with these arguments and result."""
    if moves_nothing(func):
        return 0, 0
    name = func.overloadpacket.__name__
    schema = func._schema
    bound: dict[str, object] = {}
    for index, arg in enumerate(schema.arguments):
        if arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif index < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[index]
    gathered = _row_gather_bytes(name, bound)
    table_name = "weight" if name == "embedding" else "self"
    reads: dict[tuple, torch.Tensor] = {}
    writes: dict[tuple, torch.Tensor] = {}
    for arg in schema.arguments:
        tensors = _tensors(bound.get(arg.name))
        if not tensors:
            continue
        written = arg.alias_info is not None and arg.alias_info.is_write
        if name in _FUSED_ADAM and arg.name == "grads":
            written = bound.get("grad_scale") is not None
        if arg.name == "self" and _shape_only(name):
            continue
        if gathered is not None and arg.name == table_name:
            continue  # counted as the rows gathered
        read = not written or not (arg.kwarg_only or (name in _WRITE_ONLY_SELF and arg.name == "self"))
        for t in tensors:
            if read:
                reads.setdefault(_key(t), t)
            if written:
                writes.setdefault(_key(t), t)
    outputs = (out,) if len(schema.returns) == 1 else (out or ())
    for ret, value in zip(schema.returns, outputs):
        if ret.alias_info is not None:  # aliases an input: counted with that input, if written
            continue
        for t in _tensors(value):
            writes.setdefault(_key(t), t)
    return sum(map(tensor_bytes, reads.values())) + (gathered or 0), sum(map(tensor_bytes, writes.values()))


__all__ = ["moves_nothing", "op_bytes", "tensor_bytes"]
