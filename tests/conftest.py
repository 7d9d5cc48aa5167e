"""Test-wide set-up: Triton's CPU interpreter where there is no GPU, the gpu marker's skip, the
files ordered costliest first from tests/durations.json (`tests.utils.costs`; with
TACHYON_RECORD_TEST_COSTS=PATH a run records that table), and (with TACHYON_FAILURE_LOG set, as
benchmarks/gpu.sh does) each failure written to that file the moment it is reported, so a run
stopped by a time limit still names the tests that failed."""

from __future__ import annotations

import os

import pytest
import torch

from tests.utils import costs
from tests.utils.interpreter import enable_interpreter

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    enable_interpreter()  # before anything imports triton

_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 1:
    # `make test` runs one pytest-xdist worker per core: each worker's torch takes its share of the
    # cores instead of every worker starting one thread per core (oversubscribed OpenMP threads spin)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))


def pytest_configure(config):
    costs.register(config)
    if hasattr(config.option, "loadscopereorder"):
        # pytest-xdist >= 3.6 otherwise hands out --dist loadfile's files by their number of
        # tests, most first, whatever the collection order: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # `make test`'s pytest-xdist workers (--dist loadfile) take whole files in this order, the
    # next one as they finish one: costliest first, so that short files fill the end instead of
    # a long file starting last and running alone
    costs.order_by_cost(items, costs.load_costs())
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine has none); run by benchmarks/gpu.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("TACHYON_FAILURE_LOG")
    # under pytest-xdist the controller receives every worker's reports: write from it alone
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def _seed_and_backend():
    """Every test starts from the same RNG state and the "auto" backend."""
    import tachyon

    torch.manual_seed(0)
    tachyon.set_backend("auto")
    yield
    tachyon.set_backend("auto")
