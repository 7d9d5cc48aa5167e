"""The engine's training state as logical, per-parameter tensors for torch.distributed.checkpoint.

The ZeRO layout is flat: each optimizer param group is one padded 1-D buffer region, split
into ``dp`` equal partitions, and a rank's fp32 master and optimizer states cover its partition
(stages 1/2) or the whole region (stage 0). With tensor parallelism a rank's parameter is a
shard of the full one; with pipeline parallelism a rank holds one stage's parameters. A
checkpoint must not depend on any of that, so every trained parameter is written as its own
LOGICAL tensor of the FULL parameter (``[d0, d1 * ...]``, 1-D for a vector; see `boxes.py`):

    master/<param name>            fp32 master weight (with MoQ: the full-precision value, not the snap)
    optim/<param name>/<key>       each optimizer state shaped like the master (exp_avg, ...)
    optim_group/<g>/<key>          other tensor states of group g (``step``), written by rank 0
    model/<state_dict key>         frozen parameters and buffers, full shape, written once

Names are the module's (a PipelineModule's are layout-free: ``"{layer}.<name>"``,
``"tied_modules.<key>.<name>"``). Each rank contributes the pieces it owns (`ZeroStrategy.
master_pieces`: its partition at stages 1/2; at stage 0, which holds everything on every rank,
its share of the same split, so the write is spread over the ranks too), mapped through its
tensor-parallel shard into boxes of the logical tensor. A parameter another rank counts
(`tachyon.engine.zero.model_parallel`: a replica on a tensor-parallel rank other than 0, a tied
weight's copy on a later stage) is not written twice. No rank ever gathers a full parameter,
so memory stays at one partition. On load each rank asks DCP for the boxes of its NEW pieces
(stages 1/2) or of its whole local parameters (stage 0, or one process), and DCP reads just
those byte ranges, from whichever files hold them: any (dp, pp, tp) layout reads any other's
checkpoint, as long as the pipeline cuts the same layer list.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from ..zero.model_parallel import is_duplicate_name, tp_of
from .boxes import Boxes, Geometry, boxes_of
from .manifest import CheckpointError

MASTER, OPTIM, OPTIM_GROUP, MODEL = "master/", "optim/", "optim_group/", "model/"


@dataclasses.dataclass
class Piece:
    """The part [lo, hi) of a local parameter's flat range that ``rank`` (a data-parallel rank)
    holds, at ``master_offset`` in that rank's master tensor."""

    rank: int
    lo: int
    hi: int
    master_offset: int


def is_extra_state(key: str) -> bool:
    """A module's ``get_extra_state()`` entry (FP8 scaling state, dropout streams): saved as the
    tensor the module encodes it in, restored through ``set_extra_state``; its size may differ
    from the live module's (an FP8 amax history of another length)."""
    return key == "_extra_state" or key.endswith("._extra_state")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint")
    return dtype


def shard_spec_of(tensor: torch.Tensor) -> Any:
    from tachyon.parallel.tensor.shard import shard_spec

    return shard_spec(tensor)


def full_shape(tensor: torch.Tensor) -> list[int]:
    """The unsplit shape of a (possibly tensor-parallel) parameter."""
    spec = shard_spec_of(tensor)
    return list(spec.full_shape if spec is not None else tensor.shape)


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is an FSDP2-sharded (DTensor) parameter (ZeRO stage 3)."""
    return hasattr(tensor, "_local_tensor") and hasattr(tensor, "device_mesh")


def dtensor_piece(tensor: Any) -> tuple[Piece, torch.Tensor]:
    """This rank's piece of a dim-0-sharded DTensor: its range of the flattened (local) tensor
    and the flat local shard (ZeRO stage 3's frozen parameters)."""
    from ..zero.fsdp import dim0_range

    mesh = tensor.device_mesh
    lo, hi = dim0_range(tuple(tensor.shape), mesh.get_local_rank(), mesh.size())
    local = tensor._local_tensor.detach().reshape(-1)
    return Piece(mesh.get_local_rank(), lo, hi, 0), local


def settle_sharded(engine) -> None:
    """At ZeRO stage 3, the module's parameters back to their shards (`Stage3.reshard`) before
    they are named, saved, loaded or gathered."""
    reshard = getattr(engine.zero, "reshard", None)
    if reshard is not None:
        reshard()


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
    a frozen parameter / buffer (saved as is, full shape). Tied parameters appear under each of
    their keys."""
    names = {id(slot.param): n for slot, n in zip(engine.zero.flat.slots, param_names(engine))}
    out = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in names:
            out[key] = {"source": "master", "name": names[id(value)]}
        elif torch.is_tensor(value):
            out[key] = {"source": "model", "shape": full_shape(value), "dtype": dtype_name(value.dtype)}
            if isinstance(value, torch.nn.Parameter):
                out[key]["parameter"] = True  # a frozen parameter (exclude_frozen_parameters leaves it out)
    return out


def geometry(engine, param: torch.Tensor, version: int = 2) -> Geometry:
    tp = tp_of(engine.mesh)
    return Geometry(tuple(param.shape), shard_spec_of(param), tp.rank if tp is not None else 0, version)


def written_here(engine, name: str, tensor: torch.Tensor) -> bool:
    """Whether this rank writes ``name`` (not a copy another rank counts)."""
    return not is_duplicate_name(engine.module, name, tensor, tp_of(engine.mesh))


def pieces_of(engine, rank: int, *, whole: bool = False) -> list[list[Piece]]:
    """Per slot: the pieces data-parallel ``rank`` holds in its partition (``whole``: the full
    local range, from the rank's full master: stage 0 or one data-parallel rank)."""
    return [[Piece(rank, lo, hi, at) for lo, hi, at in per_slot]
            for per_slot in engine.zero.master_pieces(rank, whole=whole)]


def _logical(geo: Geometry, pieces: list[Piece], sources: list[torch.Tensor], dtype: torch.dtype) -> Any:
    """DCP's object for the pieces (``sources[i]``: the flat elements of piece i); a rank holding
    none of the parameter contributes no box."""
    if 0 in geo.shape:
        return torch.empty(geo.shape, dtype=dtype)  # an empty parameter: a plain tensor, deduplicated by DCP
    return Boxes(geo.shape, dtype, boxes_of(geo, [(p.lo, p.hi, t) for p, t in zip(pieces, sources)]))


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


def _gather_full(engine, tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a tensor-parallel frozen parameter (a collective over tp)."""
    import torch.distributed as dist

    from tachyon.parallel.tensor.shard import unshard_tensor

    tp = tp_of(engine.mesh)
    shards = [torch.empty_like(tensor) for _ in range(tp.size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=tp.group)
    return unshard_tensor(shards, shard_spec_of(tensor))


# ---------------------------------------------------------------------- save
def save_state_dict(engine, optimizer_meta: list[dict], exclude_frozen: bool = False) -> dict[str, Any]:
    """This rank's DCP state dict (see the module docstring); ``optimizer_meta`` from `meta.py`;
    ``exclude_frozen``: leave out frozen parameters (buffers are still written)."""
    zero, optimizer = engine.zero, engine.optimizer
    mine = pieces_of(engine, zero.rank, whole=zero.world_size == 1)
    quantizer = getattr(engine, "quantizer", None)  # MoQ: full-precision values, not the snapped model buffer
    masters = quantizer.checkpoint_masters() if quantizer is not None else zero.masters
    out: dict[str, Any] = {}
    for i, (slot, name) in enumerate(zip(zero.flat.slots, param_names(engine))):
        if not written_here(engine, name, slot.param):
            continue
        geo = geometry(engine, slot.param)
        m = zero.master_index(slot)
        master = zero.masters[m]

        def logical(source: torch.Tensor) -> Any:
            sources = [source.detach().narrow(0, p.master_offset, p.hi - p.lo) for p in mine[i]]
            return _logical(geo, mine[i], sources, source.dtype)

        out[MASTER + name] = logical(masters[m])
        if optimizer is not None:
            for key in optimizer_meta[slot.group]["flat"]:
                out[f"{OPTIM}{name}/{key}"] = logical(optimizer.state[master][key])
    if engine.world_comm.rank == 0:
        for g in range(len(zero.flat.regions)):
            masters_of_group = zero.group_masters(g)
            for key in optimizer_meta[g]["other"] if optimizer is not None and masters_of_group else {}:
                out[f"{OPTIM_GROUP}{g}/{key}"] = optimizer.state[masters_of_group[0]][key].detach()
    state = engine.module.state_dict(keep_vars=True)
    entries = model_state_keys(engine)
    for key, entry in entries.items():  # stage 3's frozen parameters: every data-parallel rank writes its shard
        if entry["source"] == "model" and is_sharded(state[key]) and not (exclude_frozen and entry.get("parameter")) \
                and written_here(engine, key, state[key]):
            piece, local = dtensor_piece(state[key])
            out[MODEL + key] = _logical(geometry(engine, state[key]), [piece],
                                        [local.narrow(0, 0, piece.hi - piece.lo)], local.dtype)
    if zero.rank == 0:  # frozen parameters and buffers: one data-parallel copy writes them
        tp = tp_of(engine.mesh)
        for key, entry in entries.items():
            if entry["source"] != "model" or (exclude_frozen and entry.get("parameter")) or is_sharded(state[key]):
                continue
            value = state[key]
            if shard_spec_of(value) is not None and tp is not None:
                full = _gather_full(engine, value)  # every tp rank of this copy takes part
                if tp.rank == 0 and written_here(engine, key, full):
                    out[MODEL + key] = full
            elif written_here(engine, key, value):
                out[MODEL + key] = value.detach()
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


def load_targets(engine, meta: dict, *, optimizer: bool, module_only: bool) -> LoadTargets:
    """Destination tensors for this rank's part of the checkpoint described by ``meta``."""
    zero = engine.zero
    version = int(meta.get("version", 1))
    sharded = zero.world_size > 1 and zero.partitioned_masters
    device = zero.device
    mine = pieces_of(engine, zero.rank, whole=not sharded)
    dcp_state: dict[str, Any] = {}
    masters, flat_states, other_states, model = {}, {}, {}, {}
    in_checkpoint = {p["name"] for p in meta["params"]}

    for i, (slot, name) in enumerate(zip(zero.flat.slots, param_names(engine))):
        if name not in in_checkpoint:  # load_module_strict=False: the parameter keeps its value
            continue
        geo = geometry(engine, slot.param, version)
        where = zero.masters[zero.master_index(slot)].device

        def target(dtype: torch.dtype) -> tuple[Any, list[torch.Tensor]]:
            local = [torch.empty(p.hi - p.lo, dtype=dtype, device=where) for p in mine[i]]
            return _logical(geo, mine[i], local, dtype), local

        dcp_state[MASTER + name], masters[name] = target(torch.float32)
        if optimizer and not module_only:
            for key, dtype in meta["optimizer"]["groups"][slot.group]["flat"].items():
                dcp_state[f"{OPTIM}{name}/{key}"], flat_states[(name, key)] = target(dtype_of(dtype))
    if optimizer and not module_only:
        for g, group in enumerate(meta["optimizer"]["groups"]):
            for key, spec in group["other"].items():
                t = torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]))
                dcp_state[f"{OPTIM_GROUP}{g}/{key}"] = other_states[(g, key)] = t
    saved = meta["model_keys"]
    state = engine.module.state_dict(keep_vars=True)
    for key, entry in model_state_keys(engine).items():
        if entry["source"] == "model":
            if is_extra_state(key):  # a module's own encoding: the saved shape (none in older checkpoints)
                entry = meta["model_keys"].get(key)
                if entry is None or entry["source"] != "model":
                    continue
            elif key not in saved:  # a frozen parameter may have been left out
                continue
            elif is_sharded(state[key]):  # stage 3: this rank's shard only
                piece, local = dtensor_piece(state[key])
                t = torch.empty(piece.hi - piece.lo, dtype=dtype_of(entry["dtype"]), device=local.device)
                dcp_state[MODEL + key] = _logical(geometry(engine, state[key], version), [piece], [t], t.dtype)
                model[key] = t
                continue
            t = torch.empty(entry["shape"], dtype=dtype_of(entry["dtype"]), device=device)
            dcp_state[MODEL + key] = model[key] = t
    return LoadTargets(dcp_state, masters, flat_states, other_states, model, mine)


def _fill(shape_like: torch.Tensor, pieces: list[Piece], tensors: list[torch.Tensor], dtype=None,
          base: torch.Tensor | None = None) -> torch.Tensor:
    """A new tensor like ``shape_like``: ``base`` (zeros when None) with the loaded pieces written in."""
    dtype = dtype or shape_like.dtype
    if base is not None and base.shape == shape_like.shape:
        out = base.detach().to(dtype=dtype, copy=True)
    else:
        out = torch.zeros(shape_like.shape, dtype=dtype, device=shape_like.device)
    for p, t in zip(pieces, tensors):
        out.narrow(0, p.master_offset, p.hi - p.lo).copy_(t)
    return out


@torch.no_grad()
def commit(engine, meta: dict, targets: LoadTargets, *, optimizer: bool) -> None:
    """Copy the loaded tensors into the engine (collective: all-gathers the new partitions)."""
    zero = engine.zero
    names = param_names(engine)
    by_master: dict[int, list[int]] = {}
    group_of: dict[int, int] = {}
    for i, slot in enumerate(zero.flat.slots):
        m = zero.master_index(slot)
        by_master.setdefault(m, []).append(i)
        group_of[m] = slot.group
    for m, master in enumerate(zero.masters):
        g = group_of.get(m, m)  # stages 0-2: master m is param group m (possibly without parameters)
        slots = [i for i in by_master.get(m, []) if names[i] in targets.masters]  # those the checkpoint holds
        pieces = [p for i in slots for p in targets.pieces[i]]
        loaded = [t for i in slots for t in targets.masters[names[i]]]
        master.copy_(_fill(master, pieces, loaded, base=master))
        if optimizer and engine.optimizer is not None:
            saved = meta["optimizer"]["groups"][g]
            current = engine.optimizer.state.get(master, {})
            state = {}
            for key, dtype in saved["flat"].items():
                tensors = [t for i in slots for t in targets.flat_states[(names[i], key)]]
                state[key] = _fill(master, pieces, tensors, dtype_of(dtype), base=current.get(key))
            for key in saved["other"]:
                state[key] = targets.other_states[(g, key)].clone()
            state.update(saved["values"])
            engine.optimizer.state.pop(master, None)
            if state:
                engine.optimizer.state[master] = state
    current = engine.module.state_dict(keep_vars=True)
    tp = tp_of(engine.mesh)
    extra = {key: tensor for key, tensor in targets.model.items() if is_extra_state(key)}
    if extra:  # get_extra_state() returns a fresh value: the module takes it back through set_extra_state
        result = engine.module.load_state_dict(extra, strict=False)
        if result.unexpected_keys:
            raise CheckpointError(f"the model did not take the saved extra states {result.unexpected_keys[:5]}")
    for key, tensor in targets.model.items():
        if key in extra:
            continue
        if is_sharded(current[key]):  # stage 3: the loaded piece is this rank's shard
            current[key]._local_tensor.copy_(tensor.view_as(current[key]._local_tensor))
            continue
        spec = shard_spec_of(current[key])
        if spec is not None and tp is not None:
            from tachyon.parallel.tensor.shard import shard_tensor

            tensor = shard_tensor(tensor, spec, tp.rank)
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
