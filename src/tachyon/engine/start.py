"""`tachyon.initialize`: validate the config, start torch.distributed if needed, build the Engine.

    engine, optimizer, dataloader, lr_scheduler = tachyon.initialize(
        model=model, config="ds_config.json", training_data=dataset)

Order matters: the config is loaded and checked (for the world size the job will have), and the
parallel layout resolved and checked against the model (`tachyon.parallel.layout`), before any
process group is created and before the model, its parameters or an optimizer are touched, so a
bad config or layout fails fast and leaves everything as it was. Then, in torchtitan's order:
the mesh, tensor parallelism applied to the model (``parallelize``), and the engine, whose ZeRO
strategy builds its flat buffers from the (already split) local parameters and reduces over the
mesh's data-parallel axis.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from tachyon.config import ConfigError, load_config, parse_config

from .engine import Engine
from .setup import check_engine_inputs
from .pipeline import check_parallel_inputs
from .zero import DataParallelComm


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    config_params: Any = None,
):
    """Build a training engine (DeepSpeed's ``deepspeed.initialize``).

    Args:
        args: an argparse namespace; its ``deepspeed_config`` (or ``config``) path is used when
            ``config`` is not given.
        model: the torch.nn.Module to train.
        optimizer: a torch optimizer, or a callable taking param groups and returning one;
            None: the config's ``optimizer`` section (or no optimizer).
        model_parameters: the parameters / param groups to train (default: all of the model's).
        training_data: a torch Dataset; the returned DataLoader shards it over the
            data-parallel ranks (DistributedSampler) in micro-batches.
        lr_scheduler: a scheduler or a callable taking the optimizer; None: the config's.
        mpu: the tensor / pipeline / data-parallel groups (a Megatron or DeepSpeed mpu, or
            ``tachyon.parallel.Mesh(...).mpu``); None: from a PipelineModule's mesh or the
            config's ``pipeline`` / ``tensor_parallel`` sections (`tachyon.parallel.layout`).
        dist_init_required: None: start torch.distributed when RANK and WORLD_SIZE are in the
            environment and it is not running yet; True: require that; False: never (a
            ``WORLD_SIZE`` above 1 without a running process group is then an error).
        collate_fn: for the DataLoader.
        config: a path to a DeepSpeed-style JSON file, a dict or a TachyonConfig.
        config_params: DeepSpeed's older name for ``config``.

    Returns ``(engine, optimizer, dataloader, lr_scheduler)``; the last three may be None.
    Raises ConfigError (naming the key) for a bad config and ValueError for bad arguments or a
    layout that does not fit the model, before any state is created.
    """
    from tachyon.parallel.layout import build_mesh, check_layout, check_mpu, resolve_layout

    if model is None:
        raise ValueError("initialize() needs model=")
    if dist_init_required not in (None, True, False):
        raise ValueError(f"dist_init_required should be None, True or False; got {dist_init_required!r}")
    source = _config_source(args, config, config_params)
    world_size, must_init = _planned_world(dist_init_required)
    parsed = parse_config(source)
    if parsed.zero_stage == 3 and not must_init and not (dist.is_available() and dist.is_initialized()):
        if dist_init_required is False:  # FSDP2 shards over a process group, even of one rank
            raise ValueError("zero_optimization.stage 3 shards the model over a torch.distributed process group: "
                             "dist_init_required=False leaves none; pass None (a one-process group is started)")
        must_init = True
    if mpu is not None:
        check_mpu(mpu)
    layout = resolve_layout(model, mpu, parsed, world_size)
    cfg = load_config(parsed, world_size, data_parallel_size=layout.dp)
    check_engine_inputs(model, cfg, optimizer, lr_scheduler)
    check_parallel_inputs(model, cfg, layout, optimizer)
    check_layout(model, layout)
    if cfg.quantize_training.enabled:
        from .moq import check_moq_inputs

        check_moq_inputs(model, cfg, layout.tp)

    if must_init:
        _init_distributed()
    mesh = build_mesh(layout, model, mpu)
    if cfg.progressive_layer_drop.enabled and mesh is not None and layout.tp > 1:
        from tachyon.parallel.tensor import tp_group

        from .pld import check_tensor_parallel_generators

        check_tensor_parallel_generators(tp_group(mesh), _device())
    if mesh is not None and layout.tp > 1 and getattr(model, "_tachyon_tp", None) is None:
        from tachyon.parallel.tensor import parallelize

        parallelize(model, mesh, sequence_parallel=layout.sequence_parallel)
    comm = _data_parallel_comm() if mesh is None else _mesh_comm(mesh)
    engine = Engine(
        model,
        cfg,
        comm,
        _device(),
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        mesh=mesh,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config to load: ``config`` (or ``config_params``), else ``args.deepspeed_config`` (or
    DeepSpeed's deprecated ``args.deepscale_config``), else ``args.config``. Like DeepSpeed, a ``deepspeed_config`` in args that differs from an
    explicit ``config`` is an error (``args.config`` is then ignored: scripts use that name for
    other things too)."""
    if config is not None and config_params is not None:
        raise ValueError("pass the config once: config= or config_params=, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    deepscale = getattr(args, "deepscale_config", None) if args is not None else None
    if deepscale is not None:  # DeepSpeed's deprecated name for deepspeed_config, read as DeepSpeed reads it
        if from_args is not None:
            raise ValueError(f"args has both deepscale_config={deepscale!r} and deepspeed_config={from_args!r}; "
                             "deepscale_config is the deprecated name of deepspeed_config: keep deepspeed_config")
        warnings.warn("args.deepscale_config is deprecated (as in DeepSpeed); use args.deepspeed_config",
                      DeprecationWarning, stacklevel=3)
        from_args = deepscale
    if config is not None:
        if from_args is not None and from_args != config:
            raise ValueError(
                f"the config is given twice: config={config!r} and args.deepspeed_config={from_args!r}; keep one"
            )
        return config
    if from_args is None and args is not None:
        from_args = getattr(args, "config", None)
    if from_args is None:
        raise ConfigError("no config: pass config= (a JSON path or a dict) or args with deepspeed_config")
    return from_args


def _planned_world(dist_init_required: bool | None) -> tuple[int, bool]:
    """(world size the job will have, whether initialize must start torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), False
    env = os.environ
    if dist_init_required is False:
        if env.get("WORLD_SIZE", "1").strip() not in ("", "1"):
            raise ValueError(
                f"dist_init_required=False but torch.distributed is not initialized and the environment says "
                f"WORLD_SIZE={env['WORLD_SIZE']}: each rank would train alone. Start the process group first "
                "(torch.distributed.init_process_group / tachyon.init_distributed) or pass dist_init_required=None")
        return 1, False
    if "RANK" in env and "WORLD_SIZE" in env:
        try:
            world = int(env["WORLD_SIZE"])
        except ValueError:
            raise ValueError(f"environment WORLD_SIZE={env['WORLD_SIZE']!r} is not an integer") from None
        return world, True
    if dist_init_required:
        raise ValueError(
            "dist_init_required=True but RANK and WORLD_SIZE are not set; launch with torchrun "
            "(or tachyon launch), or pass dist_init_required=None for single-process training"
        )
    return 1, False


def _init_distributed() -> None:
    from tachyon.parallel.distributed import init_distributed

    init_distributed()


def _data_parallel_comm() -> DataParallelComm:
    """The data-parallel group: every rank (the layout has no tensor or pipeline axis), created through
    tachyon.parallel.distributed.new_group so it gets tachyon's timeout (DeepSpeed forgets it
    for this group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return DataParallelComm(None)
    from tachyon.parallel.distributed import get_timeout, new_group

    group = new_group(ranks=range(dist.get_world_size()))
    return DataParallelComm(group, get_timeout())


def _mesh_comm(mesh: Any) -> DataParallelComm:
    """The mesh's data-parallel axis (its group belongs to the mesh: the engine does not destroy it)."""
    from tachyon.parallel.distributed import get_timeout

    if mesh.size("dp") == 1:
        return DataParallelComm.single()
    return DataParallelComm(mesh.group("dp"), get_timeout())


def _device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there and the process group (if any) can talk CUDA (NCCL);
    CPU otherwise (a gloo-only group, or no GPU)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
