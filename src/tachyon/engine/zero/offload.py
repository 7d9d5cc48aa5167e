"""ZeRO-Offload: the fp32 master weights, optimizer states and the optimizer step in host memory.

``zero_optimization.offload_optimizer: {"device": "cpu", "pin_memory": true}`` at stages 1-3:

- stages 1 and 2 (tachyon's flat partitions, `tachyon.engine.zero.stages`): each rank's fp32
  master partition and its optimizer states live on the host; the gradient partition
  accumulator is an fp32 host buffer, and each bucket's reduce-scattered chunk is added into it
  as soon as its reduction completes, during the backward (DeepSpeed's ZeRO-Offload). After the
  step the updated partition is copied back into the device's model buffer and all-gathered.
- stage 3 (`tachyon.engine.zero.stage3`): the sharded parameters stay on the device in the model
  dtype (2 bytes per element for bf16 / fp16), the fp32 master shards and states on the host; at
  the end of every backward each gradient shard is added into an fp32 host accumulator and freed
  on the device; after the step the masters are copied into the device shards.

``offload_param: {"device": "cpu"}`` (stage 3): FSDP2's CPU offload policy keeps the sharded fp32
parameters and their gradients on the host and copies each block's shards to the device when it
is gathered; the masters are those host shards, so the optimizer steps on the host too.

The optimizer step on the host: the config's Adam / AdamW builds tachyon's CPUAdam (DeepSpeed's
DeepSpeedCPUAdam), which runs torch's fused CPU Adam kernel over every host tensor of a param
group in one call; a client FusedAdam is switched to that kernel (`mark_host_optimizer`), any
other client optimizer steps the host tensors as it would any others.
``pin_memory``: the host buffers that are copied to or from the device (masters, gradient
accumulators) are page-locked, when CUDA is there to pin for.

Host memory is checked before anything is built (`check_host_memory`): per rank, masters 4 +
Adam states 8 + gradients 4 bytes per element of the rank's share (16 Psi/N), times the ranks
on this node, against the host's available memory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

HOST = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """Where a strategy keeps what (`plan_of`)."""

    optimizer: bool = False
    """Masters, optimizer states and the fp32 gradient accumulator on the host."""
    params: bool = False
    """Stage 3's sharded parameters and gradients on the host (FSDP2's CPU offload policy)."""
    pin_memory: bool = False

    @property
    def any(self) -> bool:
        return self.optimizer or self.params

    @property
    def pin(self) -> bool:
        """Whether to page-lock host buffers (only meaningful, and only possible, with CUDA)."""
        return self.pin_memory and torch.cuda.is_available()


def plan_of(config: Any) -> OffloadPlan:
    """The offload plan of a `tachyon.config.TachyonConfig`."""
    zero = config.zero_optimization
    pin = any(section is not None and section.pin_memory for section in (zero.offload_optimizer, zero.offload_param))
    return OffloadPlan(optimizer=zero.offloads_optimizer or zero.offloads_params, params=zero.offloads_params,
                       pin_memory=pin)


def host_empty(numel: int, dtype: torch.dtype, plan: OffloadPlan) -> torch.Tensor:
    """An uninitialized 1-D host tensor, pinned when the plan pins."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=plan.pin)


def host_zeros(numel: int, dtype: torch.dtype, plan: OffloadPlan) -> torch.Tensor:
    return host_empty(numel, dtype, plan).zero_()


def mark_host_optimizer(optimizer: Any) -> None:
    """Tell tachyon's FusedAdam its tensors live on the host: it then steps each param group with
    torch's fused CPU Adam kernel (``host_step``)."""
    if optimizer is not None and hasattr(optimizer, "host_step"):
        optimizer.host_step = True


# ---------------------------------------------------------------------- host memory
def available_host_bytes() -> int | None:
    """The host's available memory (MemAvailable from /proc/meminfo; else free pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_state_bytes(num_params: int, shards: int, plan: OffloadPlan, optimizer_state_bytes: int = 8) -> int:
    """Host bytes one rank's offloaded model states take: fp32 masters (4) + optimizer states
    (Adam: 8) + fp32 gradients (4) per element of its 1/``shards`` share of ``num_params``."""
    if not plan.any:
        return 0
    return int(-(-num_params // shards) * (4 + optimizer_state_bytes + 4))


def check_host_memory(num_params: int, shards: int, plan: OffloadPlan, *, local_ranks: int | None = None,
                      available: int | None = None) -> None:
    """ValueError when the offloaded states of every rank on this node would not fit the host's
    available memory (``available`` default: `available_host_bytes`; ``local_ranks`` default:
    LOCAL_WORLD_SIZE, else 1)."""
    if not plan.any:
        return
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if available is None:
        available = available_host_bytes()
    if available is None:
        return
    need = host_state_bytes(num_params, shards, plan) * local_ranks
    if need > available:
        gib = 2**30
        raise ValueError(
            f"zero_optimization offload: the offloaded model states need about {need / gib:.2f} GiB of host memory "
            f"({local_ranks} rank(s) on this node x 16 bytes x {num_params:,} parameters / {shards} shards: fp32 "
            f"masters, Adam's two moments and fp32 gradients), and the host has {available / gib:.2f} GiB available; "
            "use more ranks or nodes, a smaller model, or no offload"
        )


def check_offload_inputs(model: torch.nn.Module, config: Any) -> None:
    """`check_host_memory` for ``model`` under ``config`` (the engine calls it before building
    anything): its trainable parameters over the data-parallel x tensor-parallel ranks."""
    plan = plan_of(config)
    if not plan.any:
        return
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_step = config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps
    dp = max(1, config.train_batch_size // per_step) if per_step else 1
    check_host_memory(num_params, dp * config.tensor_parallel.size, plan)


def offloaded_bytes(tensors, seen: set[int] | None = None) -> int:
    """Bytes of the host storages among ``tensors`` (each storage once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def pinned_bytes(tensors) -> int:
    seen: set[int] = set()
    return offloaded_bytes([t for t in tensors if t is not None and t.device.type == "cpu" and t.is_pinned()], seen)


__all__ = ["HOST", "OffloadPlan", "available_host_bytes", "check_host_memory", "check_offload_inputs", "host_empty", "host_state_bytes",
           "host_zeros", "mark_host_optimizer", "offloaded_bytes", "pinned_bytes", "plan_of"]
