"""tests.utils.costs: the order of test files from the cost table (costliest first, a file's tests
together and in order, files missing from the table estimated), the table's merge, and the
recorder's CPU figure counting the processes a test starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.utils import costs, distributed


class _Item:
    """What order_by_cost reads of a pytest item: its node id and its markers."""

    def __init__(self, nodeid: str, distributed: bool = False) -> None:
        self.nodeid, self.distributed = nodeid, distributed

    def get_closest_marker(self, name: str):
        return object() if name == "distributed" and self.distributed else None

    def __repr__(self) -> str:
        return self.nodeid


def _ids(items) -> list[str]:
    return [item.nodeid for item in items]


def test_files_run_costliest_first_with_their_tests_together_and_in_order():
    items = [_Item("a.py::t1"), _Item("b.py::t1"), _Item("a.py::t2"), _Item("c.py::t1", True),
             _Item("b.py::t2"), _Item("c.py::t2", True), _Item("a.py::t3")]
    costs.order_by_cost(items, {"a.py": 5.0, "b.py": 50.0, "c.py": 20.0})
    assert _ids(items) == ["b.py::t1", "b.py::t2", "c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2", "a.py::t3"]


def test_equal_costs_keep_the_collection_order():
    items = [_Item("z.py::t"), _Item("y.py::t"), _Item("x.py::t")]
    costs.order_by_cost(items, {"x.py": 1.0, "y.py": 1.0, "z.py": 1.0})
    assert _ids(items) == ["z.py::t", "y.py::t", "x.py::t"]


def test_files_missing_from_the_table():
    # a new multi-process file counts as the costliest known file (it starts first, before a known
    # file of that cost); a new single-process file as the median one, after the known files of
    # that cost
    items = [_Item("cheap.py::t"), _Item("new.py::t"), _Item("mid.py::t"), _Item("new_multi.py::t", True),
             _Item("big.py::t")]
    costs.order_by_cost(items, {"cheap.py": 1.0, "mid.py": 10.0, "big.py": 100.0, "gone.py": 1000.0})
    assert costs.files_in(items) == ["new_multi.py", "big.py", "mid.py", "new.py", "cheap.py"]


def test_without_a_table_multi_process_files_come_first():
    items = [_Item("a.py::t"), _Item("b.py::t1"), _Item("b.py::t2", True), _Item("c.py::t")]
    costs.order_by_cost(items, {})
    assert _ids(items) == ["b.py::t1", "b.py::t2", "a.py::t", "c.py::t"]


def test_the_committed_table_names_existing_files_and_orders_the_costly_ones_first():
    table = costs.load_costs()
    root = costs.TABLE.parents[1]
    assert len(table) > 100, "tests/durations.json is missing or nearly empty"
    missing = [name for name in table if not (root / name).is_file()]
    assert not missing, f"tests/durations.json names files that do not exist: {missing}"
    assert all(cost >= 0 for cost in table.values())


def test_merge_keeps_other_files_rows(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"a.py": {"cpu_s": 3.0, "wall_s": 2.0}, "b.py": {"cpu_s": 1.0, "wall_s": 1.0}}))
    costs.merge_costs(path, {"b.py": {"cpu_s": 7.04, "wall_s": 4.0}, "c.py": {"cpu_s": 0.5, "wall_s": 0.25}})
    assert json.loads(path.read_text()) == {
        "a.py": {"cpu_s": 3.0, "wall_s": 2.0}, "b.py": {"cpu_s": 7.0, "wall_s": 4.0}, "c.py": {"cpu_s": 0.5, "wall_s": 0.2}}
    assert costs.load_costs(path) == {"a.py": 3.0, "b.py": 7.0, "c.py": 0.5}
    assert costs.load_costs(tmp_path / "none.json") == {}


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_cpu_figure_counts_subprocesses_and_forkserver_ranks():
    before = costs.process_cpu()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                    "while time.process_time() < end: pass"], check=True)
    after_subprocess = costs.process_cpu()
    assert after_subprocess - before >= 0.45
    proc = distributed._context().Process(target=_spin, args=(0.5,))  # run_distributed's forkserver
    proc.start()
    proc.join()
    assert proc.exitcode == 0
    # the forkserver reaps its children; its /proc entry's cutime/cstime then include them
    deadline = time.monotonic() + 5
    while costs.process_cpu() - after_subprocess < 0.45 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert costs.process_cpu() - after_subprocess >= 0.45


def test_xdist_keeps_the_collection_order_of_files(request):
    """pytest-xdist's loadfile scheduler reorders files by their number of tests unless told not to;
    conftest tells it not to, so that the costliest-first order reaches the workers."""
    import pytest

    pytest.importorskip("xdist")
    assert request.config.option.loadscopereorder is False
