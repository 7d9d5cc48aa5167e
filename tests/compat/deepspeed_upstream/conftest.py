"""DeepSpeed's own unit tests (vendored from deepspeedai/DeepSpeed at commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641, files unchanged, Apache-2.0) run against
tachyon.compat.deepspeed: ``import deepspeed`` resolves to tachyon's compat layer and
``unit.common`` / ``unit.simple_model`` / ``unit.util`` to the stand-ins in ./unit (`_alias`).

Not part of the default suite: these files are collected only when the ``deepspeed_upstream``
marker is selected (docs/compat.md):

    .venv/bin/python -m pytest -p no:cacheprovider tests/compat/deepspeed_upstream -m deepspeed_upstream
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

HERE = Path(__file__).parent


# tests/compat/conftest.py skips this directory unless the marker is selected, so the alias is
# installed only in runs of these tests (before pytest imports the vendored modules)
from tests.compat.deepspeed_upstream import _alias  # noqa: E402

_alias.install()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.deepspeed_upstream)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    cls = getattr(pyfuncitem, "cls", None)
    if cls is None or not getattr(cls, "is_dist_test", False):
        return None
    from tests.compat.deepspeed_upstream.unit.common import run_in_ranks

    names = inspect.signature(pyfuncitem.obj).parameters
    kwargs = {name: pyfuncitem.funcargs[name] for name in names if name in pyfuncitem.funcargs}
    world_size = kwargs.pop("world_size", None) if "world_size" in kwargs else None
    if world_size is None:
        world_size = cls.world_size
    sizes = world_size if isinstance(world_size, list) else [world_size]
    for size in sizes:
        run_in_ranks(pyfuncitem, kwargs, size)
    return True
