"""DeepSpeed's engine surface on tachyon's Engine: the attributes and methods that training
scripts and integrations (DeepSpeedExamples, Hugging Face's and Lightning's DeepSpeed code,
accelerate) use, with DeepSpeed's semantics.

`DeepSpeedEngineSurface` is a mixin of `tachyon.engine.Engine`; it holds no training logic. It
answers from the engine's own state (ranks from torch.distributed and the mesh, step counters,
the ZeRO strategy, the precision object) and from the validated config (DeepSpeed's getters:
``fp16_enabled()``, ``zero_optimization_stage()``, ``optimizer_name()``, ...). Getters of
DeepSpeed features tachyon does not have, whose config keys tachyon refuses unless they are off,
answer "off" (``zero_cpu_offload() -> False``, ``eigenvalue_enabled() -> False``). Everything
else DeepSpeed's engines have raises `tachyon.engine.compat_missing.EngineAttributeError`
saying why and what to use instead (its ``NOT_PROVIDED`` table). docs/engine.md lists both.

Step bookkeeping follows DeepSpeed's engine: ``global_samples`` grows by ``train_batch_size()``
per optimizer step (taken or skipped), ``was_step_applied()`` is True after a ``step()`` that
updated the weights (a boundary step without fp16 overflow), and
``set_gradient_accumulation_boundary`` overrides the micro-step counter's boundary.

Two names keep tachyon's meaning where DeepSpeed's differs: ``engine.loss_scale`` is the current
loss scale (a float; calling it, ``engine.loss_scale()``, gives DeepSpeed's answer, the config's
static ``fp16.loss_scale``), and ``engine.memory_breakdown()`` returns the bytes this rank holds
(DeepSpeed's returns whether the ``memory_breakdown`` config flag is set).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from .compat_missing import EngineAttributeError, missing_attribute
from .compat_step import LossScale, LossScaleState, deepspeed_step, records_step

_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""ZeRO strategy -> weak reference to its engine (`engine_of`: deepspeed.utils' safe_* helpers
reach the optimizer from a parameter)."""

_DEEPSPEED_OPTIMIZERS = ("adam", "adamw", "lamb", "onebitadam", "onebitlamb", "zerooneadam", "sgd")


def engine_of(strategy: Any) -> Any:
    """The live engine whose ZeRO strategy is ``strategy`` (None if gone)."""
    ref = _ENGINES.get(strategy)
    return ref() if ref is not None else None


class DeepSpeedEngineSurface:
    """DeepSpeed's DeepSpeedEngine / PipelineEngine attributes on tachyon's Engine (see the module
    docstring). Expects the engine's ``config``, ``comm``, ``mesh``, ``zero``, ``precision``,
    ``optimizer``, ``lr_scheduler``, ``module``, ``telemetry`` and step counters."""

    _boundary_override: bool | None = None
    _inside_no_sync: bool = False
    _step_applied: bool = False
    _samples_at: tuple[int, int] = (0, 0)
    """(global_steps, global_samples) when the train batch size last changed."""

    def _init_deepspeed_surface(self) -> None:
        """Called at the end of Engine.__init__."""
        _ENGINES[self.zero] = weakref.ref(self)
        if self.optimizer is not None:
            # DeepSpeed hands out a wrapper whose .optimizer is the torch optimizer and whose
            # .overflow says whether the last boundary step was skipped; here they are one object
            if "optimizer" not in vars(self.optimizer):
                self.optimizer.optimizer = self.optimizer
            self.optimizer.overflow = False
            self.optimizer.loss_scale_config = LossScaleState(self.precision, self.config)
            if "adam_w_mode" in self.optimizer.defaults:  # DeepSpeed's FusedAdam attribute
                self.optimizer.adam_w_mode = bool(self.optimizer.defaults["adam_w_mode"])

    # ------------------------------------------------------------------ attribute fallback
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # nn.Module: parameters, buffers, submodules
        except AttributeError:
            if name == "module" or name.startswith("__"):
                raise
        attribute = getattr(type(self), name, None)
        if isinstance(attribute, property):
            return attribute.fget(self)  # a property that raised AttributeError: raise its own error again
        module = super().__getattr__("module")
        try:
            return getattr(module, name)  # DeepSpeed passes unknown attributes through to the model
        except AttributeError:
            pass
        raise missing_attribute(self, name, module)

    # ------------------------------------------------------------------ ranks and sizes
    @property
    def local_rank(self) -> int:
        """This process's rank on its node (LOCAL_RANK; 0 without a launcher)."""
        from tachyon.parallel.distributed import get_local_rank

        return get_local_rank()

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def dp_world_size(self) -> int:
        """Ranks holding different data (the data-parallel axis)."""
        return self.comm.world_size

    seq_dp_world_size = dp_world_size

    @property
    def mp_world_size(self) -> int:
        """The model-parallel (tensor-parallel) size, as DeepSpeed's ``mpu.get_model_parallel_world_size()``."""
        return self.mesh.size("tp") if self.mesh is not None else 1

    sequence_parallel_size = 1

    def get_data_parallel_rank(self) -> int:
        return self.comm.rank

    def get_model_parallel_rank(self) -> int:
        return self.mesh.rank("tp") if self.mesh is not None else 0

    get_tensor_parallel_rank = get_model_parallel_rank

    def get_pipeline_parallel_rank(self) -> int:
        return self.mesh.rank("pp") if self.mesh is not None else 0

    @property
    def dist_backend(self) -> str | None:
        """torch.distributed's backend ("gloo", "nccl"), None without a process group."""
        return dist.get_backend() if dist.is_available() and dist.is_initialized() else None

    # ------------------------------------------------------------------ step bookkeeping
    @property
    def global_samples(self) -> int:
        """Samples trained on: ``train_batch_size()`` per optimizer step, taken or skipped (DeepSpeed's count)."""
        steps, samples = self._samples_at
        return samples + (self.global_steps - steps) * self.train_batch_size()

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self._samples_at = (self.global_steps, int(value))

    @property
    def gas_boundary_ctr(self) -> int:
        return self.global_steps

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` (or ``train_batch()``) updated the weights: False between
        accumulation boundaries and on a step skipped for fp16 overflow."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends a batch: its backward reduces the gradients and its
        ``step()`` updates the weights. From the micro-step counter, unless
        `set_gradient_accumulation_boundary` set it."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary (DeepSpeed's): set it before each forward/backward, True for the
        last micro-batch of the batch, then call ``step()`` once."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary takes a bool; got {is_boundary!r}")
        self._boundary_override = is_boundary

    def _backward_reduces(self) -> bool:
        """Whether this backward reduces the gradients over the data-parallel ranks."""
        return self.is_gradient_accumulation_boundary() and not self._inside_no_sync

    @property
    def inside_no_sync_ctxt(self) -> bool:
        return self._inside_no_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside the block accumulate gradients without reducing them; the next
        backward outside it reduces everything accumulated (DeepSpeed's ``no_sync``). ZeRO stage
        2 reduces during every backward and is refused, as in DeepSpeed; so is a stage 1 that
        accumulates in a dtype wider than the model's (it reduces every backward too)."""
        if self.zero.stage >= 2 or (self.zero.stage == 1 and self.zero._reduces(False)):
            raise RuntimeError(f"engine.no_sync() is incompatible with ZeRO stage {self.zero.stage}'s gradient "
                               "partitioning, which reduces during every backward; use stage 0 or 1 (with gradients "
                               "accumulated in the model dtype)")
        if self._inside_no_sync:
            raise RuntimeError("engine.no_sync() blocks do not nest")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """Reduce the accumulated gradients over the data-parallel ranks now (average), through the
        strategy's buckets: after backwards run inside `no_sync`, or to reduce by hand."""
        del bucket_size
        self.zero.reduce_param_grads()

    # ------------------------------------------------------------------ batch sizes
    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (the micro-batch stays)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1 \
                or train_batch_size % per_step:
            raise ValueError(f"train batch size {train_batch_size!r} must be a positive multiple of micro-batch x "
                             f"data-parallel ranks = {per_step}")
        self._set_batch_sizes(train_batch_size, train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size, keeping the accumulation steps (the global batch follows)."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro batch size should be a positive int; got {micro_batch_size!r}")
        gas = self.gradient_accumulation_steps()
        self._set_batch_sizes(micro_batch_size * gas * self.dp_world_size, gas, micro=micro_batch_size)

    def _set_batch_sizes(self, train_batch_size: int, gas: int, micro: int | None = None) -> None:
        if self.is_pipeline:
            raise NotImplementedError("changing the batch size of a PipelineModule's engine is not supported: its "
                                      "schedule is built for the configured micro-batch count; build a new engine")
        if (self.micro_steps % self.gradient_accumulation_steps()) != 0:
            raise RuntimeError("change the batch size between optimizer steps, not in the middle of an accumulation")
        self._samples_at = (self.global_steps, self.global_samples)
        update = {"train_batch_size": train_batch_size, "gradient_accumulation_steps": gas}
        if micro is not None:
            update["train_micro_batch_size_per_gpu"] = micro
        ignored = self.config._ignored
        self.config = self.config.model_copy(update=update)
        self.config._ignored = ignored
        self.telemetry.train_batch_size = train_batch_size
        self.micro_steps = self.global_steps * gas

    # ------------------------------------------------------------------ precision and config getters
    def _reentrant_activation_checkpointing(self) -> bool:
        """DeepSpeed's PipelineEngine check (`tachyon.engine.pipeline.reentrant_checkpointing`)."""
        from .pipeline import reentrant_checkpointing

        return self.is_pipeline and reentrant_checkpointing(self.module)

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype)."""
        return self.precision.model_dtype, self.precision.grad_accum_dtype

    @property
    def loss_scale(self) -> LossScale:
        return LossScale(self.precision.loss_scale, self.config.fp16.loss_scale)

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        fp16 = self.config.fp16
        if not (fp16.enabled and fp16.loss_scale == 0):
            return None
        return {"init_scale": 2 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def fp16_auto_cast(self) -> bool:
        return self.config.fp16.auto_cast

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (the config's, else the model dtype)."""
        from .precision import DTYPES

        name = self.config.communication_data_type
        return DTYPES[name] if name else self.precision.model_dtype

    def optimizer_name(self) -> str | None:
        """The config's optimizer type (DeepSpeed's lower-case names for its own), else the class
        name of the optimizer passed to initialize, else None."""
        if self.config.optimizer is not None:
            name = self.config.optimizer.type
            return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name
        return type(self.optimizer).__name__ if self.optimizer is not None else None

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    def _optimizer_param(self, key: str) -> list:
        if self.optimizer is None:
            return []
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def get_type(self) -> list:
        return self._optimizer_param("type")

    def get_mom(self) -> list:
        """Per param group: ``momentum`` for SGD / RMSprop, else ``betas``."""
        return self._optimizer_param("momentum" if self.optimizer_name() in ("sgd", "SGD", "RMSprop") else "betas")

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def dataloader_drop_last(self) -> bool:
        """The config's ``dataloader_drop_last``: the engine's DataLoader drops a short last batch."""
        return bool(getattr(self.config, "dataloader_drop_last", False))

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage above 0 is on (DeepSpeed's ``zero_enabled``)."""
        return self.zero.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """True at ZeRO stage 3 (parameters sharded, FSDP2)."""
        return self.zero.stage >= 3

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero_optimization.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return self.config.zero_optimization.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_reduce_scatter(self) -> bool:
        return self.config.zero_optimization.reduce_scatter

    def zero_round_robin_gradients(self) -> bool:
        return self.config.zero_optimization.round_robin_gradients

    def zero_allow_untested_optimizer(self) -> bool:
        return self.config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self.config.zero_force_ds_cpu_optimizer

    def pld_enabled(self) -> bool:
        return self.config.progressive_layer_drop.enabled

    def pld_params(self) -> dict | bool:
        pld = self.config.progressive_layer_drop
        return {"theta": pld.theta, "gamma": pld.gamma} if pld.enabled else False

    def pld_theta(self) -> float:
        return self.config.progressive_layer_drop.theta

    def pld_gamma(self) -> float:
        return self.config.progressive_layer_drop.gamma

    def flops_profiler_enabled(self) -> bool:
        return self.config.flops_profiler.enabled

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self.config.flops_profiler.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        return self.config.flops_profiler.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self.config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self.config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self.config.flops_profiler.detailed

    def flops_profiler_output_file(self) -> str | None:
        return self.config.flops_profiler.output_file

    @property
    def flops_profiler(self) -> Any:
        """The flops profiler profiling this step (during ``flops_profiler.profile_step``), after
        it the one that profiled it (``.flops`` / ``.macs`` / ``.params`` hold its totals), before
        it a `tachyon.profiling.FlopsProfiler` over the model, not started. Only with the
        ``flops_profiler`` section enabled, as in DeepSpeed."""
        if not self.config.flops_profiler.enabled:
            raise EngineAttributeError("engine.flops_profiler exists when the config's flops_profiler section is "
                                       'enabled ("flops_profiler": {"enabled": true}), as in DeepSpeed; or build '
                                       "tachyon.profiling.FlopsProfiler(model) yourself", name="flops_profiler", obj=self)
        if self.telemetry.profiler is not None:
            return self.telemetry.profiler
        if getattr(self.telemetry, "last_profiler", None) is not None:
            return self.telemetry.last_profiler
        if getattr(self, "_idle_flops_profiler", None) is None:
            from tachyon.profiling import FlopsProfiler

            self._idle_flops_profiler = FlopsProfiler(
                self.module, ds_engine=self, recompute_fwd_factor=self.config.flops_profiler.recompute_fwd_factor)
        return self._idle_flops_profiler

    @property
    def monitor(self) -> Any:
        """The tensorboard / csv monitor (``enabled``, ``write_events([(name, value, step), ...])``)."""
        return self.telemetry.monitor

    def tensor_parallel_config(self) -> Any:
        return self.config.tensor_parallel

    def autotp_size(self) -> int:
        return self.config.tensor_parallel.autotp_size or 0

    def checkpoint_tag_validation_enabled(self) -> bool:
        """Whether ``checkpoint.tag_validation`` is "Warn" or "Fail"."""
        return str(self.config.checkpoint.tag_validation).lower() != "ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        """Whether ``checkpoint.tag_validation`` is "Fail"."""
        return str(self.config.checkpoint.tag_validation).lower() == "fail"

    def use_node_local_storage(self) -> bool:
        return self.config.checkpoint.use_node_local_storage

    def load_universal_checkpoint(self) -> bool:
        return self.config.checkpoint.load_universal

    # Getters of DeepSpeed features whose config keys tachyon refuses unless off: they are off.
    def _off(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def _none(self, *args: Any, **kwargs: Any) -> None:
        return None

    amp_enabled = elasticity_enabled = is_elastic_model_parallel_supported = eigenvalue_enabled = _off
    curriculum_enabled_legacy = data_efficiency_enabled = data_sampling_enabled = _off
    curriculum_learning_enabled = random_ltd_enabled = autotuning_enabled = sparse_gradients_enabled = _off
    torch_autocast_enabled = graph_harvesting = is_sanity_checks_enabled = dump_state = _off
    fp16_master_weights_and_gradients = bf16_master_weights_and_gradients = bf16_optimizer_states = _off
    zero_elastic_checkpoint = _off
    zero_gather_16bit_weights_on_model_save = zero_legacy_stage1 = zero_quantized_weights = _off
    zero_quantized_nontrainable_weights = zero_quantized_gradients = optimizer_legacy_fusion = _off
    amp_params = torch_autocast_dtype = log_level = _none

    def zero_load_from_fp32_weights(self) -> bool:
        return True

    # ZeRO-Offload, as DeepSpeed's engine reports it: the sections, or None when not offloading
    def zero_cpu_offload(self) -> bool:
        """True with ``offload_optimizer: {"device": "cpu"}`` (or the older ``cpu_offload: true``)."""
        return self.config.zero_optimization.offloads_optimizer

    zero_use_cpu_optimizer = zero_cpu_offload

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` section when the optimizer is offloaded, else None."""
        return self.config.zero_optimization.offload_optimizer if self.zero_cpu_offload() else None

    def zero_offload_param(self) -> Any:
        """The ``offload_param`` section when parameters are offloaded (stage 3), else None."""
        zero = self.config.zero_optimization
        return zero.offload_param if zero.offloads_params else None

    def zero_ignore_unused_parameters(self) -> bool:
        return True

    def zero_allgather_partitions(self) -> bool:
        return True

    def managed_gradient_accumulation(self) -> bool:
        return True

    def torch_autocast_lower_precision_safe_modules(self) -> list:
        return []

    # ------------------------------------------------------------------ objects
    @property
    def basic_optimizer(self) -> Any:
        return self.optimizer

    @property
    def training_data(self) -> Any:
        loader = self.training_dataloader
        return loader.dataset if loader is not None else None

    @property
    def param_names(self) -> dict:
        return {param: name for name, param in self.module.named_parameters()}

    @property
    def pipeline_parallelism(self) -> bool:
        return self.is_pipeline

    @property
    def enable_backward_allreduce(self) -> bool:
        return True

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, value: bool) -> None:
        if value is not True:
            raise NotImplementedError("engine.enable_backward_allreduce = False is not supported: use `with "
                                      "engine.no_sync():` around the backwards that must not reduce")

    gradient_average = True
    torch_autocast_z0_gradscaler = None
    has_moe_layers = False
    use_ds_comm = False
    warn_unscaled_loss = True
    dont_change_device = False
    moe_layers: list = []
    num_experts: list = []
    gate_modules: list = []
    sparse_tensor_module_names: frozenset = frozenset()
    flatten = staticmethod(torch._utils._flatten_dense_tensors)
    unflatten = staticmethod(torch._utils._unflatten_dense_tensors)

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, IterableDataset)

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The model's state dict (DeepSpeed's name); ``exclude_frozen_parameters`` drops parameters
        that do not require grad."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def save_fp16_model(self, save_dir: Any, save_filename: str = "model.safetensors") -> str:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def clip_fp32_gradients(self) -> None:
        """Clip ``param.grad`` of the model to ``gradient_clipping`` (ZeRO stage 0, one model copy
        per rank: the gradients are whole there). ``step()`` clips by itself."""
        if self.zero.stage > 0 or self.mp_world_size > 1 or self.is_pipeline:
            raise NotImplementedError("engine.clip_fp32_gradients() needs whole gradients in param.grad (ZeRO stage 0, "
                                      "no model parallelism); step() clips to gradient_clipping by itself")
        grads = [p for p in self.module.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, self.gradient_clipping())

    # ------------------------------------------------------------------ data
    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler: Any = None, collate_fn: Any = None, num_local_io_workers: int | None = None
                     ) -> DataLoader:
        """A DataLoader over ``dataset`` in micro-batches, sharded over the data-parallel ranks
        (DeepSpeed's signature): a DistributedSampler that shuffles for ``route="train"`` and
        not for "eval" / "predict", unless ``data_sampler`` is given (or the dataset is iterable)."""
        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ValueError(f"deepspeed_io needs a torch Dataset; got {type(dataset).__name__}")
        if route not in ("train", "eval", "predict"):
            raise ValueError(f"route should be 'train', 'eval' or 'predict'; got {route!r}")
        sampler = data_sampler
        if sampler is None and not self.is_iterable_style_dataset(dataset):
            sampler = DistributedSampler(dataset, num_replicas=self.comm.world_size, rank=self.comm.rank,
                                         shuffle=route == "train")
        return DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(), sampler=sampler,
                          collate_fn=collate_fn, pin_memory=pin_memory and self.device.type == "cuda",
                          num_workers=num_local_io_workers or 0, drop_last=self.dataloader_drop_last())

    # ------------------------------------------------------------------ pipeline engine names
    @property
    def num_stages(self) -> int:
        return self.module.num_stages if self.is_pipeline else 1

    @property
    def stage_id(self) -> int:
        return self.module.pp_rank if self.is_pipeline else 0

    @property
    def micro_batches(self) -> int:
        return self.gradient_accumulation_steps()

    @property
    def micro_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu()

    @property
    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    @property
    def is_data_parallel(self) -> bool:
        return self.dp_world_size > 1

    @property
    def is_model_parallel(self) -> bool:
        return self.mp_world_size > 1

    @property
    def data_iterator(self) -> Any:
        return self._data_iterator

    @data_iterator.setter
    def data_iterator(self, iterator: Any) -> None:
        self._data_iterator = iterator

    def set_dataiterator(self, iterator: Any) -> None:
        """The iterator ``train_batch()`` / ``eval_batch()`` read when given none."""
        self._data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        """Read batches from ``loader`` (one pass: wrap it in RepeatingLoader to repeat it)."""
        self.training_dataloader = loader
        self._data_iterator = iter(loader)


__all__ = ["DeepSpeedEngineSurface", "LossScale", "LossScaleState", "deepspeed_step", "engine_of", "records_step"]
