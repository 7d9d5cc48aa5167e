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


def pytest_configure(config):
    for marker in ("inference: DeepSpeed's inference tests", "sequential: DeepSpeed runs these one at a time",
                   "world_size(n): DeepSpeed's per-test override of a DistributedTest's world_size"):
        config.addinivalue_line("markers", marker)


@pytest.fixture(scope="class")
def class_tmpdir(request, tmpdir_factory):
    """DeepSpeed's DistributedTest fixture: a temporary directory shared by a class's tests."""
    return tmpdir_factory.mktemp(request.cls.__name__ if request.cls is not None else request.node.name)


def pytest_pycollect_makeitem(collector, name, obj):
    """A module's DistributedFixture subclass becomes a fixture of that name (DeepSpeed's conftest
    does this through a fixture marker on the class, which this pytest no longer reads)."""
    if not (inspect.isclass(obj) and getattr(obj, "is_dist_fixture", False) and obj.__module__ == collector.obj.__name__):
        return None
    from tests.compat.deepspeed_upstream.unit.common import run_fixture

    params = [p for p in inspect.signature(obj.run).parameters if p != "self"]
    module = collector.obj

    def fixture(**kwargs):
        run_fixture(obj, module, kwargs)

    fixture.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY) for p in params])
    holder = type("DistributedFixtureHolder", (), {name: pytest.fixture(name=name)(fixture)})
    collector.session._fixturemanager.parsefactories(holder=holder, node=collector)
    return []


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
    marker = pyfuncitem.get_closest_marker("world_size")
    world_size = kwargs.pop("world_size", None) if "world_size" in kwargs else None
    if marker is not None:
        world_size = marker.args[0]
    elif world_size is None:
        world_size = cls.world_size
    sizes = world_size if isinstance(world_size, list) else [world_size]
    for size in sizes:
        run_in_ranks(pyfuncitem, kwargs, size)
    return True
