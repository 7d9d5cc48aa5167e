"""Per-file costs of the test suite, and the order of test files they give.

Recording: with ``TACHYON_RECORD_TEST_COSTS=PATH`` set, a run writes (merges into) PATH a JSON
table ``{file: {"cpu_s": ..., "wall_s": ...}}``: the CPU seconds (user + system) the file's tests,
fixtures included, spent in the pytest process and in every process they started (ranks, torchrun
jobs), and their wall seconds. Files the run did not touch keep their rows. The committed table is
regenerated with the suite as CI runs it::

    TACHYON_RECORD_TEST_COSTS=tests/durations.json \\
        .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile tests

CPU time is the figure to order by: on a shared machine the wall time of a file depends on what
else runs, its CPU time much less; and on CI's 2 cores the workers' processes share the cores, so
the suite's length is close to the CPU seconds each worker's files need.

Ordering (`order_by_cost`): pytest-xdist's ``--dist loadfile`` hands whole files to its workers in
collection order (conftest turns off its reordering by number of tests), each worker taking the
next file as it finishes one. Files sorted longest first
(LPT scheduling) leave short files to fill the end, so that no long file starts last and runs
alone. Files missing from the table: those with ``distributed`` tests count as the costliest file
in the table (they start first, as long multi-process files should), the others as the median
file. A file's tests stay together and in their order.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

RECORD_ENV = "TACHYON_RECORD_TEST_COSTS"
TABLE = Path(__file__).resolve().parents[1] / "durations.json"
"""The committed table (tests/durations.json)."""


# ---------------------------------------------------------------------- ordering
def load_costs(path: Path = TABLE) -> dict[str, float]:
    """{file node id: CPU seconds} from a cost table; empty if there is none."""
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return {name: float(row["cpu_s"]) for name, row in rows.items()}


def _file_of(item) -> str:
    return item.nodeid.split("::")[0]


def order_by_cost(items: list, costs: Mapping[str, float],
                  is_multi_process: Callable[[object], bool] | None = None) -> None:
    """Sort ``items`` in place: files by cost, costliest first; each file's tests together, in
    their order; equal costs in collection order. ``is_multi_process(item)`` (default: the item
    has the ``distributed`` marker) decides the estimate for files missing from ``costs``."""
    if is_multi_process is None:
        def is_multi_process(item) -> bool:
            return item.get_closest_marker("distributed") is not None

    first: dict[str, int] = {}
    multi: dict[str, bool] = {}
    for i, item in enumerate(items):
        name = _file_of(item)
        first.setdefault(name, i)
        multi[name] = multi.get(name, False) or bool(is_multi_process(item))
    known = [costs[name] for name in first if name in costs] or list(costs.values())
    most = max(known, default=0.0)
    typical = statistics.median(known) if known else 0.0

    def cost(name: str) -> float:
        if name in costs:
            return costs[name]
        return most if multi[name] else typical

    rank = {name: (-cost(name), not multi[name] and name not in costs, first[name]) for name in first}
    items.sort(key=lambda item: rank[_file_of(item)])  # stable: a file's tests keep their order


# ---------------------------------------------------------------------- recording
def _forkserver_cpu() -> float:
    """CPU seconds of multiprocessing's forkserver and the ranks it forked and reaped (they are
    not this process's children, so RUSAGE_CHILDREN misses them)."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # after the ")": state is field 3, so utime, stime, cutime, cstime (fields 14-17) are [11:15]
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def process_cpu() -> float:
    """CPU seconds of this process, its reaped children and the forkserver's ranks."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _forkserver_cpu()


def merge_costs(path: Path, measured: Mapping[str, Mapping[str, float]]) -> dict:
    """Write ``measured`` rows into the table at ``path``, keeping the rows of other files."""
    path = Path(path)
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        table = {}
    table.update({name: {"cpu_s": round(row["cpu_s"], 1), "wall_s": round(row["wall_s"], 1)}
                  for name, row in measured.items()})
    table = dict(sorted(table.items()))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return table


class CostRecorder:
    """The pytest plugin behind ``TACHYON_RECORD_TEST_COSTS``. Each test phase's report carries
    the CPU seconds since the previous report of this process (a module fixture's set-up lands on
    its first test, its teardown on its last); the controlling process (the only one without
    pytest-xdist, or xdist's controller) sums them per file and writes the table at the end."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.last: float | None = None
        self.measured: dict[str, dict[str, float]] = {}

    def pytest_collection_finish(self, session) -> None:
        self.last = process_cpu()  # collection's imports are no file's cost

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        now = process_cpu()
        spent = now - (self.last if self.last is not None else now)
        self.last = now
        outcome.get_result().user_properties.append(("cpu_s", spent))

    def pytest_runtest_logreport(self, report) -> None:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            return
        row = self.measured.setdefault(report.nodeid.split("::")[0], {"cpu_s": 0.0, "wall_s": 0.0})
        row["wall_s"] += report.duration
        row["cpu_s"] += sum(v for k, v in report.user_properties if k == "cpu_s")

    def pytest_sessionfinish(self, session) -> None:
        if not os.environ.get("PYTEST_XDIST_WORKER") and self.measured:
            merge_costs(self.path, self.measured)


def register(config, environ: Mapping[str, str] = os.environ) -> None:
    """Register the recorder when ``TACHYON_RECORD_TEST_COSTS`` names a file."""
    path = environ.get(RECORD_ENV)
    if path:
        config.pluginmanager.register(CostRecorder(path), "tachyon-test-costs")


def files_in(items: Iterable) -> list[str]:
    """The files of ``items`` in the order they run (each once)."""
    return list(dict.fromkeys(_file_of(item) for item in items))
