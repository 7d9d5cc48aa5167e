"""The engine's training state as logical, per-parameter tensors for torch.distributed.checkpoint.

The ZeRO layout is flat: each optimizer param group is one padded 1-D buffer region, split
into ``world_size`` equal partitions, and a rank's fp32 master and optimizer states cover its
partition (stages 1/2) or the whole region (stage 0). A checkpoint must not depend on that
layout, so every trained parameter is written as its own LOGICAL 1-D tensor of ``numel``
elements (the flattened parameter, no padding):

    master/<param name>            fp32 master weight
    optim/<param name>/<key>       each optimizer state shaped like the master (exp_avg, ...)
    optim_group/<g>/<key>          other tensor states of group g (``step``), written by rank 0
    model/<state_dict key>         frozen parameters and buffers, written by rank 0

Each rank contributes the pieces it owns as shards of a ShardedTensor with global offsets
(`ZeroStrategy.master_pieces`: the parameter's elements in the rank's partition, one or more
pieces; stage 0, which holds everything
on every rank, writes the same pieces, so the write is spread over the ranks too). No rank
ever gathers a full parameter, so memory stays at one partition. On load each rank asks DCP
for the pieces of its NEW partition (stages 1/2) or for the full tensors (stage 0, or one
process), and DCP reads just those byte ranges, from whichever files hold them: any world
size reads any other's checkpoint.

(DTensor's Shard(0) cannot express the flat partitions: its chunks follow torch.chunk, while
a ZeRO partition boundary falls anywhere inside a parameter. ShardedTensor takes arbitrary
offsets; its deprecation warning is silenced here.)
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from typing import Any

import torch

from .manifest import CheckpointError

MASTER, OPTIM, OPTIM_GROUP, MODEL = "master/", "optim/", "optim_group/", "model/"


@dataclasses.dataclass
class Piece:
    """The part [lo, hi) of a parameter's flat range (parameter-relative) that ``rank`` holds,
    at ``master_offset`` in that rank's master tensor."""

    rank: int
    lo: int
    hi: int
    master_offset: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint")
    return dtype


def param_names(engine) -> list[str]:
    """The module's name of every trained parameter, in the flat layout's slot order."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for slot in engine.zero.flat.slots:
        if id(slot.param) not in names:
            raise ValueError("a trained parameter is not a parameter of the module; checkpoints need module names")
        out.append(names[id(slot.param)])
    return out


def model_state_keys(engine) -> dict[str, dict[str, Any]]:
    """Every key of ``module.state_dict()``: a trained parameter (restored from its master) or
    a frozen parameter / buffer (saved as is). Tied parameters appear under each of their keys."""
    names = {id(slot.param): n for slot, n in zip(engine.zero.flat.slots, param_names(engine))}
    out = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in names:
            out[key] = {"source": "master", "name": names[id(value)]}
        elif torch.is_tensor(value):
            out[key] = {"source": "model", "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
    return out


def pieces_of(engine, rank: int, *, whole: bool = False) -> list[list[Piece]]:
    """Per slot: the pieces ``rank`` holds in its partition (``whole``: the full range, from
    the rank's full master: stage 0 or one process)."""
    return [[Piece(rank, lo, hi, at) for lo, hi, at in per_slot]
            for per_slot in engine.zero.master_pieces(rank, whole=whole)]


def _sharded(numel: int, dtype: torch.dtype, layout: list[list[Piece]], local: list[torch.Tensor], device,
             rank: int) -> Any:
    """A 1-D ShardedTensor of ``numel`` whose shards are ``layout`` (every rank's pieces) and
    whose local shards are ``local`` (this rank's pieces, in order). No communication: every
    rank computes the same global layout from the flat partitions."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    metas = []
    pieces = [p for per_rank in layout for p in per_rank]
    for p in pieces:
        where = str(device) if p.rank == rank else torch.device(device).type
        metas.append(ShardMetadata([p.lo], [p.hi - p.lo], f"rank:{p.rank}/{where}"))
    mine = [m for p, m in zip(pieces, metas) if p.rank == rank]
    shards = [Shard(t, m) for t, m in zip(local, mine)]
    global_md = ShardedTensorMetadata(metas, torch.Size([numel]), TensorProperties(dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_md)


def flat_state_keys(optimizer, master: torch.Tensor) -> tuple[dict[str, str], dict[str, dict], dict[str, Any]]:
    """The optimizer state of ``master`` split into ({key: dtype} of tensors shaped like the
    master, {key: {"shape", "dtype"}} of other tensors, {key: value} of non-tensors)."""
    flat, other, values = {}, {}, {}
    for key, value in (optimizer.state.get(master, {}) if optimizer is not None else {}).items():
        if torch.is_tensor(value) and value.shape == master.shape:
            flat[key] = dtype_name(value.dtype)
        elif torch.is_tensor(value):
            other[key] = {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}
        else:
            values[key] = value
    return flat, other, values


# ---------------------------------------------------------------------- save
def save_state_dict(engine, rank: int, world_size: int, optimizer_meta: list[dict]) -> dict[str, Any]:
    """This rank's DCP state dict (see the module docstring); ``optimizer_meta`` from `meta.py`."""
    zero, optimizer = engine.zero, engine.optimizer
    names = param_names(engine)
    sharded = world_size > 1
    device = zero.flat.buffer.device
    mine = pieces_of(engine, rank, whole=not sharded)
    layout = [pieces_of(engine, r) for r in range(world_size)] if sharded else None
    out: dict[str, Any] = {}

    def logical(slot_index: int, numel: int, source: torch.Tensor) -> Any:
        local = [source.detach().narrow(0, p.master_offset, p.hi - p.lo) for p in mine[slot_index]]
        if not sharded or numel == 0:  # an empty parameter has no shards to describe
            return local[0] if local else source.new_empty(0)
        per_rank = [lay[slot_index] for lay in layout]
        return _sharded(numel, source.dtype, per_rank, local, device, rank)

    for i, (slot, name) in enumerate(zip(zero.flat.slots, names)):
        master = zero.masters[slot.group]
        out[MASTER + name] = logical(i, slot.numel, master)
        if optimizer is not None:
            for key in optimizer_meta[slot.group]["flat"]:
                out[f"{OPTIM}{name}/{key}"] = logical(i, slot.numel, optimizer.state[master][key])
    if rank == 0:
        for g, master in enumerate(zero.masters):
            for key in optimizer_meta[g]["other"] if optimizer is not None else {}:
                out[f"{OPTIM_GROUP}{g}/{key}"] = optimizer.state[master][key].detach()
        state = engine.module.state_dict(keep_vars=True)
        for key, entry in model_state_keys(engine).items():
            if entry["source"] == "model":
                out[MODEL + key] = state[key].detach()
    return out


# ---------------------------------------------------------------------- load
@dataclasses.dataclass
class LoadTargets:
    """Fresh tensors DCP fills; nothing of the engine is touched until `commit`."""

    dcp_state: dict[str, Any]
    masters: dict[str, list[torch.Tensor]]
    """name -> this rank's loaded pieces (same order as its `Piece` list)."""
    flat_states: dict[tuple[str, str], list[torch.Tensor]]
    other_states: dict[tuple[int, str], torch.Tensor]
    model: dict[str, torch.Tensor]
    pieces: list[list[Piece]]


def load_targets(engine, meta: dict, *, rank: int, world_size: int, optimizer: bool, module_only: bool) -> LoadTargets:
    """Destination tensors for this rank's part of the checkpoint described by ``meta``."""
    zero = engine.zero
    names = param_names(engine)
    sharded = world_size > 1 and zero.partitioned_masters
    device = zero.flat.buffer.device
    mine = pieces_of(engine, rank, whole=not sharded)
    layout = [pieces_of(engine, r) for r in range(world_size)] if sharded else None
    dcp_state: dict[str, Any] = {}
    masters, flat_states, other_states, model = {}, {}, {}, {}

    def target(slot_index: int, numel: int, dtype: torch.dtype) -> tuple[Any, list[torch.Tensor]]:
        local = [torch.empty(p.hi - p.lo, dtype=dtype, device=device) for p in mine[slot_index]]
        if not sharded or numel == 0:
            return (local[0] if local else torch.empty(0, dtype=dtype, device=device)), local
        return _sharded(numel, dtype, [lay[slot_index] for lay in layout], local, device, rank), local

    for i, (slot, name) in enumerate(zip(zero.flat.slots, names)):
        dcp_state[MASTER + name], masters[name] = target(i, slot.numel, torch.float32)
        if optimizer and not module_only:
            for key, dtype in meta["optimizer"]["groups"][slot.group]["flat"].items():
                dcp_state[f"{OPTIM}{name}/{key}"], flat_states[(name, key)] = target(i, slot.numel, dtype_of(dtype))
    if optimizer and not module_only:
        for g, group in enumerate(meta["optimizer"]["groups"]):
            for key, spec in group["other"].items():
                t = torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]))
                dcp_state[f"{OPTIM_GROUP}{g}/{key}"] = other_states[(g, key)] = t
    for key, entry in model_state_keys(engine).items():
        if entry["source"] == "model":
            t = torch.empty(entry["shape"], dtype=dtype_of(entry["dtype"]), device=device)
            dcp_state[MODEL + key] = model[key] = t
    return LoadTargets(dcp_state, masters, flat_states, other_states, model, mine)


def _fill(shape_like: torch.Tensor, pieces: list[Piece], tensors: list[torch.Tensor], dtype=None) -> torch.Tensor:
    out = torch.zeros(shape_like.shape, dtype=dtype or shape_like.dtype, device=shape_like.device)
    for p, t in zip(pieces, tensors):
        out.narrow(0, p.master_offset, p.hi - p.lo).copy_(t)
    return out


@torch.no_grad()
def commit(engine, meta: dict, targets: LoadTargets, *, optimizer: bool) -> None:
    """Copy the loaded tensors into the engine (collective: all-gathers the new partitions)."""
    zero = engine.zero
    names = param_names(engine)
    by_group: dict[int, list[int]] = {}
    for i, slot in enumerate(zero.flat.slots):
        by_group.setdefault(slot.group, []).append(i)
    for g, master in enumerate(zero.masters):
        slots = by_group.get(g, [])
        pieces = [p for i in slots for p in targets.pieces[i]]
        loaded = [t for i in slots for t in targets.masters[names[i]]]
        master.copy_(_fill(master, pieces, loaded))
        if optimizer and engine.optimizer is not None:
            saved = meta["optimizer"]["groups"][g]
            state = {}
            for key, dtype in saved["flat"].items():
                tensors = [t for i in slots for t in targets.flat_states[(names[i], key)]]
                state[key] = _fill(master, pieces, tensors, dtype_of(dtype))
            for key in saved["other"]:
                state[key] = targets.other_states[(g, key)].clone()
            state.update(saved["values"])
            engine.optimizer.state.pop(master, None)
            if state:
                engine.optimizer.state[master] = state
    current = engine.module.state_dict(keep_vars=True)
    for key, tensor in targets.model.items():
        current[key].copy_(tensor)
    zero.after_step()  # the masters into the model buffer, then the partitions all-gathered


# ---------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """torch CPU and CUDA generators, python ``random``, numpy's global generator (if importable)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda = state["torch_cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached_gaussian"]))
