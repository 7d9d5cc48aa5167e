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
from pathlib import Path
from typing import Any

from torch.distributed import checkpoint as dcp

from tachyon.engine.onebit_hooks import error_feedback_state, stage_pending_errors

from . import manifest as mf
from .boxes import boxes_save_planner
from .meta import agree, build_meta, check_client_state, gather, local_tables, validate_tags
from .state import rng_state, save_state_dict

_PAUSE_HOOK = None
"""Tests only: a callable(stage: str) run on every rank at 'written' (all files of this rank
are on disk, no manifest yet) and 'manifest' (rank 0: manifest written, not yet renamed)."""


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


def save_checkpoint(engine, save_dir, tag: Any = None, client_state: Any = None, save_latest: bool = True) -> str:
    """Save ``engine``'s full training state to ``save_dir/<tag>`` (see the module docstring).

    Args:
        save_dir: the checkpoint root (created); ``latest`` lives there.
        tag: the checkpoint's directory name (default ``global_step<global_steps>``).
        client_state: JSON data and tensors to store with it (returned by load_checkpoint);
            anything else is refused with ValueError before anything is written.
        save_latest: point ``latest`` at this checkpoint.

    Returns the checkpoint directory. Every rank must call this (all ranks of the job: with
    tensor or pipeline parallelism each holds a different part of the model).
    """
    comm = engine.world_comm
    rank, world = comm.rank, comm.world_size
    check_storage_config(engine)
    if tag is None:
        tag = f"global_step{engine.global_steps}"
    if isinstance(tag, int) and not isinstance(tag, bool):
        tag = str(tag)
    tag = validate_tags(comm, tag, engine.config.checkpoint.tag_validation, "save")
    mf.check_tag(tag)
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

    save_dir = Path(save_dir)
    prepared: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            mf.remove_stale(save_dir)
            tmp = save_dir / f"{mf.TMP_PREFIX}{tag}.{secrets.token_hex(4)}"
            (tmp / mf.STATE_DIR).mkdir(parents=True)
            (tmp / mf.RNG_DIR).mkdir()
            prepared = (None, str(tmp))
        except OSError as error:
            prepared = (f"cannot create the checkpoint directory in {save_dir}: {error}", None)
    error, tmp_name = gather(comm, prepared)[0]
    if error:
        raise mf.CheckpointError(error)
    tmp = Path(tmp_name)

    # 1-bit optimizers: the layout-free pending compression error goes into the optimizer state,
    # written and resharded like the moments (collective over the data-parallel group)
    stage_pending_errors(engine.optimizer)
    meta = build_meta(engine, tag, world, gather(comm, local_tables(engine)))
    state = save_state_dict(engine, meta["optimizer"]["groups"])
    with mf.quiet_dcp():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(str(tmp / mf.STATE_DIR), sync_files=True),
            planner=boxes_save_planner(),
            process_group=comm.group if comm.enabled else None,
            no_dist=not comm.enabled,
        )
    written: dict[str, dict[str, Any]] = {}
    local_error = None
    try:
        state = rng_state()
        errors = error_feedback_state(engine.optimizer)
        if errors is not None:
            state["onebit_error_feedback"] = errors
        mf.torch_save_synced(state, tmp / mf.rng_file(rank))
        mine = [mf.rng_file(rank)]
        mine += [f"{mf.STATE_DIR}/{p.name}" for p in (tmp / mf.STATE_DIR).glob(f"__{rank}_*")]
        if rank == 0:
            extra = {"client_state": client_state, "lr_scheduler": scheduler_state}
            mf.torch_save_synced(extra, tmp / mf.EXTRA)
            mf.write_atomic(tmp / mf.META, json.dumps(meta, indent=1).encode())
            mine += [mf.EXTRA, mf.META, f"{mf.STATE_DIR}/.metadata"]
        _hook("written")
        written = mf.describe_files(tmp, mine)
    except Exception as exc:  # reported on every rank below
        local_error = f"rank {rank} could not write its checkpoint files: {type(exc).__name__}: {exc}"
    reports = gather(comm, (local_error, written))
    agree(comm, local_error)

    final = save_dir / tag
    local_error = None
    if rank == 0:
        try:
            files: dict[str, dict[str, Any]] = {}
            for _, part in reports:
                files.update(part)
            unlisted = [rel for rel in mf.list_files(tmp) if rel not in files]
            files.update(mf.describe_files(tmp, unlisted))
            mf.write_manifest(tmp, tag, world, files)
            _hook("manifest")
            mf.publish(tmp, final)
            if save_latest:
                mf.write_latest(save_dir, tag)
        except Exception as exc:
            local_error = f"rank 0 could not publish {final}: {type(exc).__name__}: {exc}"
    agree(comm, local_error)
    return str(final)
