"""Activation checkpointing with DeepSpeed's API, on PyTorch's non-reentrant checkpoint.

    import tachyon
    tachyon.checkpointing.configure(None, deepspeed_config=config)   # optional
    hidden = tachyon.checkpointing.checkpoint(layer, hidden, mask)

How it saves memory: a checkpointed region ``function(*args)`` keeps only its inputs for
backward; everything the ops inside would save (GELU inputs, dropout masks, matmul operands) is
dropped after the forward and recomputed in the backward, just before it is needed. Checkpointing
every layer of an L-layer model keeps L layer inputs instead of all intermediate activations, for
roughly one extra forward pass of compute. docs/activation_checkpointing.md has measured numbers.

Implementation: ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``.
The CPU and CUDA RNG states are restored for the recomputation, so dropout inside a region draws
the same mask twice and gradients equal the non-checkpointed run. Non-reentrant checkpointing works
with inputs that do not require grad, with kwargs, nested regions and torch.autograd.grad.

FP8: the checkpoint passes ``context_fn=tachyon.fp8.fp8_checkpoint_context_fn()``, so a region
run under ``fp8_autocast`` is recomputed (during the backward, after the autocast exited and
updated the scales) under the same autocast settings and with the scales its forward used,
recording no amax twice and registering no second scale update: outputs, gradients, amax
histories and scales equal the run without checkpointing (as Transformer Engine's checkpoint).
A region outside any fp8_autocast is unaffected.

The ``activation_checkpointing`` config section (DeepSpeed's keys) maps onto it as follows:

- ``cpu_checkpointing`` (``checkpoint_in_cpu``): the inputs a region keeps for backward are stored
  in CPU memory (pinned, copied asynchronously) and copied back to their device when the region is
  recomputed. Done with ``torch.autograd.graph.saved_tensors_hooks`` around the checkpoint call,
  which see exactly the region's saved inputs (the ops inside are handled by checkpoint's own hooks).
  Like DeepSpeed it needs ``partition_activations``.
- ``profile``: time spent recomputing is measured (CUDA synchronized) and readable with
  `get_profile`; each recomputation is logged at DEBUG, `log_profile` logs the totals at INFO.
- ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` before and after every region's
  forward and recomputation (for timing and debugging; a no-op without CUDA).
- ``partition_activations`` (with ``configure(mpu, ...)`` naming the tensor-parallel group, e.g.
  ``engine.mpu``): each region's saved inputs are split across the tensor-parallel ranks, every
  rank keeping 1/tp of each (a contiguous slice of the flattened tensor), and all-gathered over
  the group when the region is recomputed. A tensor-parallel region's input (the hidden states)
  is the same on every tp rank, so each rank stores 1/tp of it (Megatron / DeepSpeed's scheme).
  Inputs that are parameters, not floating point, or whose size tp does not divide are kept
  whole. Sequence parallelism splits those inputs along the sequence already (they differ per
  rank), so the two are not combined (a config with both is refused). With no ``mpu`` or a
  tensor-parallel size of 1 there is nothing to split (accepted, with a warning).
  With ``cpu_checkpointing`` the kept slice goes to CPU memory.
- ``contiguous_memory_optimization`` (with ``partition_activations`` over a tensor-parallel
  group): the kept 1/tp slices are copied one after the other into large preallocated buffers
  (``number_checkpoints`` slices each, on the slices' device, or in CPU memory with
  ``cpu_checkpointing``) instead of each into an allocation of its own: DeepSpeed's contiguous
  checkpointing, against the fragmentation of many long-lived activation slices between
  short-lived tensors. The buffers are reused from their start once every slice handed out was
  released (each training step's backward releases all of them), so they stop growing after
  the first step; `reset` frees them. Without partitioned activations there is nothing to place
  (accepted, warned once: the non-reentrant checkpoint's whole inputs are ordinary tensors).
- ``number_checkpoints``: the default number of segments of `checkpoint_sequential`.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from tachyon.config import ActivationCheckpointingConfig, ConfigError, TachyonConfig, load_config, read_config_file
from tachyon.fp8.checkpoint import fp8_checkpoint_context_fn

__all__ = [
    "CheckpointingSettings", "checkpoint", "checkpoint_sequential", "configure", "get_profile",
    "get_settings", "is_configured", "log_profile", "non_reentrant_checkpoint", "reset", "reset_profile",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointingSettings:
    """The active settings; field names are the config section's keys."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


_settings = CheckpointingSettings()
_configured = False
_tp: Any = None
"""The tensor-parallel group partition_activations splits over (a TPGroup), None: no split."""
_warned: set[str] = set()


def _empty_stats() -> dict[str, Any]:
    return {"calls": 0, "recomputes": 0, "recompute_s": 0.0, "offloaded_tensors": 0, "offloaded_bytes": 0,
            "partitioned_tensors": 0, "partitioned_bytes": 0, "contiguous_buffers": 0, "contiguous_bytes": 0}


_stats = _empty_stats()


# --------------------------------------------------------------------------- configure


def _section_from(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a TachyonConfig, a dict or a JSON file path."""
    if isinstance(deepspeed_config, TachyonConfig):
        return deepspeed_config.activation_checkpointing
    if isinstance(deepspeed_config, (str, os.PathLike)):
        path = Path(deepspeed_config)
        if not path.is_file():
            raise ConfigError(f"deepspeed_config: file not found: {str(path)!r}")
        deepspeed_config = read_config_file(path)  # JSON, or Hjson as DeepSpeed reads config files
    if not isinstance(deepspeed_config, Mapping):
        raise ValueError(
            "deepspeed_config should be a TachyonConfig, a dict or a path to a JSON file; "
            f"got {type(deepspeed_config).__name__}"
        )
    if "activation_checkpointing" not in deepspeed_config:
        stray = sorted(set(deepspeed_config) & set(ActivationCheckpointingConfig.model_fields))
        if stray:
            raise ValueError(
                f"deepspeed_config has {stray} at the top level; pass the whole config, "
                '{"activation_checkpointing": {...}}, not the section'
            )
        return ActivationCheckpointingConfig()
    # Validate the section with the config loader's key checks (did-you-mean, types); the batch
    # size is a placeholder, the rest of the config is the engine's to check.
    probe = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": deepspeed_config["activation_checkpointing"]}
    return load_config(probe).activation_checkpointing


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def _tensor_parallel(mpu: Any) -> Any:
    """The mpu's tensor-parallel group as a TPGroup (size 1: none needed)."""
    for prefix in ("get_tensor_model_parallel", "get_slice_parallel", "get_model_parallel"):
        size = getattr(mpu, f"{prefix}_world_size", None)
        if not callable(size):
            continue
        size = int(size())
        if size == 1:
            return None
        rank, group = getattr(mpu, f"{prefix}_rank", None), getattr(mpu, f"{prefix}_group", None)
        if not (callable(rank) and callable(group)):
            raise ValueError(f"mpu_ has {prefix}_world_size() = {size} but not {prefix}_rank() and {prefix}_group(), "
                             "which partition_activations needs to split and gather the saved inputs")
        from tachyon.parallel.tensor.comm import TPGroup

        return TPGroup(group(), size, int(rank()))
    raise ValueError(
        "mpu_ should have get_tensor_model_parallel_world_size() or get_model_parallel_world_size(); "
        f"got {type(mpu).__name__}"
    )


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the checkpointing options (DeepSpeed's signature); later `checkpoint` calls use them.

    ``deepspeed_config`` (a TachyonConfig, a DeepSpeed-style dict or a JSON path) supplies the
    ``activation_checkpointing`` section; each keyword that is not None overrides its key:
    partition_activations, contiguous_checkpointing -> contiguous_memory_optimization,
    num_checkpoints -> number_checkpoints, checkpoint_in_cpu -> cpu_checkpointing,
    synchronize -> synchronize_checkpoint_boundary, profile. ``mpu_`` is a model-parallel unit
    (Megatron-style, or ``engine.mpu``): partition_activations splits over its tensor-parallel
    group. Calling it again replaces all settings (keys not given return to their defaults).
    Raises ValueError (ConfigError for config problems) naming the setting.
    """
    global _settings, _configured, _tp
    section = _section_from(deepspeed_config) if deepspeed_config is not None else ActivationCheckpointingConfig()
    settings = CheckpointingSettings(**section.model_dump())
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "number_checkpoints":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"num_checkpoints must be a positive int or None; got {value!r}")
        elif not isinstance(value, bool):
            raise ValueError(f"{key} must be True, False or None; got {value!r}")
        settings = replace(settings, **{key: value})
    if settings.cpu_checkpointing and not settings.partition_activations:
        raise ValueError(
            "cpu_checkpointing (checkpoint_in_cpu) needs partition_activations=True, as in DeepSpeed "
            "(CPU checkpointing moves the partitioned activations)"
        )
    tp = None
    if settings.partition_activations:
        tp = None if mpu_ is None else _tensor_parallel(mpu_)
        if tp is None:
            _warn_once(
                "partition",
                "activation_checkpointing.partition_activations has no effect with tensor-parallel size 1: "
                "there is nothing to partition across",
            )
    if settings.contiguous_memory_optimization and tp is None:
        _warn_once(
            "contiguous",
            "activation_checkpointing.contiguous_memory_optimization has no effect without partition_activations "
            "over a tensor-parallel group: it places the partitioned slices in preallocated buffers, and tachyon's "
            "non-reentrant checkpointing leaves whole inputs to the caching allocator",
        )
    _settings, _configured, _tp = settings, True, tp
    _buffers.clear()
    logger.info("activation checkpointing configured: %s", asdict(settings))


def is_configured() -> bool:
    """True after `configure` (DeepSpeed's name); `checkpoint` also works unconfigured, with defaults."""
    return _configured


def get_settings() -> CheckpointingSettings:
    """The settings in effect (defaults until `configure`)."""
    return _settings


def reset() -> None:
    """Back to the unconfigured defaults; clears the profile counters and the warn-once memory,
    and frees contiguous_memory_optimization's buffers."""
    global _settings, _configured, _stats, _tp
    _settings, _configured, _stats, _tp = CheckpointingSettings(), False, _empty_stats(), None
    _warned.clear()
    _buffers.clear()


# --------------------------------------------------------------------------- profile


def get_profile() -> dict[str, Any]:
    """Counters since the last reset: ``calls`` (checkpointed forwards), ``recomputes``,
    ``recompute_s`` (seconds recomputing; measured only with profile on, else 0.0),
    ``offloaded_tensors`` / ``offloaded_bytes`` (region inputs stored through the CPU
    checkpointing hook; inputs already in CPU memory are counted and kept as they are),
    ``partitioned_tensors`` / ``partitioned_bytes`` (inputs split by partition_activations and
    the bytes this rank keeps of them), ``contiguous_buffers`` / ``contiguous_bytes`` (buffers
    contiguous_memory_optimization allocated, and their size)."""
    return dict(_stats)


def reset_profile() -> None:
    global _stats
    _stats = _empty_stats()


def log_profile() -> str:
    """Log the counters at INFO and return the line."""
    s = _stats
    line = (
        f"activation checkpointing: {s['calls']} checkpointed calls, {s['recomputes']} recomputations "
        f"taking {s['recompute_s'] * 1e3:.2f} ms, {s['offloaded_tensors']} inputs "
        f"({s['offloaded_bytes'] / 2**20:.2f} MiB) kept in CPU memory"
    )
    logger.info(line)
    return line


# --------------------------------------------------------------------------- checkpoint


def _cuda_synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _synchronize_boundary() -> None:
    if _settings.synchronize_checkpoint_boundary:
        _cuda_synchronize()


def _pack_to_cpu(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    if tensor.numel() == 0:  # torch 2.11's checkpoint saves an empty holder tensor too: nothing to move
        return tensor.device, tensor
    _stats["offloaded_tensors"] += 1
    _stats["offloaded_bytes"] += tensor.numel() * tensor.element_size()
    if tensor.device.type == "cpu":
        return tensor.device, tensor
    host = torch.empty_like(tensor, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(tensor, non_blocking=True)
    return tensor.device, host


def _unpack_from_cpu(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, tensor = packed
    return tensor.to(device, non_blocking=True)


class _Slot:
    """A slice handed out by a `_Pool`; the pool counts it live until this object is released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Pool:
    """contiguous_memory_optimization's buffers of one (device, dtype) (module docstring): slices
    are handed out in order, each a view of a buffer; a buffer that cannot fit the next slice is
    left for the next one (a new buffer is allocated after the last); everything is handed out
    again from the first buffer once no slice is live."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.index = self.offset = self.live = 0

    def _release(self) -> None:
        self.live -= 1

    def take(self, source: torch.Tensor, device: torch.device) -> _Slot:
        numel = source.numel()
        if self.live == 0:
            self.index = self.offset = 0
        while self.index < len(self.buffers) and self.offset + numel > self.buffers[self.index].numel():
            self.index, self.offset = self.index + 1, 0
        if self.index == len(self.buffers):
            size = numel * (_settings.number_checkpoints or 8)
            pin = device.type == "cpu" and torch.cuda.is_available()
            self.buffers.append(torch.empty(size, dtype=source.dtype, device=device, pin_memory=pin))
            _stats["contiguous_buffers"] += 1
            _stats["contiguous_bytes"] += size * source.element_size()
        view = self.buffers[self.index].narrow(0, self.offset, numel)
        view.copy_(source.reshape(-1), non_blocking=True)
        self.offset += numel
        self.live += 1
        slot = _Slot(view)
        weakref.finalize(slot, self._release)
        return slot


_buffers: dict[tuple[torch.device, torch.dtype], _Pool] = {}


def _pack_partitioned(tensor: torch.Tensor) -> tuple:
    """Keep this rank's 1/tp slice of a region input (module docstring): in a contiguous buffer
    with contiguous_memory_optimization, in CPU memory with cpu_checkpointing. Saved: the slice,
    the shape and the device."""
    tp = _tp
    whole = (tp is None or tensor.numel() == 0 or tensor.numel() % tp.size or not tensor.is_floating_point()
             or (tensor.is_leaf and tensor.requires_grad))  # parameters: sharded ones differ per rank
    if whole:
        return ("whole", _pack_to_cpu(tensor) if _settings.cpu_checkpointing else tensor)
    part = tensor.detach().reshape(-1).chunk(tp.size)[tp.rank]
    _stats["partitioned_tensors"] += 1
    _stats["partitioned_bytes"] += part.numel() * part.element_size()
    if _settings.contiguous_memory_optimization:
        where = torch.device("cpu") if _settings.cpu_checkpointing else part.device
        if _settings.cpu_checkpointing:
            _stats["offloaded_tensors"] += 1
            _stats["offloaded_bytes"] += part.numel() * part.element_size()
        pool = _buffers.setdefault((where, part.dtype), _Pool())
        return ("slot", tensor.shape, tensor.device, pool.take(part, where))
    part = part.clone()
    return ("part", tensor.shape, _pack_to_cpu(part) if _settings.cpu_checkpointing else (part.device, part))


def _unpack_partitioned(packed: tuple) -> torch.Tensor:
    if packed[0] == "whole":
        return _unpack_from_cpu(packed[1]) if _settings.cpu_checkpointing else packed[1]
    from tachyon.parallel.tensor.comm import all_gather_along

    if packed[0] == "slot":
        _, shape, device, slot = packed
        part = slot.tensor.to(device, non_blocking=True)
    else:
        _, shape, stored = packed
        part = _unpack_from_cpu(stored)
    return all_gather_along(part, _tp, 0).view(shape)


_FP8_CONTEXT_FN = fp8_checkpoint_context_fn()


class _Region:
    """The checkpointed function: its first call is the forward, later calls are recomputations
    (timed when profiling; CUDA synchronized at the boundaries when asked)."""

    def __init__(self, function: Callable[..., Any], profile: bool):
        self.function = function
        self.profile = profile
        self.forward_done = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.forward_done:
            self.forward_done = True
            return self.function(*args, **kwargs)
        _stats["recomputes"] += 1
        synchronize = self.profile or _settings.synchronize_checkpoint_boundary
        if synchronize:
            _cuda_synchronize()
        start = time.perf_counter()
        try:  # checkpoint's early stop ends a recomputation with an exception: time it too
            return self.function(*args, **kwargs)
        finally:
            if synchronize:
                _cuda_synchronize()
            if self.profile:
                elapsed = time.perf_counter() - start
                _stats["recompute_s"] += elapsed
                name = getattr(self.function, "__name__", type(self.function).__name__)
                logger.debug("recomputed checkpointed %s in %.3f ms", name, elapsed * 1e3)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)``, keeping only its inputs for backward.

    Returns what ``function`` returns (same shapes and dtypes). Saved for backward: the tensor
    inputs (1/tp of each with partition_activations over a tensor-parallel group; in CPU memory
    with cpu_checkpointing), the CPU/CUDA RNG states and, for each FP8 GEMM
    call inside, the 0-dim scales it used; the function runs again in the backward with the same
    RNG state and the same fp8_autocast settings and scales (tachyon.fp8.checkpoint). Without grad
    enabled it simply runs the function.
    """
    if not callable(function):
        raise ValueError(f"checkpoint: function must be callable; got {type(function).__name__}")
    _stats["calls"] += 1
    region = _Region(function, _settings.profile)
    if _settings.partition_activations and _tp is not None:
        storage = torch.autograd.graph.saved_tensors_hooks(_pack_partitioned, _unpack_partitioned)
    elif _settings.cpu_checkpointing:
        storage = torch.autograd.graph.saved_tensors_hooks(_pack_to_cpu, _unpack_from_cpu)
    else:
        storage = nullcontext()
    _synchronize_boundary()
    with storage:
        out = torch_checkpoint.checkpoint(
            region, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_FP8_CONTEXT_FN, **kwargs
        )
    _synchronize_boundary()
    return out


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant checkpoint (``pipeline.use_reentrant: false`` selects it
for a PipelineModule): tachyon's `checkpoint`, which is non-reentrant always."""


def _run_segment(functions: list[Callable[..., Any]]) -> Callable[[Any], Any]:
    def segment(x: Any) -> Any:
        for fn in functions:
            x = fn(x)
        return x

    return segment


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[..., Any]], segments: int | None = None, input: Any = None
) -> Any:
    """Run ``functions`` one after another on ``input`` in ``segments`` checkpointed chunks.

    Like torch.utils.checkpoint.checkpoint_sequential: chunks of ``len // segments`` functions
    (the last takes the remainder); every chunk but the last is checkpointed, the last runs
    normally because its activations are needed right away. ``segments`` defaults to the
    configured ``number_checkpoints``.
    """
    fns = list(functions.children()) if isinstance(functions, torch.nn.Sequential) else list(functions)
    if not fns:
        raise ValueError("checkpoint_sequential: functions is empty")
    if segments is None:
        segments = _settings.number_checkpoints
        if segments is None:
            raise ValueError("checkpoint_sequential: give segments or configure number_checkpoints")
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(fns):
        raise ValueError(f"segments must be an int in [1, {len(fns)}] (the number of functions); got {segments!r}")
    size = len(fns) // segments
    x = input
    for start in range(0, size * (segments - 1), size):
        x = checkpoint(_run_segment(fns[start : start + size]), x)
    return _run_segment(fns[size * (segments - 1) :])(x)
