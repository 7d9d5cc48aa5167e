"""Pieces of the ``tachyon train`` loop that do not decide anything: ranks and threads, the
per-rank data order and seeds, checkpoints by step, memory per rank."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tachyon.data import collate

__all__ = ["Checkpointer", "epoch_loader", "mean_over_ranks", "memory_per_rank", "or_nan", "rank_and_world",
           "rank_seed", "reseed_kernel_dropout", "set_threads", "usable_cpus"]


def rank_seed(seed: int, rank: int) -> int:
    """Each rank's dropout seed: ranks see different data, so they draw different masks."""
    return (seed * 1_000_003 + rank) % 2**62


def reseed_kernel_dropout(model: torch.nn.Module, seed: int) -> None:
    """Give the fused BERT layers this rank's dropout seed again after a checkpoint load (the
    checkpoint holds one rank's seeds); their forward counters stay as loaded."""
    for module in model.modules():
        if hasattr(module, "dropout_seed") and hasattr(module, "dropout_calls"):
            module.dropout_seed = seed


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise mean of ``values`` over the data-parallel ranks (the values themselves alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup (v2) CPU quota
    (a container limited to 2 CPUs on a 64-core host has 2, where ``os.cpu_count()`` says 64)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def native_bf16() -> bool:
    """Whether this machine computes bf16 natively, which is what the job's ``"precision": "auto"``
    asks: a CUDA GPU with bf16, or a CPU whose oneDNN has bf16 kernels (AVX-512 / AMX). On other
    CPUs (AVX2) torch still runs bf16, but its matmuls are emulated: about 10x slower than fp32
    (a 2048x128 by 128x512 GEMM, one thread: 77.7 vs 7.6 ms on an AVX2 EPYC), so "auto" trains in
    fp32 there."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no native bf16 kernels
        return False


def set_threads(threads_per_process: int | None, world: int) -> None:
    """torch intra-op threads on CPU: ``threads_per_process``, else the usable CPUs (`usable_cpus`)
    shared by the local ranks. The thread count changes how reductions are split, so it is one
    of the things a run's numbers depend on (summary.txt records it)."""
    if torch.cuda.is_available():
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.set_num_threads(threads_per_process or max(1, usable_cpus() // max(local_world, 1)))


def epoch_loader(dataset: Any, sampler: Any, epoch: int, skip_batches: int, micro_batch: int) -> DataLoader:
    """This rank's micro-batches of ``epoch``, starting after the first ``skip_batches``.

    The loader gets a generator of its own: a DataLoader draws a seed from its generator each
    time it is iterated, and torch's default one is the stream of the training-time random
    decisions (progressive layer drop, the TE-style layers' dropout), which the checkpoint saves
    and ``--resume`` restores. Left on the default generator, a resumed run (which opens a new
    loader mid-epoch) would draw different decisions than the run it continues."""
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)  # fresh masked-LM masks per epoch
    indices = list(sampler)[skip_batches * micro_batch:]
    return DataLoader(dataset, batch_size=micro_batch, sampler=indices, collate_fn=collate, generator=torch.Generator())


def or_nan(value: float | None) -> float:
    return math.nan if value is None else value


class Checkpointer:
    """engine.save_checkpoint / load_checkpoint into ``directory``, each tag saved once."""

    def __init__(self, engine: Any, directory: Path) -> None:
        self.engine, self.directory = engine, directory
        self.saved: list[str] = []

    def save(self, step: int, client_state: dict[str, Any]) -> None:
        tag = f"global_step{step}"
        if tag in self.saved:
            return
        self.engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state)
        self.saved.append(tag)

    def load(self) -> dict[str, Any] | None:
        """The client state of the latest checkpoint, or None when there is none to load."""
        if not self.directory.is_dir():
            return None
        path, client_state = self.engine.load_checkpoint(str(self.directory))
        if path is None:
            return None
        return dict(client_state or {})


def memory_per_rank(engine: Any, device: torch.device) -> list[dict[str, float]]:
    """Every rank's engine.memory_breakdown() (bytes) plus its peak memory, gathered on all ranks."""
    mine = {k: float(v) for k, v in engine.memory_breakdown().items()}
    if device.type == "cuda":
        mine["peak_allocated"] = float(torch.cuda.max_memory_allocated(device))
    else:
        try:
            import resource  # POSIX only
        except ImportError:
            resource = None
        if resource is not None:  # ru_maxrss is KiB on Linux, bytes on macOS
            scale = 1 if sys.platform == "darwin" else 1024
            mine["peak_rss"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered
    return [mine]
