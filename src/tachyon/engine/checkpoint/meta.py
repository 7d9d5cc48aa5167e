"""meta.json (what a checkpoint holds besides tensors), client-state checks, rank agreement.

meta.json is plain JSON written by rank 0: step counters, precision and ZeRO settings of the
run that saved, the MoQ schedule state (``quantize_training``: steps, bits, period, real_ratio;
null without MoQ), its (dp, pp, tp) layout, the trained-parameter table (name, full shape, group)
and the ``module.state_dict()`` key map (both merged over every rank: a pipeline rank knows its
own stage only), and per optimizer param group its hyperparameters and which state keys exist.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from .manifest import FORMAT, VERSION, CheckpointError
from .state import dtype_name, flat_state_keys, full_shape, is_extra_state, model_state_keys, param_names

logger = logging.getLogger("tachyon.checkpoint")

_SKIPPED_OPTIONS = ("params", "segments", "num_segments")


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists, or TypeError when it is not JSON data."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def _restore_float(value: Any) -> Any:
    return float(value) if value in ("inf", "-inf", "nan") else value


def local_tables(engine) -> dict[str, Any]:
    """This rank's part of meta.json's parameter table and state_dict key map (full shapes)."""
    params = [
        {"name": n, "shape": full_shape(s.param), "numel": math.prod(full_shape(s.param)), "group": s.group,
         "dtype": dtype_name(s.param.dtype)}
        for n, s in zip(param_names(engine), engine.zero.flat.slots)
    ]
    return {"params": params, "model_keys": model_state_keys(engine)}


def _merge(tables: list[dict[str, Any]]) -> tuple[list[dict], dict[str, dict]]:
    params: dict[str, dict] = {}
    keys: dict[str, dict] = {}
    for table in tables:
        for entry in table["params"]:
            seen = params.setdefault(entry["name"], entry)
            if seen["shape"] != entry["shape"]:
                raise ValueError(f"ranks disagree on the full shape of {entry['name']!r}: {seen['shape']} vs {entry['shape']}")
        for key, entry in table["model_keys"].items():
            keys.setdefault(key, entry)
    return list(params.values()), keys


def model_config_of(module: Any) -> dict[str, Any] | None:
    from .export import model_config_of as of

    return of(module)


def build_meta(engine, tag: str, world_size: int, tables: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """meta.json's content for ``engine`` now; ``tables``: every rank's `local_tables` (default:
    this rank's only)."""
    optimizer = engine.optimizer
    groups = []
    for g in range(len(engine.zero.flat.regions)):
        masters = engine.zero.group_masters(g)
        flat, other, values = flat_state_keys(optimizer, masters[0]) if masters else ({}, {}, {})
        options = {}
        if optimizer is not None:
            for key, value in optimizer.param_groups[g].items():
                if key in _SKIPPED_OPTIONS:
                    continue
                try:
                    options[key] = _jsonable(value)
                except TypeError as error:
                    logger.warning("checkpoint: optimizer option %r of group %d (a %s) is not saved", key, g, error)
        try:
            values = _jsonable(values)
        except TypeError as error:
            raise ValueError(f"optimizer state of group {g} holds a {error}, which a checkpoint cannot store") from None
        groups.append({"options": options, "flat": flat, "other": other, "values": values})
    params, model_keys = _merge(tables if tables is not None else [local_tables(engine)])
    precision = _jsonable(engine.precision.state_dict())
    mesh = engine.mesh
    layout = {axis: (mesh.size(axis) if mesh is not None else 1) for axis in ("dp", "pp", "tp")}
    layout["dp"] = engine.comm.world_size
    quantizer = getattr(engine, "quantizer", None)
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "world_size": world_size,
        "layout": layout,
        "zero_stage": engine.zero.stage,
        "precision": engine.precision.name,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "precision_state": precision,
        "params": params,
        "model_keys": model_keys,
        "optimizer": {
            "class": type(optimizer).__name__ if optimizer is not None else None,
            "groups": groups,
        },
        "has_scheduler": engine.lr_scheduler is not None,
        "quantize_training": _jsonable(quantizer.state_dict()) if quantizer is not None else None,
        "model_config": model_config_of(engine.module),
    }


_INT, _STR, _DICT, _LIST, _BOOL = int, str, dict, list, bool
_META_KEYS: dict[str, Any] = {
    "version": _INT, "tag": _STR, "world_size": _INT, "zero_stage": _INT, "precision": _STR,
    "gradient_accumulation_steps": _INT, "global_steps": _INT, "micro_steps": _INT, "skipped_steps": _INT,
    "precision_state": _DICT, "params": _LIST, "model_keys": _DICT, "optimizer": _DICT, "has_scheduler": _BOOL,
}
"""meta.json's keys a load reads, and their JSON types (checked before anything changes)."""


def parse_meta(text: str, path) -> dict[str, Any]:
    """meta.json parsed, with every key a load reads present and of the right type (CheckpointError
    naming the file and the key otherwise): a load reads nothing it has not checked."""
    try:
        meta = json.loads(text)
    except ValueError as error:
        raise CheckpointError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not tachyon checkpoint metadata")
    check_meta_schema(meta, path)
    return meta


def _bad(path, key: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {key} {what}; the file does not describe a checkpoint this tachyon can load "
                           "(nothing was changed)")


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def check_meta_schema(meta: dict, path) -> None:
    """CheckpointError unless every key `load_checkpoint` reads is in ``meta`` with its type."""
    for key, kind in _META_KEYS.items():
        if key not in meta:
            raise _bad(path, f"key {key!r}", "is missing")
        if not _is(meta[key], kind):
            raise _bad(path, f"key {key!r}", f"should be a JSON {kind.__name__}; got {type(meta[key]).__name__}")
    for i, entry in enumerate(meta["params"]):
        if not (isinstance(entry, dict) and _is(entry.get("name"), str) and _is(entry.get("group"), int)
                and isinstance(entry.get("shape"), list) and all(_is(d, int) for d in entry["shape"])):
            raise _bad(path, f"params[{i}]", "should be {\"name\": str, \"shape\": [int], \"group\": int, ...}")
    for key, entry in meta["model_keys"].items():
        if not isinstance(entry, dict) or entry.get("source") not in ("master", "model"):
            raise _bad(path, f"model_keys[{key!r}]", "should have a source of 'master' or 'model'")
        if entry["source"] == "model" and not (isinstance(entry.get("shape"), list) and _is(entry.get("dtype"), str)):
            raise _bad(path, f"model_keys[{key!r}]", "should have a shape and a dtype")
    optimizer = meta["optimizer"]
    if not (optimizer.get("class") is None or _is(optimizer.get("class"), str)) or not isinstance(optimizer.get("groups"), list):
        raise _bad(path, "optimizer", "should be {\"class\": str or null, \"groups\": [...]}")
    for g, group in enumerate(optimizer["groups"]):
        if not isinstance(group, dict) or not all(isinstance(group.get(k), dict) for k in ("options", "flat", "other", "values")):
            raise _bad(path, f"optimizer.groups[{g}]", "should hold the dicts options, flat, other and values")
        for key, spec in group["other"].items():
            if not (isinstance(spec, dict) and isinstance(spec.get("shape"), list) and _is(spec.get("dtype"), str)):
                raise _bad(path, f"optimizer.groups[{g}].other[{key!r}]", "should have a shape and a dtype")
    if meta.get("quantize_training") is not None and not isinstance(meta["quantize_training"], dict):
        raise _bad(path, "key 'quantize_training'", "should be a JSON object or null")


def check_compatible(engine, meta: dict, *, optimizer: bool, module_only: bool, where,
                     all_names: set[str] | None = None, strict: bool = True) -> None:
    """CheckpointError when the checkpoint's parameters (or, when loading them, optimizer
    states) do not fit ``engine``. ``all_names``: the trained parameters of every rank (a
    pipeline rank holds its stage only; default: this rank's). ``strict`` False (DeepSpeed's
    ``load_module_strict``): parameters and model states missing on either side are allowed
    (the model keeps its own values for those the checkpoint lacks); shapes must still match.
    Runs before any state changes."""
    saved = {p["name"]: p for p in meta["params"]}
    names = param_names(engine)
    everyone = set(names) if all_names is None else all_names
    missing = [n for n in names if n not in saved]
    unexpected = [n for n in saved if n not in everyone]
    if (missing or unexpected) and strict:
        raise CheckpointError(
            f"{where} does not match the model's trained parameters: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, slot in zip(names, engine.zero.flat.slots):
        if name in saved and saved[name]["shape"] != full_shape(slot.param):
            raise CheckpointError(
                f"{where}: parameter {name!r} has shape {tuple(saved[name]['shape'])} in the checkpoint and "
                f"{tuple(full_shape(slot.param))} in the model"
            )
    current_keys = model_state_keys(engine)
    left_out = bool(meta.get("exclude_frozen_parameters"))
    for key, entry in current_keys.items():
        if entry["source"] == "model" and is_extra_state(key):
            continue  # checked by the module's set_extra_state; absent from checkpoints that predate it
        if entry["source"] == "model":
            other = meta["model_keys"].get(key)
            if other is None and (not strict or (left_out and entry.get("parameter"))):
                continue  # the model keeps its own value
            if other is None or other["source"] != "model" or other["shape"] != entry["shape"]:
                raise CheckpointError(f"{where}: model state {key!r} (shape {tuple(entry['shape'])}) is not in the checkpoint")
    if not optimizer or module_only or engine.optimizer is None:
        return
    groups = meta["optimizer"]["groups"]
    if meta["optimizer"]["class"] != type(engine.optimizer).__name__:
        raise CheckpointError(
            f"{where} holds {meta['optimizer']['class']} state; this engine's optimizer is "
            f"{type(engine.optimizer).__name__} (pass load_optimizer_states=False to load only the weights)"
        )
    if len(groups) != len(engine.zero.flat.regions):
        raise CheckpointError(f"{where} has {len(groups)} optimizer param groups; this engine has "
                              f"{len(engine.zero.flat.regions)}")
    for name, slot in zip(names, engine.zero.flat.slots):
        if name in saved and saved[name]["group"] != slot.group:
            raise CheckpointError(f"{where}: parameter {name!r} is in param group {saved[name]['group']} in the checkpoint, {slot.group} here")


SCHEDULED_OPTIONS = ("lr", "initial_lr")
"""Param-group keys an lr scheduler drives: restored with the scheduler's state."""


def scheduled_options(engine) -> tuple[str, ...]:
    """The param-group keys the engine's lr scheduler sets (OneCycle's cycled momentum too)."""
    keys = SCHEDULED_OPTIONS
    if getattr(engine.lr_scheduler, "cycle_momentum", False):
        keys += ("betas", "momentum")
    return keys


def _same(a: Any, b: Any) -> bool:
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return norm(a) == norm(b)


def restore_options(engine, meta: dict, *, scheduler_restored: bool) -> list[str]:
    """The optimizer's hyperparameters after a load: the engine's own (from its config or the
    optimizer it was given) win over the checkpoint's, except the values the lr scheduler drives
    (lr, and OneCycle's momentum), which follow the checkpoint when ``scheduler_restored`` (the
    scheduler's state was loaded with it). Keys only the checkpoint has (e.g. a torch scheduler's
    ``initial_lr``) are restored. Returns every difference kept, as "group g: key saved -> now"."""
    driven = scheduled_options(engine) if scheduler_restored else ()
    differences = []
    for g, (group, saved) in enumerate(zip(engine.optimizer.param_groups, meta["optimizer"]["groups"])):
        for key, value in saved["options"].items():
            value = _restore_float(value)
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                value = tuple(value)
            if key not in group or key in driven:
                group[key] = value
            elif not _same(group[key], value):
                differences.append(f"group {g}: {key} {value!r} (checkpoint) -> {group[key]!r} (kept)")
    return differences


def check_client_state(value: Any, path: str = "client_state") -> None:
    """ValueError naming the first entry of ``client_state`` that is neither JSON data
    (dict with str keys, list, tuple, str, int, float, bool, None) nor a tensor."""
    if value is None or isinstance(value, (bool, int, float, str)) or torch.is_tensor(value):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path} has a key {key!r} of type {type(key).__name__}; keys must be str")
            check_client_state(item, f"{path}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_client_state(item, f"{path}[{i}]")
        return
    raise ValueError(
        f"{path} is a {type(value).__name__}; checkpoints store only JSON data (dict, list, str, int, float, "
        "bool, None) and tensors, so they can be loaded without unpickling code"
    )


# ---------------------------------------------------------------------- ranks
def gather(comm, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (all ranks call this), in rank order."""
    if not comm.enabled:
        return [obj]
    out: list[Any] = [None] * comm.world_size
    dist.all_gather_object(out, obj, group=comm.group)
    return out


def agree(comm, error: str | None) -> None:
    """Raise the same CheckpointError on every rank when any rank reports an error (ranks
    reporting the same message are listed together)."""
    errors = gather(comm, error)
    if not any(e is not None for e in errors):
        return
    if len(errors) == 1:
        raise CheckpointError(errors[0])
    by_message: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e is not None:
            by_message.setdefault(e, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in by_message.items()]
    raise CheckpointError("; ".join(parts[:4]) + (f" (and {len(parts) - 4} more)" if len(parts) > 4 else ""))


def validate_tags(comm, tag: str | None, mode: str, action: str) -> str | None:
    """checkpoint.tag_validation: every rank must use the same tag. Fail raises ValueError on
    every rank; Warn logs and Ignore stays silent, and both then use rank 0's tag (ranks
    writing different directories would leave no complete checkpoint)."""
    if not comm.enabled:
        return tag
    tags = gather(comm, tag)
    if len(set(tags)) > 1:
        message = f"checkpoint {action}: ranks use different tags {tags} (checkpoint.tag_validation={mode})"
        if mode == "Fail":
            raise ValueError(message)
        if mode == "Warn" and comm.rank == 0:
            logger.warning(message + f"; using rank 0's tag {tags[0]!r}")
    return tags[0]
