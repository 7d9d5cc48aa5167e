"""``deepspeed.accelerator``: ``get_accelerator()`` for scripts that ask DeepSpeed for the device.

    from tachyon.compat.deepspeed.accelerator import get_accelerator   # from deepspeed.accelerator import ...
    device = get_accelerator().device_name(engine.local_rank)          # "cuda:0", or "cpu"

tachyon runs on CUDA GPUs (NCCL) and on CPUs (gloo), so the accelerator is CUDA when torch sees
a GPU and the CPU otherwise, with DeepSpeed's method names and answers for each: device names
("cuda:N" / "cpu"), device counts, seeds and RNG state, memory counters (0 on the CPU),
``communication_backend_name()`` ("nccl" / "gloo") and the dtypes tachyon trains in there (fp32,
bf16 and fp16 on both: tachyon's fp16 path runs on CPUs too). Streams and graphs are CUDA's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def _cpu_fork_rng(devices: Any = None, enabled: bool = True, _caller: str = "fork_rng",
                  _devices_kw: str = "devices", device_type: str = "cuda") -> Any:
    """torch.random.fork_rng for the CPU accelerator: DeepSpeed passes
    ``device_type=get_accelerator().device_name()``, and torch has no CPU device RNG module to fork
    ("cpu" fails in torch): the CPU generator, which fork_rng always forks, is all there is."""
    if device_type == "cpu":
        return torch.random.fork_rng(devices=[], enabled=enabled, _caller=_caller, _devices_kw=_devices_kw)
    return torch.random.fork_rng(devices, enabled, _caller, _devices_kw, device_type)


class _CpuRandom:
    """``get_accelerator().random()`` without a GPU: torch.random with a ``fork_rng`` that takes
    ``device_type="cpu"``."""

    fork_rng = staticmethod(_cpu_fork_rng)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.random, name)


_CPU_RANDOM = _CpuRandom()


class TachyonAccelerator:
    """DeepSpeed's accelerator interface over torch.cuda, or the CPU when there is no GPU."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._name = "cuda" if self.cuda else "cpu"
        self.Stream = torch.cuda.Stream if self.cuda else None
        self.Event = torch.cuda.Event if self.cuda else None

    # ------------------------------------------------------------------ devices
    def device_name(self, device_index: int | None = None) -> str:
        if not self.cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self.cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self.cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.cuda else 1

    def synchronize(self, device_index: int | None = None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return not self.cuda

    def communication_backend_name(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ------------------------------------------------------------------ dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self.cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    def is_triton_supported(self) -> bool:
        if not self.cuda:
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    # ------------------------------------------------------------------ random numbers
    def random(self) -> Any:
        return torch.random if self.cuda else _CPU_RANDOM

    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self.cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self.cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self.cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self.cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self.cuda else torch.default_generator

    # ------------------------------------------------------------------ memory
    def _memory(self, name: str, device_index: int | None) -> int:
        return getattr(torch.cuda, name)(device_index) if self.cuda else 0

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory("memory_allocated", device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory("max_memory_allocated", device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory("memory_reserved", device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory("max_memory_reserved", device_index)

    memory_cached, max_memory_cached = memory_reserved, max_memory_reserved

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index) if self.cuda else {}

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory if self.cuda else 0

    def available_memory(self, device_index: int | None = None) -> int:
        if not self.cuda:
            return 0
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self.cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self.cuda else False

    # ------------------------------------------------------------------ streams, ranges
    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self.cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self.cuda else None

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> None:
        callback()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"get_accelerator().{name} is not provided by tachyon's accelerator (op builders, CUDA-graph and "
            "compile-backend hooks are DeepSpeed's build machinery, which tachyon has no need of)")


_ACCELERATOR: TachyonAccelerator | None = None


def get_accelerator() -> TachyonAccelerator:
    """The process's accelerator (CUDA when torch sees a GPU, else the CPU)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = TachyonAccelerator()
    return _ACCELERATOR


def set_accelerator(accelerator: TachyonAccelerator) -> None:
    global _ACCELERATOR
    _ACCELERATOR = accelerator


__all__ = ["TachyonAccelerator", "get_accelerator", "set_accelerator"]
