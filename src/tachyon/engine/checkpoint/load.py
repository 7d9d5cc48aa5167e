"""engine.load_checkpoint: validate everywhere, agree, read into fresh tensors, agree, commit.

Protocol (all ranks call it; either every rank loads or none changes anything):

1. resolve the tag (``latest`` when none is given; no ``latest``: nothing to load, returns
   ``(None, None)`` like DeepSpeed) and check that every rank uses the same one;
2. every rank checks the manifest, the presence and size of every file listed, and the sha256
   of its share of the files (the ranks together hash every file once), then reads meta.json,
   checks that every key a load reads is there with its type (`meta.check_meta_schema`) and
   that it fits the engine (parameter names and shapes, optimizer class, groups, the precision
   state, loaded into a copy of the engine's precision); the ranks exchange their results and
   all raise the same CheckpointError if any failed;
3. every rank reads the pieces of its (new) partition with torch.distributed.checkpoint into
   fresh tensors, plus the client state, scheduler state and its RNG states, and loads the
   scheduler and MoQ states into copies of the engine's; results are exchanged again;
4. only then the engine is changed: masters, optimizer states, model weights (all-gathered),
   frozen parameters and buffers, loss scale, scheduler, step counters, the MoQ schedule (then
   the model's linear weights are snapped again), RNG states. The optimizer's hyperparameters
   stay the engine's (its config's: weight decay, betas, eps, adam_w_mode, ...), each
   difference from the checkpoint's logged on rank 0; the values the lr scheduler drives (lr;
   OneCycle's momentum) follow the checkpoint when its scheduler state is loaded.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from . import manifest as mf
from .meta import agree, check_compatible, gather, parse_meta, restore_options, validate_tags
from .save import check_storage_config
from tachyon.engine.onebit_hooks import load_error_feedback

from .state import commit, load_targets, param_names, set_rng_state

logger = logging.getLogger("tachyon.checkpoint")


def load_checkpoint(
    engine,
    load_dir,
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Any = None,
) -> tuple[str | None, dict | None]:
    """Load a checkpoint written by `save_checkpoint` with any world size and ZeRO stage
    (DeepSpeed's arguments, in DeepSpeed's order).

    Args:
        load_dir: the checkpoint root given to save_checkpoint.
        tag: the checkpoint to load (default: the one ``load_dir/latest`` names).
        load_module_strict: every trained parameter and model state of the engine must be in the
            checkpoint and the reverse (False: those missing on either side are skipped; the
            model keeps its own values for them).
        load_optimizer_states: restore optimizer states (False: keep this engine's optimizer as
            it is, e.g. fresh). The engine's hyperparameters (weight decay, betas, eps,
            adam_w_mode, ...: its config's) are kept and every difference from the checkpoint's
            is logged; the lr (and OneCycle's momentum) follows the restored lr schedule.
        load_lr_scheduler_states: restore the lr scheduler.
        load_module_only: restore the weights only (no optimizer, scheduler, loss scale,
            counters or RNG states), as DeepSpeed: the fp32 masters are the loaded weights.
        custom_load_fn: DeepSpeed's hook; refused (a tachyon checkpoint is read through
            torch.distributed.checkpoint, never as one module state_dict).

    Returns ``(checkpoint directory, client_state)``, or ``(None, None)`` when no tag was given
    and ``load_dir`` has no ``latest`` (or does not exist), with a warning on rank 0, like
    DeepSpeed. Raises CheckpointError (the same on every rank, naming the file) for a missing,
    incomplete, corrupted or mismatching checkpoint; the engine is then unchanged on every rank:
    the manifest, every file's checksum, meta.json's keys, the shapes, the optimizer type, the
    precision state, the scheduler state and the RNG states are all checked before anything
    changes.
    """
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint(custom_load_fn=...) is not supported: tachyon reads a checkpoint's pieces "
                         "through torch.distributed.checkpoint, never as one module state_dict; load "
                         "tachyon.engine.checkpoint.export_model_state_dict(load_dir) into the module yourself instead")
    from .state import settle_sharded

    settle_sharded(engine)
    comm = engine.world_comm
    rank, world = comm.rank, comm.world_size
    check_storage_config(engine)
    load_dir = Path(load_dir)
    if tag is None:
        latest_error, latest = None, None
        try:
            latest = mf.read_latest(load_dir)
        except mf.CheckpointError as error:
            latest_error = str(error)
        agree(comm, latest_error)
        if not any(gather(comm, latest is not None)):
            if rank == 0:
                reason = "does not exist" if not load_dir.exists() else f"has no {mf.LATEST!r} file"
                message = f"load_checkpoint: {load_dir} {reason}; nothing loaded, returning (None, None)"
                logger.warning(message)
                warnings.warn(message, UserWarning, stacklevel=3)
            return None, None
        tag = latest
    elif isinstance(tag, int) and not isinstance(tag, bool):
        tag = str(tag)
    tag = validate_tags(comm, tag, engine.config.checkpoint.tag_validation, "load")
    mf.check_tag(tag)
    ckpt = load_dir / tag
    load_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None

    # 2. validate, on every rank, before anything changes
    meta, error = None, None
    all_names = set().union(*gather(comm, param_names(engine)))
    try:
        manifest = mf.read_manifest(ckpt)
        error = mf.verify_files(ckpt, manifest, rank, world)
        if error is None:
            meta = parse_meta((ckpt / mf.META).read_text(), ckpt / mf.META)
            check_compatible(
                engine, meta, optimizer=load_optimizer_states, module_only=load_module_only, where=str(ckpt),
                all_names=all_names, strict=load_module_strict,
            )
            if not load_module_only and meta["precision"] == engine.precision.name:
                _try(lambda: copy.deepcopy(engine.precision).load_state_dict(meta["precision_state"]),
                     f"{ckpt / mf.META}: precision_state does not fit this engine's {engine.precision.name} precision")
    except (mf.CheckpointError, OSError, KeyError, TypeError, ValueError) as exc:
        error = str(exc) if isinstance(exc, mf.CheckpointError) else f"{ckpt}: {type(exc).__name__}: {exc}"
    agree(comm, error)

    # 3. read into fresh tensors, and check what will be restored on copies
    targets, extra, rng, error = None, None, None, None
    try:
        targets = load_targets(engine, meta, optimizer=load_optimizer_states, module_only=load_module_only)
        with mf.quiet_dcp():
            dcp.load(
                targets.dcp_state,
                storage_reader=mf.SafeFileSystemReader(str(ckpt / mf.STATE_DIR)),
                planner=mf.TensorsOnlyLoadPlanner(),
                process_group=comm.group if comm.enabled else None,
                no_dist=not comm.enabled,
            )
        extra = mf.torch_load_safe(ckpt / mf.EXTRA)
        if not isinstance(extra, dict):
            raise mf.CheckpointError(f"{ckpt / mf.EXTRA} holds a {type(extra).__name__}, not the expected dict")
        rng_path = ckpt / mf.rng_file(rank)
        if not load_module_only and rng_path.is_file():
            rng = mf.torch_load_safe(rng_path)
        if not load_module_only:
            _check_training_state(engine, meta, extra, rng, load_lr_scheduler_states, ckpt)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        error = f"reading {ckpt} failed on rank {rank}: {type(exc).__name__}: {exc}"
    agree(comm, error)

    # 4. commit (no failure expected past this point: in-memory copies and one all-gather)
    commit(engine, meta, targets, optimizer=load_optimizer)
    scheduler_restored = (not load_module_only and load_lr_scheduler_states and engine.lr_scheduler is not None
                          and extra.get("lr_scheduler") is not None)
    if load_optimizer:
        kept = restore_options(engine, meta, scheduler_restored=scheduler_restored)
        if kept and rank == 0:
            logger.warning("load_checkpoint: %s: the engine's optimizer settings differ from the checkpoint's and are "
                           "kept (the config wins): %s", ckpt, "; ".join(kept))
        load_error_feedback(engine.optimizer, (rng or {}).get("onebit_error_feedback"))
    if not load_module_only:
        _restore_training_state(engine, meta, extra, rng, load_lr_scheduler_states, rank)
    quantizer = getattr(engine, "quantizer", None)
    if quantizer is not None:  # the masters are in the model unsnapped: snap them for the (restored) schedule
        quantizer.after_load()
    return str(ckpt), extra.get("client_state")


def _try(fn, what: str) -> None:
    try:
        fn()
    except Exception as exc:
        raise mf.CheckpointError(f"{what} ({type(exc).__name__}: {exc}); nothing was changed") from None


def _check_training_state(engine, meta: dict, extra: dict, rng: Any, load_scheduler: bool, ckpt: Path) -> None:
    """What `_restore_training_state` will load, loaded first into copies (CheckpointError otherwise)."""
    scheduler_state = extra.get("lr_scheduler")
    if load_scheduler and engine.lr_scheduler is not None and scheduler_state is not None:
        _try(lambda: copy.copy(engine.lr_scheduler).load_state_dict(scheduler_state),
             f"{ckpt / mf.EXTRA}: the lr scheduler state does not fit this engine's {type(engine.lr_scheduler).__name__}")
    quantizer, moq_state = getattr(engine, "quantizer", None), meta.get("quantize_training")
    if quantizer is not None and moq_state is not None:
        _try(lambda: copy.copy(quantizer).load_state_dict(moq_state),
             f"{ckpt / mf.META}: quantize_training does not fit this engine's MoQ schedule")
    if rng is not None and not (isinstance(rng, dict) and torch.is_tensor(rng.get("torch_cpu"))
                                and isinstance(rng.get("python"), (list, tuple)) and len(rng["python"]) == 3):
        raise mf.CheckpointError(f"{ckpt}: the RNG state of rank {engine.world_comm.rank} is malformed")
    shared = (rng or {}).get("pld_shared_cpu")
    if shared is not None and not (torch.is_tensor(shared) and shared.dtype == torch.uint8
                                   and shared.shape == torch.get_rng_state().shape):
        raise mf.CheckpointError(f"{ckpt}: the shared progressive-layer-drop generator state of rank "
                                 f"{engine.world_comm.rank} is malformed")


def _restore_training_state(engine, meta: dict, extra: Any, rng: Any, load_scheduler: bool, rank: int) -> None:
    if meta["precision"] == engine.precision.name:
        engine.precision.load_state_dict(meta["precision_state"])
    elif rank == 0:
        logger.warning(
            "load_checkpoint: the checkpoint was saved with %s, this engine trains in %s: loss-scale state not loaded",
            meta["precision"], engine.precision.name,
        )
    scheduler_state = extra.get("lr_scheduler") if isinstance(extra, dict) else None
    if load_scheduler and engine.lr_scheduler is not None and scheduler_state is not None:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    quantizer, moq_state = getattr(engine, "quantizer", None), meta.get("quantize_training")
    if quantizer is not None and moq_state is not None:
        quantizer.load_state_dict(moq_state)
    engine.global_steps = int(meta["global_steps"])
    engine.skipped_steps = int(meta["skipped_steps"])
    if meta["gradient_accumulation_steps"] == engine.gradient_accumulation_steps():
        engine.micro_steps = int(meta["micro_steps"])
    else:  # another world size with the same global batch: boundaries follow this run's gas
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if rng is not None:
        set_rng_state(rng)
    else:  # more ranks now than when saved: the new ranks keep their generators
        logger.warning("load_checkpoint: no RNG state for rank %d (saved with %d ranks); its RNG is unchanged",
                       rank, meta["world_size"])
    if getattr(engine, "pld_draws", None) is not None:  # stage 3 with PLD: rank 0's saved keep-draw stream
        engine.pld_draws.load_state_dict((rng or {}).get("pld_shared_cpu"))
