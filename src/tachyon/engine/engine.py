"""The Engine: forward, backward and step, orchestrating a precision and a ZeRO strategy.

    engine, optimizer, dataloader, scheduler = tachyon.initialize(model=model, config=cfg)
    for batch in dataloader:
        loss = loss_fn(engine(batch["x"]), batch["y"])
        engine.backward(loss)
        engine.step()

The engine holds no precision or ZeRO logic of its own; it calls two objects:

- ``engine.precision`` (`tachyon.engine.precision`): model dtype, loss scaling, overflow check;
- ``engine.zero`` (`tachyon.engine.zero`): the flat parameter buffer, fp32 master weights,
  gradient accumulation and reduction, the global gradient norm, and the parameter all-gather.

Gradient accumulation follows DeepSpeed: call ``backward`` and ``step`` on every micro-batch;
the loss is divided by ``gradient_accumulation_steps``, gradients are communicated only on the
boundary micro-step (``is_gradient_accumulation_boundary()``), and only the boundary ``step``
updates the weights. A non-finite gradient (fp16 overflow, or an inf/nan in any precision)
skips the update on every rank (`tachyon.engine.nonfinite`), counts in ``skipped_steps`` and
still counts as a global step; the ``preemption`` section saves and stops on a signal
(`tachyon.engine.preemption`).

Monitoring comes from the config alone (``engine.telemetry``, `tachyon.engine.telemetry`): every
``steps_per_print`` steps rank 0 prints the step line (loss averaged over the accumulation
window and the data-parallel ranks, lr, grad norm, loss scale, skipped steps, samples/s, tokens/s
after ``set_tokens_per_sample``, step time); the ``tensorboard`` / ``csv_monitor`` sections get
DeepSpeed's ``Train/Samples/*`` events every step; ``wall_clock_breakdown`` times forward,
backward, reduce and step; the ``flops_profiler`` section profiles one step's FLOPs and latency
(`tachyon.profiling.FlopsProfiler`).

Tensor and pipeline parallelism (``mesh``, from `tachyon.initialize`; docs/parallelism.md): the
model arrives already split (`tachyon.parallel.tensor.parallelize`) or as this rank's pipeline
stages (`tachyon.parallel.pipeline.PipelineModule`); ``engine.comm`` is the mesh's data-parallel
axis, so ZeRO partitions over the copies of the same model part. The global gradient norm counts
every parameter of the whole model once (`tachyon.engine.zero.model_parallel`) and a
non-finite gradient on any rank skips the step everywhere. A PipelineModule is trained with DeepSpeed's
``engine.train_batch(data_iter)`` (one optimizer step over ``gradient_accumulation_steps``
micro-batches run by the ``pipeline.schedule``; `tachyon.engine.pipeline`) and evaluated with
``engine.eval_batch``; ``forward`` / ``backward`` / ``step`` are refused there, as in DeepSpeed.

An optimizer with a boolean ``in_compression_stage`` (1-bit Adam / LAMB) gets, while it is True,
this rank's own gradient at ZeRO stage 0: the engine skips the data-parallel averaging and the
optimizer communicates compressed gradients itself (`ZeroStrategy.set_local_gradients`).

Progressive layer drop (``progressive_layer_drop`` section, `tachyon.engine.pld`): in training
mode the engine adds ``progressive_layer_drop=True, pld_theta=engine.get_pld_theta()`` to the
model's forward (a model whose forward cannot take them is refused at initialize), and
parameters that got no gradient in a step on any rank (dropped layers) are left untouched by the
optimizer, master weights and moments alike. At ZeRO stage 3 each training forward runs on a CPU
generator state shared by every rank (``engine.pld_draws``), so all ranks drop the same layers.

MoQ (``quantize_training`` section, `tachyon.engine.moq`): after every optimizer step taken
(boundary, no overflow) ``engine.quantizer`` counts the step and snaps the model's linear weights
onto its current grid from their full-precision values, which the optimizer keeps updating;
``engine.quantizer.inference_quant()`` is the ``quant=`` for `tachyon.init_inference`.

DeepSpeed's engine names (ranks and sizes, config getters, ``global_samples``,
``was_step_applied``, ``no_sync``, ...) come from `tachyon.engine.compat_surface`; a name the
engine leaves out raises an error saying so (`tachyon.engine.compat_missing`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from tachyon.config import TachyonConfig
from tachyon.parallel.pipeline import PipelineModule

from . import pipeline
from .compat_surface import DeepSpeedEngineSurface, deepspeed_step, records_step
from .cuda_graph import EngineCudaGraph, check_cuda_graph
from .nonfinite import NonFiniteGradientsError, StepGuard
from .onebit_hooks import bind_masks, bind_onebit_optimizer
from .optim import ZeroOneAdam
from .pld import PLD_KWARGS, ProgressiveLayerDrop, SharedLayerDraws, UnusedParameterGuard
from .precision import DTYPES, Precision, build_precision
from .preemption import PreemptionHandler
from .setup import bind_optimizer, build_scheduler_of, check_engine_inputs, describe, param_groups_of, world_comm
from .telemetry import EngineTelemetry
from .zero import DataParallelComm, ZeroStrategy, build_zero_strategy
from .zero.model_parallel import ModelParallelSum, duplicate_parameters
from .zero.offload import mark_host_optimizer, plan_of

CLIP_EPS = 1e-6
"""clip coefficient = max_norm / (norm + CLIP_EPS), as in torch.nn.utils.clip_grad_norm_."""


class Engine(DeepSpeedEngineSurface, torch.nn.Module):
    """Wraps a model for training; build it with `tachyon.initialize`.

    Args:
        model: the torch.nn.Module (moved to ``device`` and cast to the model dtype in place).
        config: a validated `TachyonConfig` (batch sizes resolved for ``comm.world_size``).
        comm: the data-parallel collectives.
        device: the device to train on.
        optimizer: a torch optimizer over the model's parameters, a callable taking param
            groups and returning one, or None (then the config's ``optimizer`` section, if any).
        model_parameters: parameters or param groups to train (default: model.parameters()).
        lr_scheduler: a scheduler, a callable taking the optimizer, or None (the config's).
        training_data: a torch Dataset; ``engine.training_dataloader`` then iterates it.
        collate_fn: passed to the DataLoader.
        mesh: the tachyon Mesh (or mpu view) the model is split over; None for plain data
            parallelism. ``comm`` must be its data-parallel axis.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TachyonConfig,
        comm: DataParallelComm,
        device: torch.device,
        *,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
        mesh: Any = None,
    ):
        check_engine_inputs(model, config, optimizer, lr_scheduler)
        check_cuda_graph(model, config, device)
        if config.quantize_training.enabled:
            from .moq import check_moq_inputs

            check_moq_inputs(model, config, mesh.size("tp") if mesh is not None else 1)
        super().__init__()
        self.module = model
        self.config = config
        self.comm = comm
        self.mesh = mesh
        self.world_comm = comm if mesh is None else world_comm()
        """All ranks of the job: fp16 overflow agreement, checkpoints."""
        self.device = device
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._grad_norm: torch.Tensor | None = None
        self._destroyed = False
        self.telemetry = EngineTelemetry(config, comm, device)

        self.precision: Precision = build_precision(config)
        param_groups = param_groups_of(optimizer, model_parameters, model)
        zero = config.zero_optimization
        comm_dtype = config.communication_data_type
        if config.zero_stage == 3:  # the model is sharded in place on FSDP2 (tachyon.engine.zero.stage3)
            from .zero.stage3 import build_stage3

            self.zero = build_stage3(model, param_groups, config=config, model_dtype=self.precision.model_dtype,
                                     comm=comm, device=device, mesh=mesh)
        else:
            model.to(device=device, dtype=self.precision.model_dtype)
            self.zero: ZeroStrategy = build_zero_strategy(
                config.zero_stage,
                param_groups,
                model_dtype=self.precision.model_dtype,
                grad_accum_dtype=self.precision.grad_accum_dtype,
                comm=comm,
                device=device,
                reduce_bucket_size=zero.reduce_bucket_size,
                allgather_bucket_size=zero.allgather_bucket_size,
                overlap_comm=zero.overlap_comm,
                comm_dtype=DTYPES[comm_dtype] if comm_dtype else None,
                gradient_predivide_factor=config.gradient_predivide_factor,
                prescale_gradients=config.prescale_gradients,
                offload=plan_of(config),
            )
        if mesh is not None and (mesh.size("tp") > 1 or mesh.size("pp") > 1):
            self.zero.set_model_parallel(ModelParallelSum(mesh), duplicate_parameters(model, mesh))
        self.optimizer = bind_optimizer(optimizer, config, self.zero)
        if self.zero.offload.any:  # ZeRO-Offload: the step runs on the host (tachyon.engine.zero.offload)
            mark_host_optimizer(self.optimizer)
        precision = self.precision  # not self: the strategy must not keep the engine alive
        tp = None
        if mesh is not None and mesh.size("tp") > 1:
            from tachyon.parallel.tensor import tp_group

            tp = tp_group(mesh)
        bind_masks(self.optimizer, self.zero)
        if not bind_onebit_optimizer(self.optimizer, self.zero, loss_scale=lambda: precision.loss_scale, tp=tp) \
                and hasattr(self.optimizer, "in_compression_stage"):
            bound = self.optimizer
            if isinstance(bound, ZeroOneAdam):  # it averages over the data-parallel group
                bound.bind_data_parallel(self.zero.comm.group, self.zero.comm.world_size,
                                         partitioned=self.zero.partitioned_masters)
            self.zero.set_local_gradients(lambda: bool(bound.in_compression_stage))
        self.schedule = pipeline.build_schedule(model, config, device, self.precision) if self.is_pipeline else None
        self._data_iterator: Any = None
        self.lr_scheduler = build_scheduler_of(lr_scheduler, config, self.optimizer)
        pld = config.progressive_layer_drop
        self.progressive_layer_drop = ProgressiveLayerDrop(pld.theta, pld.gamma) if pld.enabled else None
        self._unused_guard = UnusedParameterGuard(self.zero, comm) if pld.enabled else None
        self.pld_draws = SharedLayerDraws(self.world_comm, device) if pld.enabled and config.zero_stage == 3 else None
        """Stage 3: the keep draws of every rank from one shared generator state (`tachyon.engine.pld`)."""
        self.quantizer = None
        """MoQ (``quantize_training`` section; `tachyon.engine.moq.EngineMoQ`), None when off."""
        if config.quantize_training.enabled:
            from .moq import EngineMoQ

            self.quantizer = EngineMoQ(model, config, self.zero)
        # save on a signal (no handler when off); skip non-finite steps on every rank together
        self.preemption = PreemptionHandler(config.preemption, self.world_comm.rank)
        self.step_guard = StepGuard(self.precision, self.zero, self.world_comm, model,
                                    config.nonfinite_gradients.max_consecutive_skips, self.preemption)
        self._stop_agreed = False
        self.cuda_graph = EngineCudaGraph(model, config.cuda_graph.num_warmup_iters) if config.cuda_graph.enabled \
            else None
        """The ``cuda_graph`` section (`tachyon.engine.cuda_graph`): captures at the first training forward."""
        self.telemetry.attach_model(model, self)
        self.training_dataloader = (
            self.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
        )
        self._init_deepspeed_surface()

    # ------------------------------------------------------------------ training loop
    @property
    def is_pipeline(self) -> bool:
        """Whether the model is a PipelineModule (trained with train_batch, DeepSpeed's PipelineEngine)."""
        return isinstance(self.module, PipelineModule)

    def _refuse_in_pipeline(self, name: str) -> None:
        if self.is_pipeline:
            raise RuntimeError(
                f"engine.{name}() is not available when training a PipelineModule: only train_batch() and eval_batch() "
                "are (DeepSpeed's pipeline engine); the schedule runs the forward and backward of every micro-batch"
            )

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this engine was destroyed (engine.destroy()); create a new one with tachyon.initialize")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_alive()
        self._refuse_in_pipeline("forward")
        if self.progressive_layer_drop is not None and self.module.training:
            given = [key for key in PLD_KWARGS if key in kwargs]
            if given:
                raise ValueError(
                    f"engine forward got {', '.join(given)}, which the engine passes itself when "
                    "progressive_layer_drop is enabled in the config; remove them from the call"
                )
            kwargs.update(self.progressive_layer_drop.get_state(self.global_steps))
        self.telemetry.begin_forward(self.global_steps, self.micro_steps % self.gradient_accumulation_steps() == 0)
        if self.cuda_graph is not None and self.module.training:
            self.cuda_graph.before_forward(inputs, kwargs)
        shared = self.pld_draws is not None and self.module.training
        with self.telemetry.forward_phase(), self.pld_draws.forward() if shared else nullcontext():
            return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` / gradient_accumulation_steps (times the loss scale); reduces
        the gradients on the accumulation boundary. Returns ``loss`` unchanged."""
        self._refuse_in_pipeline("backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"loss should be a scalar tensor; got {describe(loss)}")
        if not loss.requires_grad:
            raise ValueError("loss does not require grad: was it computed under torch.no_grad()?")
        self.telemetry.record_loss(loss)
        with self.telemetry.phase("backward"):
            scaled = loss
            gas = self.gradient_accumulation_steps()
            if scale_wrt_gas and gas > 1:
                scaled = scaled / gas
            scaled = self.precision.scale_loss(scaled)
            self.zero.begin_backward(self._backward_reduces())
            scaled.backward(retain_graph=retain_graph)
        with self.telemetry.phase("reduce"):
            self.zero.end_backward()
        return loss

    @deepspeed_step
    def step(self) -> None:
        """Count a micro-step; on the accumulation boundary update the weights (unless fp16
        overflowed), step the lr schedule and clear the gradients; then report the step
        (`tachyon.engine.telemetry`: collective on print steps)."""
        self._refuse_in_pipeline("step")
        try:
            if self.is_gradient_accumulation_boundary():
                with self.telemetry.phase("step"):
                    self._take_model_step()
                self.telemetry.end_step(self.global_steps, lr=self.get_lr(), grad_norm=self._grad_norm,
                                        loss_scale=self.loss_scale, skipped_steps=self.skipped_steps)
        finally:  # also when too many non-finite steps stopped training: the counters stay in step
            self.micro_steps += 1
        if self._stop_agreed:  # a preemption signal: save and raise Preempted (tachyon.engine.preemption)
            self._stop_agreed = False
            self.preemption.stop(self)

    def _take_model_step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass optimizer= or a config 'optimizer' section")
        grads = self.zero.master_grads()
        try:  # the same verdict on every rank (tachyon.engine.nonfinite)
            verdict = self.step_guard.decide(grads, self.global_steps + 1)
        except NonFiniteGradientsError:  # too many in a row: this one is skipped too, then training stops
            self.skipped_steps, self._grad_norm = self.skipped_steps + 1, None
            self._end_step(True)
            raise
        self._stop_agreed = verdict.stop
        overflow = verdict.skip
        if overflow:
            self.skipped_steps += 1
            self._grad_norm = None
        else:
            self._grad_norm = verdict.grad_norm
            max_norm = self.config.gradient_clipping
            if max_norm > 0:
                coef = (max_norm / (self._grad_norm + CLIP_EPS)).clamp(max=1.0)
                for grad in grads:
                    grad.mul_(coef)
            if self.quantizer is not None:
                self.quantizer.before_step()  # the optimizer steps full-precision values
            guard = self._unused_guard
            with guard.keep_unused(self.optimizer) if guard is not None else nullcontext():
                self.optimizer.step()
            self.zero.after_step()
            if self.quantizer is not None:
                self.quantizer.after_step()  # count the step, snap the model's linear weights
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._end_step(overflow)

    def _end_step(self, overflow: bool) -> None:
        self.precision.update(overflow)
        self.zero.zero_grad()
        if self._unused_guard is not None:
            self._unused_guard.reset()
        self.global_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated so far (the engine clears them after each step)."""
        del set_to_none
        self.zero.zero_grad()
        if self._unused_guard is not None:
            self._unused_guard.reset()

    # ------------------------------------------------------------------ pipelines
    @records_step
    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One optimizer step of a PipelineModule (DeepSpeed's name): the ``pipeline.schedule``
        runs ``gradient_accumulation_steps`` micro-batches, each an ``(inputs, labels)`` item of
        ``data_iter`` (default: the engine's training dataloader, repeated), then the boundary
        step (data-parallel reduction / ZeRO, clipping, optimizer, lr schedule); see
        `tachyon.engine.pipeline`. Only the ranks of the first and last stage read ``data_iter``.
        Returns the batch's mean loss averaged over the data-parallel ranks, on every rank (fp32
        scalar)."""
        self._check_alive()
        if self.schedule is None:
            raise RuntimeError("engine.train_batch() trains a PipelineModule; this engine's model is a "
                               f"{type(self.module).__name__}: use engine(...), engine.backward(loss), engine.step()")
        return pipeline.train_batch(self, data_iter)

    def eval_batch(self, data_iter: Any = None, return_logits: bool = False):
        """Forward only over ``gradient_accumulation_steps`` micro-batches of a PipelineModule, in
        eval mode (DeepSpeed's name). Returns the mean loss averaged over the data-parallel ranks
        (every rank), and with ``return_logits`` also the last stage's outputs (None elsewhere)."""
        self._check_alive()
        if self.schedule is None:
            raise RuntimeError("engine.eval_batch() evaluates a PipelineModule; call the engine (or the model) "
                               "under torch.no_grad() instead")
        return pipeline.eval_batch(self, data_iter, return_logits)

    def is_first_stage(self) -> bool:
        """Whether this rank runs the first pipeline stage (True without a pipeline)."""
        return not self.is_pipeline or self.module.is_first_stage

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (True without a pipeline)."""
        return not self.is_pipeline or self.module.is_last_stage

    @property
    def mpu(self) -> Any:
        """DeepSpeed's / Megatron's getters over the engine's mesh (None without one)."""
        return None if self.mesh is None else self.mesh.mpu

    def set_tokens_per_sample(self, tokens: int | None) -> None:
        """Tokens in one sample (e.g. the sequence length): the step line then shows tokens/s.
        The engine does not guess it from input shapes (padding, packing, non-text inputs)."""
        self.telemetry.set_tokens_per_sample(tokens)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's; not mutated)
                        exclude_frozen_parameters=False) -> bool:
        """Save the training state to ``save_dir/<tag>``; True, as DeepSpeed (`tachyon.engine.checkpoint`)."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False,
                        custom_load_fn=None) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved with any layout (DeepSpeed's arguments); ``(path, client_state)``."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               custom_load_fn=custom_load_fn)

    def save_16bit_model(self, save_dir, save_filename="model.safetensors") -> str:
        """Write the consolidated model weights (safetensors; plus config.json for HF models)."""
        from .checkpoint import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename)

    # ------------------------------------------------------------------ queries
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.zero.stage

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_pld_theta(self) -> float | None:
        """The progressive-layer-drop keep ratio the next training forward gets (None when PLD is
        off); see `tachyon.engine.pld` for the schedule and its step timing (DeepSpeed's)."""
        if self.progressive_layer_drop is None:
            return None
        return self.progressive_layer_drop.get_theta(self.global_steps)

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (None: no step yet, or
        the last one overflowed)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def data_parallel_world_size(self) -> int:
        return self.comm.world_size

    @property
    def data_parallel_rank(self) -> int:
        return self.comm.rank

    @property
    def data_parallel_group(self):
        """The data-parallel process group (DeepSpeed's attribute); None without torch.distributed.
        Pass it as ``fp8_autocast(fp8_group=...)`` so every rank's FP8 scales stay identical."""
        if not self.comm.enabled:
            return None
        return self.comm.group if self.comm.group is not None else torch.distributed.group.WORLD

    def destroy(self) -> None:
        """End of the engine's life (DeepSpeed's name): close the monitor's files, then, once every
        rank of the data-parallel group has reached this call (a barrier), destroy the group the
        engine created. The default group stays (`tachyon.shutdown_distributed` or the exit handler
        of `init_distributed` ends it). Training with the engine afterwards raises; calling
        destroy again does nothing."""
        if self._destroyed:
            return
        self._destroyed = True
        self.preemption.uninstall()
        self.telemetry.close()
        if self._unused_guard is not None:
            self._unused_guard.release()
        group = self.comm.group if self.mesh is None else None  # a mesh's groups are the mesh's
        if group is not None:
            from tachyon.parallel.distributed import destroy_group

            torch.distributed.barrier(group=group)
            destroy_group(group)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds: parameters, gradients, master_weights, optimizer_states, their
        sum model_states, and buckets (reduce bucket buffers, reported separately). With MoQ,
        also moq_full_precision (the fp32 copies of the quantized weights kept where the master
        is the model's own buffer), counted in model_states."""
        breakdown = self.zero.memory_breakdown(self.optimizer)
        if self.quantizer is not None:
            extra = self.quantizer.memory_bytes()
            breakdown["moq_full_precision"] = extra
            breakdown["model_states"] += extra
        return breakdown


# ---------------------------------------------------------------------- helpers
