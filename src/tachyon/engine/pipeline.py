"""What the engine does for tensor- and pipeline-parallel models: the checks `tachyon.initialize`
runs before anything is built, and DeepSpeed's ``train_batch`` / ``eval_batch`` for a
`tachyon.parallel.pipeline.PipelineModule`.

One pipeline batch (``train_batch``), on every rank of the job:

    1. the schedule (`tachyon.parallel.pipeline.PipelineSchedule`: GPipe, 1F1B or interleaved
       1F1B over torch.distributed.pipelining) runs ``gradient_accumulation_steps``
       micro-batches; their gradients of the batch's mean loss (times the fp16 loss scale)
       accumulate in ``param.grad``, tied weights' gradients summed over the stages holding them.
       ZeRO's per-parameter hooks are off meanwhile (`ZeroStrategy.deferred`): backward and
       forward of different micro-batches interleave, so no "last micro-batch" exists for them.
    2. the boundary reduction (`ZeroStrategy.reduce_param_grads`): every ``param.grad`` goes
       through the same buckets as a boundary backward, averaged over the data-parallel axis
       (all-reduce at stage 0, reduce-scatter to the owners at stage 1).
    3. the engine's step: fp16 overflow agreed over all ranks, the global gradient norm
       (every parameter of the whole model counted once), clipping, optimizer, lr schedule.

ZeRO stage 2 is refused with a pipeline, as DeepSpeed does: its point is to partition gradients
during every micro-batch's backward, which a schedule interleaving micro-batches does not allow;
stage 1 gives the same partitioned optimizer states and masters.
"""

from __future__ import annotations

from typing import Any

import torch

from tachyon.config import ConfigError, TachyonConfig
from tachyon.parallel.pipeline import PipelineModule

from .optim.lamb import Lamb
from .optim.onebit import OneBitOptimizer
from .precision import Precision


def check_parallel_inputs(model: Any, config: TachyonConfig, layout: Any, optimizer: Any) -> None:
    """Checks of a tensor / pipeline-parallel layout (`tachyon.parallel.layout.Layout`) against
    the engine's settings, before any state is created: ConfigError / ValueError naming the
    setting and what is allowed."""
    if layout.tp > 1 and ((config.optimizer is not None and config.optimizer.type == "Lamb") or isinstance(optimizer, Lamb)):
        raise ConfigError(
            f"LAMB with tensor parallelism (tp={layout.tp}) is not supported: its per-parameter trust ratios need each "
            "split parameter's norm summed over the tensor-parallel ranks, which the flat ZeRO partitions do not "
            "carry; use Adam / AdamW, or tp_size 1"
        )
    if not isinstance(model, PipelineModule):
        return
    onebit = (config.optimizer is not None and config.optimizer.type in ("OneBitAdam", "OneBitLamb")) or \
        isinstance(optimizer, OneBitOptimizer)
    if onebit and model.num_stages > 1 and model.tied_weight_keys:
        raise ConfigError(
            f"a 1-bit optimizer with a PipelineModule whose stages share tied weights ({', '.join(model.tied_weight_keys)}): "
            "each stage would compress its copy's momentum on its own and the copies would drift apart; untie the "
            "weights (tie_embeddings=False) or use Adam / Lamb with pipelines"
        )
    if model.num_stages > 1 and config.zero_stage >= 2:
        raise ConfigError(
            f"`zero_optimization.stage: {config.zero_stage}` with a {model.num_stages}-stage PipelineModule: ZeRO stage 2 "
            "partitions gradients during every micro-batch's backward, which a pipeline schedule interleaves across "
            "micro-batches (DeepSpeed refuses it too); use zero_optimization.stage 0 or 1 with pipelines"
        )
    accum = config.data_types.grad_accum_dtype
    if accum is not None and accum != config.precision:
        raise ConfigError(
            f'`data_types.grad_accum_dtype: "{accum}"` with a PipelineModule: the pipeline schedule accumulates the '
            f"micro-batches' gradients in param.grad, in the model dtype ({config.precision}); leave it unset"
        )
    from tachyon.parallel.pipeline.schedule import check_schedule

    try:
        check_schedule(config.pipeline.schedule, model.stages_per_rank, config.gradient_accumulation_steps,
                       model.num_stages)
    except ValueError as error:  # name the config keys the schedule's arguments come from
        raise ConfigError(f"`pipeline.schedule: {config.pipeline.schedule!r}` with gradient_accumulation_steps="
                          f"{config.gradient_accumulation_steps} (the micro-batches per batch): {error}") from None
    defaults = type(config.pipeline)()
    for key, built in (("partition", model.partition_method), ("seed_layers", model.seed_layers)):
        wanted = getattr(config.pipeline, key)
        if wanted != getattr(defaults, key) and wanted != built:
            raise ConfigError(f"`pipeline.{key}: {wanted!r}` but the PipelineModule was built with {built!r}; its "
                              "constructor arguments decide: make them agree (or leave the key out)")


def apply_checkpointing(model: PipelineModule, config: TachyonConfig) -> None:
    """DeepSpeed's PipelineEngine: ``pipeline.use_reentrant: false`` makes the module checkpoint with
    ``non_reentrant_checkpoint``, and a positive ``pipeline.activation_checkpoint_interval``
    replaces the module's interval (0, the default, keeps the one it was built with)."""
    from tachyon.engine.activation_checkpointing import non_reentrant_checkpoint

    if config.pipeline.use_reentrant is False:
        model.activation_checkpoint_func = non_reentrant_checkpoint
    if config.pipeline.activation_checkpoint_interval > 0:
        model.activation_checkpoint_interval = config.pipeline.activation_checkpoint_interval


def reentrant_checkpointing(model: PipelineModule) -> bool:
    """DeepSpeed's ``_reentrant_activation_checkpointing`` (whether the first stage's inputs must
    require grad): the module checkpoints and its function is not a non-reentrant one. tachyon's
    checkpointing and a PipelineModule's default function are non-reentrant: only a function the
    user gave counts."""
    from tachyon.engine.activation_checkpointing import non_reentrant_checkpoint
    from tachyon.parallel.pipeline.module import _default_checkpoint

    return model.activation_checkpoint_interval > 0 and \
        model.activation_checkpoint_func not in (non_reentrant_checkpoint, _default_checkpoint)


def build_schedule(model: PipelineModule, config: TachyonConfig, device: torch.device, precision: Precision) -> Any:
    """The PipelineSchedule running ``gradient_accumulation_steps`` micro-batches per batch, applying
    the fp16 loss scale inside (its backward runs in the schedule), after the config's
    checkpointing settings went onto the module (`apply_checkpointing`)."""
    from tachyon.parallel.pipeline import PipelineSchedule

    apply_checkpointing(model, config)

    scale = (lambda: precision.loss_scale) if precision.name == "fp16" else None
    return PipelineSchedule(model, micro_batches=config.gradient_accumulation_steps, schedule=config.pipeline.schedule,
                            device=device, loss_scale=scale)


def repeat(loader: Any):
    """DeepSpeed's RepeatingLoader: iterate ``loader`` forever, one epoch after the other."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def data_parallel_mean(engine: Any, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` (an fp32 scalar, the same on every rank of one model copy) averaged over the
    data-parallel copies; every rank gets it."""
    loss = loss.detach().float().reshape(1).clone()
    if engine.comm.world_size > 1:
        engine.comm.all_reduce(loss)
        loss /= engine.comm.world_size
    return loss.reshape(())


def batches(engine: Any, data_iter: Any) -> Any:
    """``data_iter``, else the engine's training dataloader repeated forever (None on the ranks
    of the middle stages, which read no data)."""
    if data_iter is not None:
        return data_iter
    if engine.training_dataloader is None:
        if engine.module.is_first_stage or engine.module.is_last_stage:
            raise ValueError("train_batch / eval_batch need data_iter (or training_data= at initialize) on the ranks "
                             "holding the first or the last pipeline stage")
        return None
    if engine._data_iterator is None:
        engine._data_iterator = repeat(engine.training_dataloader)
    return engine._data_iterator


def train_batch(engine: Any, data_iter: Any) -> torch.Tensor:
    """One optimizer step of a PipelineModule (module docstring); returns the batch's mean loss
    averaged over the data-parallel copies (an fp32 scalar, every rank)."""
    if engine.optimizer is None:
        raise RuntimeError("engine.train_batch() needs an optimizer: pass optimizer= or a config 'optimizer' section")
    data_iter = batches(engine, data_iter)
    engine.module.train()
    with engine.telemetry.phase("backward"), engine.zero.deferred():
        loss = engine.schedule.train_batch(data_iter)
    engine.telemetry.record_loss(loss)
    with engine.telemetry.phase("reduce"):
        engine.zero.reduce_param_grads()
    with engine.telemetry.phase("step"):
        engine._take_model_step()
    engine.telemetry.end_step(engine.global_steps, lr=engine.get_lr(), grad_norm=engine._grad_norm,
                              loss_scale=engine.loss_scale, skipped_steps=engine.skipped_steps)
    engine.micro_steps += engine.gradient_accumulation_steps()
    mean = data_parallel_mean(engine, loss)
    if engine._stop_agreed:  # a preemption signal: save and raise Preempted (tachyon.engine.preemption)
        engine._stop_agreed = False
        engine.preemption.stop(engine)
    return mean


@torch.no_grad()
def eval_batch(engine: Any, data_iter: Any, return_logits: bool) -> Any:
    """Forward only over ``gradient_accumulation_steps`` micro-batches, in eval mode: the mean
    loss averaged over the data-parallel copies (every rank), and with ``return_logits`` the
    last stage's outputs for the batch (None on the other stages)."""
    loss, logits = engine.schedule.eval_batch(batches(engine, data_iter), return_logits=True)
    loss = data_parallel_mean(engine, loss)
    return (loss, logits) if return_logits else loss


__all__ = ["batches", "build_schedule", "check_parallel_inputs", "data_parallel_mean", "eval_batch", "repeat",
           "train_batch"]
