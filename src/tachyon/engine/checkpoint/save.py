"""engine.save_checkpoint: every rank writes its pieces into a temporary directory, rank 0
writes the manifest last and renames the directory into place, then updates ``latest``.

Protocol (all ranks call it; every failure is raised on every rank):

1. agree on the tag (``checkpoint.tag_validation``) and check ``client_state``;
2. rank 0 removes leftovers of killed saves and creates ``<save_dir>/.tmp.<tag>.<nonce>``;
3. every rank writes its shards with torch.distributed.checkpoint (``state/``) and its RNG
   states (``rng/rank_<r>.pt``); rank 0 writes ``meta.json`` and ``extra_state.pt``; each rank
   fsyncs and hashes (sha256) the files it wrote;
4. the hashes are gathered to rank 0, which writes ``manifest.json`` (so it exists only once
   every rank finished), renames the directory to ``<save_dir>/<tag>`` and then rewrites
   ``<save_dir>/latest``, each step fsynced.

A save killed anywhere before the rename leaves a ``.tmp.*`` directory nobody loads (and the
next save deletes); killed after it, the checkpoint is complete and ``latest`` names either it
or the previous one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tachyon.engine.onebit_hooks import error_feedback_state, stage_pending_errors

from . import manifest as mf
from .boxes import boxes_save_planner
from .meta import build_meta, check_client_state, gather, local_tables, validate_tags
from .state import rng_state, save_state_dict

_PAUSE_HOOK = None
"""Tests only: a callable(stage: str) run on every rank at 'written' (all files of this rank
are on disk, no manifest yet), 'manifest' (rank 0: manifest written, not yet renamed) and
'latest' (rank 0: renamed into place, ``latest`` not yet rewritten)."""


def _hook(stage: str) -> None:
    if _PAUSE_HOOK is not None:
        _PAUSE_HOOK(stage)


def check_storage_config(engine) -> None:
    """``checkpoint.use_node_local_storage`` works when every rank is on one node (the local
    disk is then the shared one); across nodes it is refused: the resharding protocol needs
    one directory every rank can read."""
    comm = engine.world_comm
    if not engine.config.checkpoint.use_node_local_storage or not comm.enabled:
        return
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or int(local) != comm.world_size:
        raise ValueError(
            "checkpoint.use_node_local_storage: true is supported only when all ranks run on one node "
            f"(LOCAL_WORLD_SIZE={local!r}, world size {comm.world_size}); tachyon checkpoints are resharded "
            "on load, which needs a directory every rank can read: set it to false and use shared storage"
        )


def _nonfinite_state(engine) -> str | None:
    """What of this rank's master weights and optimizer states holds an inf or nan (None: all finite)."""
    from tachyon.engine.nonfinite import first_nonfinite_slot, slot_name

    zero, optimizer = engine.zero, engine.optimizer
    candidates = [("master weight", list(zero.masters))]
    if optimizer is not None:
        keys = sorted({k for m in zero.masters for k, v in optimizer.state.get(m, {}).items()
                       if torch.is_tensor(v) and v.shape == m.shape})
        for key in keys:
            flats = [optimizer.state.get(m, {}).get(key) for m in zero.masters]
            candidates.append((f"optimizer state {key!r}", [f if f is not None else torch.zeros_like(m)
                                                               for f, m in zip(flats, zero.masters)]))
    for what, flats in candidates:
        if all(bool(torch.isfinite(f).all()) for f in flats):
            continue
        found = first_nonfinite_slot(zero, [f.float() if f.is_floating_point() else f for f in flats])
        name = slot_name(zero, engine.module, found) if found is not None else "a padding element"
        return f"the {what} of {name} holds an inf or nan"
    return None


def describe_dcp_failure(error: BaseException, state_dir: Path) -> str:
    """One line per failing rank of a torch.distributed.checkpoint CheckpointException: the rank,
    its shard files and the OS cause (errno and message), without DCP's tracebacks."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(error).__name__}: {error}"
    parts = []
    for rank, wrapped in sorted(failures.items()):
        cause = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        filename = getattr(cause, "filename", None)
        where = filename if filename else f"{state_dir}/__{rank}_*.distcp"
        parts.append(f"rank {rank} could not write {where}: {_os_cause(cause)}")
    return "; ".join(parts)


UNCHANGED = "the previous checkpoints and `latest` are unchanged"


def _failed(comm, error: str | None, tmp: Path | None, rank: int, prefix: str, suffix: str = UNCHANGED) -> None:
    """Agree on ``error`` over the ranks; on any failure rank 0 removes the unfinished ``tmp``
    directory (its space is freed at once) and every rank raises the same CheckpointError:
    "<prefix>: <each rank's error>; <suffix>"."""
    errors = gather(comm, error)
    if not any(e is not None for e in errors):
        return
    if rank == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    by_message: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e is not None:
            by_message.setdefault(e, []).append(r)
    # a message that names its rank(s) already (DCP reports every rank's failure on every rank) stays as it is
    parts = [e if e.startswith("rank ") else f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}"
             for e, rs in by_message.items()]
    listed = "; ".join(parts[:4]) + (f" (and {len(parts) - 4} more)" if len(parts) > 4 else "")
    raise mf.CheckpointError(f"{prefix}: {listed}; {suffix}")


def save_checkpoint(engine, save_dir, tag: Any = None, client_state: Any = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Save ``engine``'s full training state to ``save_dir/<tag>`` (see the module docstring).

    Args:
        save_dir: the checkpoint root (created); ``latest`` lives there.
        tag: the checkpoint's directory name (default ``global_step<global_steps>``).
        client_state: JSON data and tensors to store with it (returned by load_checkpoint);
            anything else is refused with ValueError before anything is written.
        save_latest: point ``latest`` at this checkpoint.
        exclude_frozen_parameters: DeepSpeed's flag: do not write frozen parameters (a load then
            keeps the model's own values for them).

    Returns True (DeepSpeed's return value). Every rank must call this (all ranks of the job:
    with tensor or pipeline parallelism each holds a different part of the model). Every failure
    is a CheckpointError raised on every rank, naming the rank, the file and the OS cause; the
    previous checkpoints and ``latest`` are then unchanged (unless only ``latest`` failed, which
    the message says). A model or optimizer state holding an inf or nan is refused before
    anything is written, unless ``checkpoint.allow_nonfinite`` is set.
    """
    from .state import settle_sharded

    settle_sharded(engine)
    comm = engine.world_comm
    rank, world = comm.rank, comm.world_size
    check_storage_config(engine)
    if tag is None:
        tag = f"global_step{engine.global_steps}"
    if isinstance(tag, int) and not isinstance(tag, bool):
        tag = str(tag)
    tag = validate_tags(comm, tag, engine.config.checkpoint.tag_validation, "save")
    mf.check_tag(tag)
    save_dir = Path(save_dir)
    final = save_dir / tag
    what = f"saving checkpoint {final} (step {engine.global_steps}) failed"
    client_state = {} if client_state is None else client_state
    scheduler_state = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    local_error = None
    try:
        check_client_state(client_state)
        check_client_state(scheduler_state, "lr_scheduler.state_dict()")
    except ValueError as error:
        local_error = str(error)
    errors = gather(comm, local_error)
    if any(errors):
        raise ValueError(next(e for e in errors if e))
    if not engine.config.checkpoint.allow_nonfinite:
        bad = _nonfinite_state(engine)
        _failed(comm, None if bad is None else f"rank {rank}: {bad}", None, rank,
                f"refusing to save checkpoint {final} (step {engine.global_steps})",
                "nothing was written and `latest` is unchanged (set checkpoint.allow_nonfinite to save it anyway)")

    prepared: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        tmp = save_dir / f"{mf.TMP_PREFIX}{tag}.{secrets.token_hex(4)}"
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            mf.remove_stale(save_dir)
            (tmp / mf.STATE_DIR).mkdir(parents=True)
            (tmp / mf.RNG_DIR).mkdir()
            prepared = (None, str(tmp))
        except OSError as error:
            prepared = (f"rank 0 could not create {error.filename or tmp}: {_os_cause(error)}", None)
    error, tmp_name = gather(comm, prepared)[0]
    if error:
        raise mf.CheckpointError(f"{what}: {error}; {UNCHANGED}")
    tmp = Path(tmp_name)

    # 1-bit optimizers: the layout-free pending compression error goes into the optimizer state,
    # written and resharded like the moments (collective over the data-parallel group)
    stage_pending_errors(engine.optimizer)
    meta = build_meta(engine, tag, world, gather(comm, local_tables(engine)))
    if exclude_frozen_parameters:
        meta["exclude_frozen_parameters"] = True
        meta["model_keys"] = {k: v for k, v in meta["model_keys"].items() if not v.get("parameter")}
    state = save_state_dict(engine, meta["optimizer"]["groups"], exclude_frozen=exclude_frozen_parameters)
    local_error = None
    try:
        with mf.quiet_dcp():
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(tmp / mf.STATE_DIR), sync_files=True),
                planner=boxes_save_planner(),
                process_group=comm.group if comm.enabled else None,
                no_dist=not comm.enabled,
            )
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        local_error = describe_dcp_failure(exc, tmp / mf.STATE_DIR) if isinstance(exc, CheckpointException) \
            else f"rank {rank} could not write its shards in {tmp / mf.STATE_DIR}: {_os_cause(exc)}"
    _failed(comm, local_error, tmp, rank, what)
    written: dict[str, dict[str, Any]] = {}
    local_error = None
    current = None
    try:
        state = rng_state()
        draws = getattr(engine, "pld_draws", None)  # stage 3 with PLD: the keep draws' shared generator
        if draws is not None and draws.state is not None:
            state["pld_shared_cpu"] = draws.state_dict()
        errors = error_feedback_state(engine.optimizer)
        if errors is not None:
            state["onebit_error_feedback"] = errors
        current = tmp / mf.rng_file(rank)
        mf.torch_save_synced(state, current)
        mine = [mf.rng_file(rank)]
        mine += [f"{mf.STATE_DIR}/{p.name}" for p in (tmp / mf.STATE_DIR).glob(f"__{rank}_*")]
        if rank == 0:
            extra = {"client_state": client_state, "lr_scheduler": scheduler_state}
            current = tmp / mf.EXTRA
            mf.torch_save_synced(extra, current)
            current = tmp / mf.META
            mf.write_atomic(current, json.dumps(meta, indent=1).encode())
            mine += [mf.EXTRA, mf.META, f"{mf.STATE_DIR}/.metadata"]
        _hook("written")
        current = None
        written = mf.describe_files(tmp, mine)
    except Exception as exc:  # reported on every rank below
        local_error = f"rank {rank} could not write {getattr(exc, 'filename', None) or current or tmp}: {_os_cause(exc)}"
    reports = gather(comm, (local_error, written))
    _failed(comm, local_error, tmp, rank, what)

    local_error = None
    if rank == 0:
        published = False
        try:
            files: dict[str, dict[str, Any]] = {}
            for _, part in reports:
                files.update(part)
            unlisted = [rel for rel in mf.list_files(tmp) if rel not in files]
            files.update(mf.describe_files(tmp, unlisted))
            current = tmp / mf.MANIFEST
            mf.write_manifest(tmp, tag, world, files)
            _hook("manifest")
            current = final
            mf.publish(tmp, final)
            published = True
            if save_latest:
                current = save_dir / mf.LATEST
                _hook("latest")
                mf.write_latest(save_dir, tag)
        except Exception as exc:
            cause = f"{getattr(exc, 'filename', None) or current}: {_os_cause(exc)}"
            if not published:
                shutil.rmtree(tmp, ignore_errors=True)
                local_error = f"{what}: rank 0 could not publish it ({cause}); {UNCHANGED}"
            else:
                old = _read_latest_quietly(save_dir)
                local_error = (f"checkpoint {final} (step {engine.global_steps}) was saved completely, but rank 0 could "
                               f"not update {save_dir / mf.LATEST} ({cause}); `latest` still names "
                               f"{old!r}: load the new one with load_checkpoint({str(save_dir)!r}, tag={tag!r})")
    errors = gather(comm, local_error)
    if errors[0] is not None:
        raise mf.CheckpointError(errors[0])
    return True


def _os_cause(error: BaseException) -> str:
    """``error`` as its type, errno name and message (e.g. "OSError [ENOSPC]: No space left on device")."""
    import errno as errno_module

    code = getattr(error, "errno", None)
    name = errno_module.errorcode.get(code) if isinstance(code, int) else None
    text = getattr(error, "strerror", None) or str(error)
    return f"{type(error).__name__}{f' [{name}]' if name else ''}: {text}"


def _read_latest_quietly(save_dir: Path) -> str | None:
    try:
        return mf.read_latest(save_dir)
    except (mf.CheckpointError, OSError):
        return None
