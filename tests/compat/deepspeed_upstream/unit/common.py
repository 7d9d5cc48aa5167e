"""Stand-in for DeepSpeed's tests/unit/common.py: ``DistributedTest`` runs a test method on
``world_size`` gloo ranks. One rank runs in the pytest process (a process group of one, torn down
after the test); several run as spawned processes through tests.utils.run_distributed, each
importing the test module and calling the method with the test's (picklable) arguments."""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import torch

from tests.utils.distributed import free_port


def get_master_port(base_port: int = 29500, port_range_size: int = 1000) -> str:
    return str(free_port())


def get_test_path(filename: str) -> str:
    return str(Path(__file__).parent.joinpath(filename))


def preferred_dtype() -> torch.dtype:
    return torch.bfloat16  # DeepSpeed's choice on a machine that supports bf16 (tachyon does on CPU)


class DistributedExec:
    world_size = 2
    backend = "gloo"
    init_distributed = True
    set_dist_env = True
    requires_cuda_env = False
    reuse_dist_env = False
    non_daemonic_procs = False
    exec_timeout = 600
    is_dist_test = True


class DistributedTest(DistributedExec):
    """Subclass and write ``test_*`` methods; ``world_size`` (int or list) is how many ranks run each."""


class DistributedFixture(DistributedExec):
    """Not provided by the stand-in (its tests that need one fail at set-up)."""

    is_dist_fixture = True

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the DistributedTest stand-in has no DistributedFixture")


def _run_rank(module_file: str, module_name: str, class_name: str, method: str, kwargs: dict):
    from tests.compat.deepspeed_upstream import _alias

    _alias.install()
    spec = importlib.util.spec_from_file_location(module_name, module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance = getattr(module, class_name)()
    getattr(instance, method)(**kwargs)


def run_in_ranks(item, kwargs: dict, world_size: int) -> None:
    """Run ``item``'s test method on ``world_size`` ranks (the pytest hook calls this)."""
    from tests.utils.distributed import run_distributed

    if world_size == 1:
        import tachyon

        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            tachyon.init_distributed(dist_backend="gloo")
            item.obj(**kwargs)
        finally:
            tachyon.shutdown_distributed(barrier=False)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return
    module = inspect.getmodule(item.obj)
    run_distributed(_run_rank, world_size, module.__file__, module.__name__, item.cls.__name__, item.name.split("[")[0],
                    kwargs, timeout=DistributedExec.exec_timeout)
