"""Run tachyon's GPU code path on a machine without a GPU, with only the kernel launches stubbed.

Host time (the Python, autograd and launch work between a call and its kernels) decides how fast
a layer runs on a GPU whenever the kernels are short, and it can be measured without a GPU: run
every host step of the CUDA path and replace only the driver's launch. Inside ``StubLaunches``:

- Triton's active driver is a stand-in for an sm_90 GPU (``GPUTarget("cuda", 90, 32)``, 132 SMs,
  228 KiB of shared memory per block). ``@triton.jit`` kernels go through their real
  ``JITFunction.run`` (argument binding, specialization, cache lookup, grid, launch metadata) and
  ``Autotuner.run``; compilation is replaced by a stand-in compiled kernel (host time does not
  depend on the machine code), and its launcher does what Triton's launcher does in Python and
  reads every tensor argument's ``data_ptr()`` as the C launcher does, then records the launch
  instead of calling ``cuLaunchKernel``. An autotuner's benchmark returns equal times, so the
  first surviving config is chosen, once per key, as on a GPU.
- tachyon's ops take their Triton path on CPU tensors (``backend="auto"`` resolves to Triton), and
  device queries (SM count) answer as the GPU would.
- Every other torch op runs for real on the CPU: at the tiny shapes a host-time benchmark uses, a
  CPU kernel costs about what a CUDA launch costs on the host (dispatcher plus a few microseconds).

Use it in a process of its own (it swaps process-wide state: Triton's driver and compiler entry,
tachyon's backend resolution), with TRITON_INTERPRET unset::

    with StubLaunches() as launches:
        layer(x).sum().backward()
    launches.names            # ['_norm_fwd_kernel', ...]: every Triton launch, in order

`benchmarks/bench_host.py` times layers this way against the modules they replace.
"""

from __future__ import annotations

import functools
import types
from typing import Any, NamedTuple

import torch

_new_tuple = tuple.__new__
SM90 = ("cuda", 90, 32)
H100_SMS = 132
H100_SHARED = 232448  # bytes of shared memory a block may use on sm_90
H100_REGS = 65536


class Launch(NamedTuple):
    """One stubbed Triton launch: the kernel's name and its grid."""

    name: str
    grid: tuple[int, int, int]


class _StubUtils:
    """Triton's per-driver ``utils``: device properties and binary loading, answered as sm_90."""

    def __init__(self, sm_count: int) -> None:
        self.sm_count = sm_count

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": H100_SHARED, "multiprocessor_count": self.sm_count, "max_num_regs": H100_REGS,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}

    def load_binary(self, name, kernel, shared, device):
        return 0, 0, 0, 0, 1024  # module, function, n_regs, n_spills, n_max_threads


class _StubLauncher:
    """Stands in for Triton's launcher: reads each pointer argument's ``data_ptr()`` (what the C
    launcher does with a tensor), then records the launch instead of calling the driver."""

    def __init__(self, log: list[Launch], name: str, pointers: tuple[int, ...] | None) -> None:
        self.log, self.name, self.pointers = log, name, pointers

    def __call__(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
                 enter_hook, exit_hook, *args):
        if enter_hook is not None:
            enter_hook(launch_metadata)
        if self.pointers is None:
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    arg.data_ptr()
        else:
            for i in self.pointers:
                args[i].data_ptr()
        self.log.append(_new_tuple(Launch, (self.name, (grid_x, grid_y, grid_z))))  # no Python-level __new__
        if exit_hook is not None:
            exit_hook(launch_metadata)


def _pointer_positions(src: Any) -> tuple[int, ...] | None:
    """Positions of the pointer arguments in a launch's argument list (every argument, constexprs
    included, in signature order), from the compiled source's signature; None if unknown."""
    signature = getattr(src, "signature", None)
    if not isinstance(signature, dict):
        return None
    types = list(signature.values())
    if any(not isinstance(t, str) for t in types):  # tuple arguments: look at each call's values
        return None
    return tuple(i for i, t in enumerate(types) if t.startswith("*"))


class _StubCompiledKernel:
    """What ``triton.compile`` returns, for launching: name, metadata, function handle, launcher."""

    def __init__(self, src: Any, options: dict, log: list[Launch]) -> None:
        self.src = src
        self.name = src.fn.__name__ if hasattr(src, "fn") else str(src)
        fields = {"name": self.name, "num_warps": options.get("num_warps", 4),
                  "num_stages": options.get("num_stages", 3), "num_ctas": 1, "shared": 0,
                  "global_scratch_size": 0, "profile_scratch_size": 0, "launch_cooperative_grid": False,
                  "launch_pdl": False, "target": SM90}
        self.metadata = types.SimpleNamespace(**fields)
        self.packed_metadata = (fields["num_warps"], 1, 0)
        self.function = 0
        self.module = 0
        self.n_regs = self.n_spills = 0
        self.asm = {}
        self.hash = f"stub-{self.name}-{id(self)}"
        self.run = _StubLauncher(log, self.name, _pointer_positions(src))

    def launch_metadata(self, grid, stream, *args):
        return None  # as Triton's when no launch hook is set

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.run(grid[0], grid[1], grid[2], 0, self.function, self.packed_metadata, None, None, None, *args)

        return runner


def _make_driver(stub: StubLaunches):
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StubDriver(DriverBase):
        """Triton's active driver while stubbed: an sm_90 device 0 on stream 0."""

        def __init__(self) -> None:
            super().__init__()
            self.utils = _StubUtils(stub.sm_count)
            self.launcher_cls = None  # compile is stubbed too: kernels carry their own launcher

        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        # Triton's CUDA driver answers these two with C functions (torch._C._cuda_getDevice and
        # _cuda_getCurrentRawStream, one call each per launch): C-level callables here too, so that
        # the stub adds no Python frame the GPU path does not have
        get_current_device = functools.partial(getattr, stub, "device")
        get_current_stream = functools.partial(min, 0)  # min(0, device index): stream 0

        def set_current_device(self, device: int) -> None:
            stub.device = device

        def get_device_capability(self, device: int = 0) -> tuple[int, int]:
            return divmod(stub.capability, 10)

        def get_current_target(self):
            return GPUTarget("cuda", stub.capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cpu

        def get_benchmarker(self):
            def bench(kernel_call, quantiles=None, **_):
                kernel_call()  # the launch happens (and is recorded); every config times the same
                return [1.0, 1.0, 1.0] if quantiles is not None else 1.0

            return bench

        def get_empty_cache_for_benchmark(self):
            return torch.empty(0, dtype=torch.int32)

        def clear_cache(self, cache) -> None:
            return None

    return StubDriver()


class StubLaunches:
    """Context manager: tachyon's GPU path on CPU tensors, Triton launches recorded (see module doc).

    ``names`` lists the launched kernels' names in order, ``launches`` the same with grids;
    ``clear()`` empties both. ``compiles`` lists the kernels "compiled" (one per new specialization,
    as Triton compiles). ``sm_count`` / ``capability`` describe the stand-in GPU (an H100);
    ``device`` is the current device index Triton sees (0; settable, as torch.cuda.set_device).
    """

    def __init__(self, sm_count: int = H100_SMS, capability: int = 90) -> None:
        self.sm_count, self.capability = sm_count, capability
        self.device = 0
        self.launches: list[Launch] = []
        self.compiles: list[str] = []
        self._saved: dict[str, Any] = {}

    @property
    def names(self) -> list[str]:
        return [launch.name for launch in self.launches]

    def clear(self) -> None:
        self.launches.clear()

    def __enter__(self) -> StubLaunches:
        from tachyon import backend

        reason = backend.triton_import_error()
        if reason is not None:
            raise RuntimeError(f"StubLaunches needs Triton: {reason}")
        if backend.triton_interpreting():
            raise RuntimeError(
                "StubLaunches runs Triton's GPU launch path, which TRITON_INTERPRET=1 replaces with the interpreter; "
                "run it in a process started without TRITON_INTERPRET"
            )
        import triton.compiler
        from triton.runtime.driver import driver as driver_config

        from tachyon.kernels import tiling

        log, compiles = self.launches, self.compiles

        def stub_compile(src, target=None, options=None, **_):
            kernel = _StubCompiledKernel(src, dict(options or {}), log)
            compiles.append(kernel.name)
            return kernel

        self._saved = {
            "active": driver_config._active,
            "compile": triton.compiler.compile,
            "stub_sms": tiling.STUB_SMS,
            "backend_stub": backend._launch_stub,
        }
        driver_config.set_active(_make_driver(self))
        triton.compiler.compile = stub_compile
        tiling.STUB_SMS = self.sm_count
        backend._launch_stub = True
        return self

    def __exit__(self, *exc: object) -> None:
        import triton.compiler
        from triton.runtime.driver import driver as driver_config

        from tachyon import backend
        from tachyon.kernels import tiling

        driver_config._active = self._saved["active"]
        triton.compiler.compile = self._saved["compile"]
        tiling.STUB_SMS = self._saved["stub_sms"]
        backend._launch_stub = self._saved["backend_stub"]


__all__ = ["Launch", "StubLaunches"]
