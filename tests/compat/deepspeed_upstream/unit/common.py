"""Stand-in for DeepSpeed's tests/unit/common.py: ``DistributedTest`` runs a test method on
``world_size`` gloo ranks. One rank runs in the pytest process (a process group of one, torn down
after the test); several run as spawned processes through tests.utils.run_distributed, each
importing the test module and calling the method with the test's (picklable) arguments.
As in DeepSpeed's: ``@pytest.mark.world_size(n)`` overrides the class's ``world_size``,
``init_distributed = False`` leaves the process group to the test, ``set_dist_env = False`` (one
rank) leaves the environment alone, a ``pytest.skip`` on the ranks skips the test, the
``class_tmpdir`` fixture (the conftest's) is shared by a class's tests, and a ``DistributedFixture`` subclass is a
fixture whose ``run`` executes on its ``world_size`` ranks before the test (the conftest registers it)."""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import pytest
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
    """Subclass with a ``run(self, ...)`` method; a test naming the class as an argument has ``run``
    executed on ``world_size`` ranks first (its arguments are fixtures; it returns nothing)."""

    is_dist_test = False
    is_dist_fixture = True


_SKIPPED = "__skipped__"


def _run_rank(module_file: str, module_name: str, class_name: str, method: str, kwargs: dict):
    from tests.compat.deepspeed_upstream import _alias

    _alias.install()
    spec = importlib.util.spec_from_file_location(module_name, module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance = getattr(module, class_name)()
    try:
        getattr(instance, method)(**kwargs)
    except pytest.skip.Exception as skip:
        return (_SKIPPED, skip.msg)
    return None


def _skip_if_skipped(results) -> None:
    skips = [r[1] for r in results if isinstance(r, tuple) and r and r[0] == _SKIPPED]
    if skips:
        pytest.skip(skips[0])


def _one_rank(cls, call) -> None:
    import tachyon

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())} if cls.set_dist_env else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if cls.init_distributed:
            tachyon.init_distributed(dist_backend="gloo")
        call()
    finally:
        if torch.distributed.is_initialized():
            tachyon.shutdown_distributed(barrier=False)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_in_ranks(item, kwargs: dict, world_size: int) -> None:
    """Run ``item``'s test method on ``world_size`` ranks (the pytest hook calls this)."""
    from tests.utils.distributed import run_distributed

    cls = item.cls
    if world_size == 1:
        _one_rank(cls, lambda: item.obj(**kwargs))
        return
    module = inspect.getmodule(item.obj)
    results = run_distributed(_run_rank, world_size, module.__file__, module.__name__, cls.__name__,
                              item.name.split("[")[0], kwargs, timeout=DistributedExec.exec_timeout,
                              init=cls.init_distributed)
    _skip_if_skipped(results)


def run_fixture(cls, module, kwargs: dict) -> None:
    """Run the DistributedFixture ``cls``'s ``run(**kwargs)`` on its ``world_size`` ranks."""
    from tests.utils.distributed import run_distributed

    if not isinstance(cls.world_size, int):
        raise TypeError(f"a DistributedFixture takes one world_size; {cls.__name__} has {cls.world_size!r}")
    if cls.world_size == 1:
        _one_rank(cls, lambda: cls().run(**kwargs))
        return
    results = run_distributed(_run_rank, cls.world_size, module.__file__, module.__name__, cls.__name__, "run",
                              kwargs, timeout=DistributedExec.exec_timeout, init=cls.init_distributed)
    _skip_if_skipped(results)
