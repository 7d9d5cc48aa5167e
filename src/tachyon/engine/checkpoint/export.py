"""Consolidated weights: offline from a checkpoint (fp32), or from a live engine (model dtype).

    state = export_model_state_dict("runs/ckpt")           # like DeepSpeed's zero_to_fp32
    model.load_state_dict(state, strict=True)

    save_16bit_model(engine, "out/")                        # out/model.safetensors (+ config.json)
    BertForMaskedLM.from_pretrained("out/")

    export_checkpoint("runs/ckpt", "out/", dtype=torch.bfloat16)   # `tachyon export`: no engine, no GPU

At ZeRO stage 3 the live model's parameters are shards: `consolidated_state_dict` gathers one
tensor at a time (an all-gather over the data-parallel ranks) and keeps it only on rank 0's CPU,
so no rank's device ever holds more than one whole parameter.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp

from . import manifest as mf
from .boxes import logical_shape
from .meta import parse_meta
from .state import MASTER, MODEL, dtype_of


def resolve_checkpoint(checkpoint_dir, tag: Any = None) -> Path:
    """The checkpoint directory: ``checkpoint_dir/<tag>``, ``checkpoint_dir/<latest>``, or
    ``checkpoint_dir`` itself when it holds a manifest and no tag is given."""
    root = Path(checkpoint_dir)
    if tag is None:
        if (root / mf.MANIFEST).is_file():
            return root
        tag = mf.read_latest(root)
        if tag is None:
            raise mf.CheckpointError(f"{root} has no {mf.LATEST!r} file and no {mf.MANIFEST}; pass tag=")
    return root / mf.check_tag(str(tag))


def export_model_state_dict(checkpoint_dir, tag: Any = None) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` rebuilt from a checkpoint, in one process, with no engine:
    trained parameters as their fp32 master weights in their own shapes, frozen parameters and
    buffers as saved, all at their full (unsplit) shapes whatever the (dp, pp, tp) layout that
    saved them. Keys are the module's ``state_dict()`` keys (tied weights under each key,
    sharing one tensor; a PipelineModule's layout-free names), so ``load_state_dict(strict=True)``
    accepts it. Every file is checked against the manifest first."""
    ckpt = resolve_checkpoint(checkpoint_dir, tag)
    manifest = mf.read_manifest(ckpt)
    error = mf.verify_files(ckpt, manifest)
    if error is not None:
        raise mf.CheckpointError(error)
    meta = parse_meta((ckpt / mf.META).read_text(), ckpt / mf.META)
    shapes = {p["name"]: p["shape"] for p in meta["params"]}
    version = int(meta.get("version", 1))
    request: dict[str, torch.Tensor] = {}
    for p in meta["params"]:
        request[MASTER + p["name"]] = torch.empty(logical_shape(tuple(p["shape"]), version), dtype=torch.float32)
    for key, entry in meta["model_keys"].items():
        if entry["source"] == "model":
            request[MODEL + key] = torch.empty(entry["shape"], dtype=dtype_of(entry["dtype"]))
    with mf.quiet_dcp():
        dcp.load(
            request,
            storage_reader=mf.SafeFileSystemReader(str(ckpt / mf.STATE_DIR)),
            planner=mf.TensorsOnlyLoadPlanner(),
            no_dist=True,
        )
    out = {}
    for key, entry in meta["model_keys"].items():
        if entry["source"] == "master":
            out[key] = request[MASTER + entry["name"]].view(shapes[entry["name"]])
        else:
            out[key] = request[MODEL + key]
    return out


def _unique_views(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop keys whose tensor is the same view as an earlier key's (tied weights); keep the
    first, as transformers' save_pretrained does."""
    seen, out = set(), {}
    for key, tensor in state.items():
        ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and ident in seen:
            continue
        seen.add(ident)
        out[key] = tensor
    return out


def _stage3_state_dict(engine) -> dict[str, Any] | None:
    """`consolidated_state_dict` at ZeRO stage 3 (module docstring): every sharded tensor
    all-gathered over the data-parallel ranks in ``state_dict`` order (tied weights once), cast to
    the model dtype, gathered over tensor parallelism on data-parallel rank 0, kept on rank 0's CPU."""
    from .state import is_sharded, shard_spec_of

    mesh = engine.mesh
    tp = None
    if mesh is not None and mesh.size("tp") > 1:
        from tachyon.parallel.tensor import tp_group

        tp = tp_group(mesh)
    keep = engine.world_comm.rank == 0
    dtype = engine.precision.model_dtype
    done: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for key, value in engine.module.state_dict().items():
        if not torch.is_tensor(value):
            out[key] = value
            continue
        if id(value) in done:
            if keep:
                out[key] = done[id(value)]
            continue
        full = value
        if is_sharded(value):
            full = value.full_tensor()  # collective over the data-parallel ranks
            if full.is_floating_point():
                full = full.to(dtype)
        if tp is not None and shard_spec_of(value) is not None and engine.comm.rank == 0:
            from .state import _gather_full

            full = _gather_full(engine, full)
        if keep:
            out[key] = done[id(value)] = full.detach().to("cpu")
        del full
    return out if keep else None


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The whole model's ``state_dict()`` (model dtype, full shapes, the module's names; a
    PipelineModule's layout-free ones) on global rank 0, None on the other ranks. Collective:
    every rank calls it; tensor-parallel shards are all-gathered over tp and the pipeline stages
    gathered to rank 0 (the data-parallel copies are equal: the first one's is used)."""
    if engine.zero.stage == 3:
        from .state import settle_sharded

        settle_sharded(engine)
        return _stage3_state_dict(engine)
    mesh = engine.mesh
    if mesh is None:
        return engine.module.state_dict() if engine.world_comm.rank == 0 else None
    if engine.comm.rank != 0:
        return None
    from tachyon.parallel.tensor import full_state_dict, tp_group

    tp = tp_group(mesh)
    state = full_state_dict(engine.module, tp) if tp.size > 1 else engine.module.state_dict()
    if tp.rank != 0:
        return None
    if mesh.size("pp") == 1:
        return state
    import torch.distributed as dist

    state = {k: v.detach().cpu() for k, v in state.items() if torch.is_tensor(v)}
    group = mesh.group("pp")
    stages: list = [None] * mesh.size("pp") if dist.get_rank() == 0 else None
    dist.gather_object(state, stages, dst=0, group=group)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in stages:
        for key, value in part.items():
            merged.setdefault(key, value)  # tied modules: every stage holding one has the same weights
    return merged


def save_16bit_model(engine, save_dir, save_filename: str = "model.safetensors") -> str | None:
    """Write the module's weights in the model dtype (fp16/bf16 when training in it, else fp32)
    to ``save_dir/save_filename`` on rank 0 (DeepSpeed's save_16bit_model), whole: tensor- and
    pipeline-parallel parts are gathered (`consolidated_state_dict`); tensors only (a module's
    non-tensor ``_extra_state`` is left out; tachyon's FP8 state is a uint8 tensor and is kept). ``.safetensors`` files
    get transformers' metadata and, when the module has ``config.save_pretrained``, its
    ``config.json`` beside them, so ``from_pretrained(save_dir)`` loads them; other names are
    written with torch.save. Every rank must call this (ranks then wait for rank 0). Returns the
    file path on rank 0, None elsewhere."""
    if not isinstance(save_filename, str) or not save_filename or "/" in save_filename:
        raise ValueError(f"save_filename={save_filename!r} should be a file name such as 'model.safetensors'")
    comm = engine.world_comm
    state = consolidated_state_dict(engine)
    path = None
    error = None
    if comm.rank == 0:
        try:
            path = _write_state(state, getattr(engine.module, "config", None), Path(save_dir), save_filename)
        except Exception as exc:
            error = f"save_16bit_model failed on rank 0: {type(exc).__name__}: {exc}"
    from .meta import agree

    agree(comm, error)
    return path


def model_config_of(module: torch.nn.Module) -> dict[str, Any] | None:
    """An HF model's ``config.to_dict()`` (what ``config.json`` holds), stored in a checkpoint's
    meta.json so `export_checkpoint` can write an HF folder without the model; None otherwise."""
    config = getattr(module, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not (callable(to_dict) and hasattr(config, "save_pretrained")):
        return None
    try:
        import json

        value = to_dict()
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_checkpoint(checkpoint_dir, out_dir, *, tag: Any = None, dtype: str = "fp32",
                      save_filename: str = "model.safetensors") -> str:
    """DeepSpeed's ``zero_to_fp32`` job, for any tachyon checkpoint (any ZeRO stage, world size
    or (dp, pp, tp) layout), in one process on the CPU: the consolidated weights
    (`export_model_state_dict`, cast to ``dtype``: "fp32", "bf16" or "fp16"; integer tensors stay
    as they are) written to ``out_dir/save_filename`` (safetensors with transformers' metadata,
    tied weights once; other names with torch.save), plus ``config.json`` when the checkpoint
    was saved from an HF model, so ``from_pretrained(out_dir)`` loads the folder. The file is
    written under a temporary name and renamed. Returns its path."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
    if not isinstance(save_filename, str) or not save_filename or "/" in save_filename:
        raise ValueError(f"save_filename={save_filename!r} should be a file name such as 'model.safetensors'")
    ckpt = resolve_checkpoint(checkpoint_dir, tag)
    state = export_model_state_dict(ckpt)
    meta = parse_meta((ckpt / mf.META).read_text(), ckpt / mf.META)
    cast = EXPORT_DTYPES[dtype]
    state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    out_dir = Path(out_dir)
    path = _write_state(state, None, out_dir, save_filename)
    config = meta.get("model_config")
    if isinstance(config, dict):
        import json

        config = dict(config, torch_dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
        tmp = out_dir / f"{mf.TMP_PREFIX}config.json.{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out_dir / "config.json")
    return path


def _write_state(state: dict[str, torch.Tensor], config: object, save_dir: Path, save_filename: str) -> str:
    save_dir.mkdir(parents=True, exist_ok=True)
    # tensors only: a non-tensor _extra_state cannot go into safetensors (tachyon.nn's FP8 state is
    # a uint8 tensor, kept), and a weights file is loaded with strict=False or by name
    state = _unique_views({k: v for k, v in state.items() if torch.is_tensor(v)})
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    target = save_dir / save_filename
    tmp = save_dir / f"{mf.TMP_PREFIX}{save_filename}.{secrets.token_hex(4)}"
    if save_filename.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, target)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(save_dir))
    return str(target)
