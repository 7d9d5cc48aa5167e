"""tachyon launch: the torchrun command it builds (single node, multi-node, hostfile) and a real 2-process run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tachyon.parallel import launch
from tachyon.parallel.launch import build_parser, build_torchrun_command, main, parse_hostfile

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def command(argv):
    return build_torchrun_command(build_parser().parse_args(argv))


def dry_run(argv, capsys):
    code = main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_single_node_uses_standalone_and_passes_script_arguments():
    assert command(["--nproc-per-node", "4", "train.py", "--lr", "3e-4", "-x"]) == [
        *TORCHRUN, "--nproc-per-node", "4", "--standalone", "train.py", "--lr", "3e-4", "-x"]


def test_default_nproc_is_the_cuda_device_count_or_one(capsys):
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 1
    code, out, _ = dry_run(["train.py"], capsys)
    assert code == 0
    assert f"--nproc-per-node not given: {expected}" in out
    assert f"--nproc-per-node {expected} --standalone train.py" in out


def test_dry_run_prints_the_shell_quoted_command_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(launch.subprocess, "call", lambda *a, **k: pytest.fail("dry run must not run anything"))
    code, out, _ = dry_run(["--nproc-per-node", "2", "my train.py", "--name", "a b"], capsys)
    assert code == 0
    line = out.strip().splitlines()[-1]
    assert shlex.split(line) == [*TORCHRUN, "--nproc-per-node", "2", "--standalone", "my train.py", "--name", "a b"]


def test_single_node_with_an_explicit_port_uses_a_static_rendezvous():
    assert command(["--nproc-per-node", "2", "--master-port", "1234", "t.py"]) == [
        *TORCHRUN, "--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0",
        "--master-addr", "127.0.0.1", "--master-port", "1234", "t.py"]


def test_multi_node():
    assert command(["--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1", "--master-addr", "node01", "t.py"]) == [
        *TORCHRUN, "--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "node01", "--master-port", "29500", "t.py"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "t.py"], "--nnodes 2 needs --master-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "t.py"], r"--node-rank must be in \[0, 2\)"),
        (["--nproc-per-node", "0", "t.py"], "--nproc-per-node must be >= 1"),
        (["--nnodes", "0", "t.py"], "--nnodes must be >= 1"),
        (["--master-port", "0", "t.py"], "--master-port must be between 1 and 65535"),
    ],
)
def test_bad_arguments_are_reported(argv, message, capsys):
    with pytest.raises(ValueError, match=message):
        command(argv)
    code, _, err = dry_run(argv, capsys)
    assert code == 2 and "tachyon launch: error:" in err


def write_hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


HOSTS = """# two nodes
worker-0 slots=4   # the master
worker-1 slots=4

"""


def test_hostfile_sets_nodes_slots_master_and_this_nodes_rank(tmp_path, monkeypatch, capsys):
    hostfile = write_hostfile(tmp_path, HOSTS)
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "worker-1.cluster.local")
    code, out, _ = dry_run(["--hostfile", hostfile, "t.py", "--epochs", "1"], capsys)
    assert code == 0
    assert "2 node(s) x 4 process(es), master worker-0:29500" in out
    assert "node rank 1: this host 'worker-1.cluster.local' is line 2 of the hostfile" in out
    assert shlex.split(out.strip().splitlines()[-1]) == [
        *TORCHRUN, "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "worker-0", "--master-port", "29500", "t.py", "--epochs", "1"]


def test_hostfile_node_rank_and_port_can_be_given(tmp_path, monkeypatch):
    hostfile = write_hostfile(tmp_path, HOSTS)
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "elsewhere")
    cmd = command(["--hostfile", hostfile, "--node-rank", "0", "--master-port", "6000", "t.py"])
    assert cmd[cmd.index("--node-rank") + 1] == "0" and cmd[cmd.index("--master-port") + 1] == "6000"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# nothing\n\n", "no hosts in the file"),
        ("", "no hosts in the file"),
        ("a slots=four\n", r"hostfile:1: expected 'hostname slots=N'"),
        ("a\n", r"hostfile:1: expected 'hostname slots=N'"),
        ("a slots=0\n", "slots must be >= 1"),
        ("a slots=1\na slots=1\n", "host 'a' is listed twice"),
    ],
)
def test_bad_hostfiles(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        parse_hostfile(write_hostfile(tmp_path, text))


def test_hostfile_with_unequal_slots(tmp_path):
    with pytest.raises(ValueError, match="every host must have the same slots; got a=4, b=2"):
        command(["--hostfile", write_hostfile(tmp_path, "a slots=4\nb slots=2\n"), "--node-rank", "0", "t.py"])


def test_missing_hostfile(tmp_path):
    with pytest.raises(ValueError, match="--hostfile: file not found"):
        command(["--hostfile", str(tmp_path / "nope"), "t.py"])


def test_hostfile_without_this_host_asks_for_node_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "laptop")
    with pytest.raises(ValueError, match="hostname 'laptop' is not in --hostfile .*pass --node-rank"):
        command(["--hostfile", write_hostfile(tmp_path, HOSTS), "t.py"])


def test_hostfile_conflicts_with_nnodes(tmp_path):
    with pytest.raises(ValueError, match="do not combine it with --nnodes or --master-addr"):
        command(["--hostfile", write_hostfile(tmp_path, HOSTS), "--nnodes", "2", "t.py"])


def test_run_hands_the_command_to_run_torchrun(monkeypatch, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    calls = []
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd: calls.append(cmd) or 3)
    assert main(["--nproc-per-node", "1", str(script)]) == 3
    assert calls == [[*TORCHRUN, "--nproc-per-node", "1", "--standalone", str(script)]]


def test_run_torchrun_returns_the_exit_code_or_the_shells_signal_convention():
    assert launch.run_torchrun([sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert launch.run_torchrun([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]) == 137


def test_a_missing_script_is_refused_before_torchrun_starts(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd: pytest.fail("torchrun must not start"))
    assert main(["--nproc-per-node", "2", str(tmp_path / "missing.py")]) == 2
    assert f"script not found: {str(tmp_path / 'missing.py')!r}" in capsys.readouterr().err


def _count(path: Path) -> int:
    """The step count a rank last wrote (0 before its first write)."""
    text = path.read_text().strip() if path.is_file() else ""
    return int(text) if text else 0


def _launch_and_signal(tmp_path, preemption: str, sig: int) -> tuple[subprocess.CompletedProcess, list[int]]:
    """tachyon launch of _signal_script.py on 2 ranks; once both ranks stepped 3 times, ``sig`` to
    the launcher alone (its own session, so no terminal group gets it). Returns the launcher's
    result and the workers' pids."""
    import os
    import signal
    import time

    script = REPO / "tests" / "parallel" / "_signal_script.py"
    proc = subprocess.Popen([sys.executable, "-m", "tachyon.parallel.launch", "--nproc-per-node", "2", str(script),
                             str(tmp_path), preemption], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    steps = [tmp_path / f"step_{r}" for r in (0, 1)]
    while not all(_count(p) >= 3 for p in steps):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the job did not reach step 3 (exit {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.2)
    pids = [int((tmp_path / f"pid_{r}").read_text()) for r in (0, 1)]
    os.kill(proc.pid, sig)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        pytest.fail("the launcher did not return within 120 s of the signal")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), pids


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").is_file() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.distributed
def test_sigterm_to_the_launcher_stops_every_worker_before_it_returns(tmp_path):
    import signal

    result, pids = _launch_and_signal(tmp_path, "off", signal.SIGTERM)
    assert result.returncode == 143, f"exit {result.returncode}\n{result.stderr}"
    assert "SIGTERM received: passing it to torchrun" in result.stderr
    assert [pid for pid in pids if _alive(pid)] == [], "workers outlived the launcher"


@pytest.mark.distributed
@pytest.mark.slow  # the in-process agreement and save are tests/engine/test_preemption.py (default run)
def test_sigterm_with_preemption_saves_on_every_rank_and_the_launcher_reports_it(tmp_path):
    import json
    import signal

    result, pids = _launch_and_signal(tmp_path, "on", signal.SIGTERM)
    assert result.returncode == 75, f"exit {result.returncode}\n{result.stderr}"
    assert [pid for pid in pids if _alive(pid)] == []
    tag = (tmp_path / "ckpt" / "latest").read_text()
    meta = json.loads((tmp_path / "ckpt" / tag / "meta.json").read_text())
    assert tag == f"global_step{meta['global_steps']}" and meta["global_steps"] >= 3
    # each rank recorded the step before the last: the last one raised Preempted inside engine.step()
    assert {int((tmp_path / f"step_{r}").read_text()) for r in (0, 1)} == {meta["global_steps"] - 1}
    assert f"the job stopped on SIGTERM after step {meta['global_steps']} and saved {tmp_path / 'ckpt' / tag}" \
        in result.stderr, result.stderr


@pytest.mark.distributed
def test_real_two_process_training_run():
    script = REPO / "tests" / "parallel" / "_launch_train_script.py"
    proc = subprocess.run(
        [sys.executable, "-m", "tachyon.parallel.launch", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "terminate called" not in proc.stderr, f"a rank aborted at exit:\n{proc.stderr}"
    rows = {}
    for match in re.finditer(r"RESULT ((?:\w+=[-\d.e]+ ?)+?)(?:checksum=(\d+\.\d{12}))", proc.stdout):
        fields = dict(item.split("=") for item in match.group(1).split())
        fields["checksum"] = match.group(2)
        rows[int(fields["rank"])] = fields
    assert sorted(rows) == [0, 1], proc.stdout
    for rank, fields in rows.items():
        assert fields["world"] == "2" and fields["local_rank"] == str(rank)
        assert float(fields["sum"]) == 3.0  # 1 + 2
        assert float(fields["loss"]) < 0.5 * float(fields["loss0"]), f"rank {rank} did not train: {fields}"
    assert rows[0]["checksum"] == rows[1]["checksum"], "data-parallel ranks ended with different weights"
    assert rows[0]["loss0"] != rows[1]["loss0"], "both ranks trained on the same data shard"


def test_add_arguments_works_as_a_cli_subcommand(capsys):
    """How tachyon.cli registers it: add_arguments on a subparser, run on the parsed namespace."""
    import argparse

    parser = argparse.ArgumentParser(prog="tachyon")
    sub = parser.add_subparsers(dest="command")
    launch.add_arguments(sub.add_parser("launch"))
    args = parser.parse_args(["launch", "--dry-run", "--nproc-per-node", "3", "t.py", "--dry-run", "x"])
    assert launch.run(args) == 0
    assert capsys.readouterr().out.strip().endswith("--nproc-per-node 3 --standalone t.py --dry-run x")
