"""``tachyon launch``: build a torchrun (``torch.distributed.run``) command line and run it.

    tachyon launch --nproc-per-node 8 train.py --lr 3e-4          # one node, 8 processes
    tachyon launch --nnodes 2 --node-rank 0 --master-addr node01 --master-port 29500 train.py
    tachyon launch --hostfile hosts train.py                       # DeepSpeed-style hostfile
    tachyon launch --dry-run ...                                   # print the command, run nothing

torchrun is the process manager (restarts, signal forwarding, per-rank environment); this module
only works out its arguments. One node without --master-addr/--master-port runs torchrun's
``--standalone`` mode (a local rendezvous on a free port, so two jobs on one machine do not
collide). Several nodes use a static rendezvous at MASTER_ADDR:MASTER_PORT; the same command
runs on every node with its own --node-rank.

Hostfile (DeepSpeed's format): one ``hostname slots=N`` per line, ``#`` starts a comment. The
number of hosts is --nnodes, the slots are --nproc-per-node (all hosts must have the same number),
the first host is the master, and this machine's node rank is the index of its hostname
(``socket.gethostname()``, full or short name), unless --node-rank is given.

In each process, ``tachyon.init_distributed()`` reads the variables torchrun sets.

Signals (`run_torchrun`, also used by ``tachyon train``): torchrun runs in a process group of
its own, and SIGINT / SIGTERM / SIGHUP sent to this process (Ctrl-C, ``kill``, ``docker stop``,
Kubernetes) are forwarded to it; torchrun then sends the same signal to the workers, waits for
them (30 s, then SIGKILL) and exits, and this process waits for torchrun before it returns, so no
process outlives it. SIGUSR1 / SIGUSR2 (SLURM's ``--signal``), which torchrun does not handle,
go to the workers themselves. Should this process be killed outright (SIGKILL), torchrun gets
SIGTERM from the kernel (Linux ``PR_SET_PDEATHSIG``). A worker that saved a checkpoint on the
signal (the ``preemption`` config section, `tachyon.engine.preemption`) records it in the file
named by ``TACHYON_PREEMPTION_FILE``; the launcher then prints the step and the checkpoint and
returns the section's exit code (75 by default) instead of torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MASTER_PORT = 29500
PREEMPTION_FILE_ENV = "TACHYON_PREEMPTION_FILE"
"""Where rank 0 records a save on preemption (`tachyon.engine.preemption`); set by `run_torchrun`."""
FORWARDED_TO_TORCHRUN = ("SIGINT", "SIGTERM", "SIGHUP")
"""Signals torchrun handles itself (it passes them on to the workers)."""
FORWARDED_TO_WORKERS = ("SIGUSR1", "SIGUSR2")
"""Signals torchrun does not handle (they would kill it): sent to its workers directly."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read a DeepSpeed hostfile: ``hostname slots=N`` per line, ``#`` comments, blank lines skipped.

    ValueError when the file is missing, empty, malformed or lists a host twice.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--hostfile: file not found: {str(path)!r}")
    hosts: list[Host] = []
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if match is None:
            raise ValueError(f"--hostfile {path}:{lineno}: expected 'hostname slots=N'; got {raw.strip()!r}")
        name, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise ValueError(f"--hostfile {path}:{lineno}: slots must be >= 1; got {slots}")
        if any(h.name == name for h in hosts):
            raise ValueError(f"--hostfile {path}:{lineno}: host {name!r} is listed twice")
        hosts.append(Host(name, slots))
    if not hosts:
        raise ValueError(f"--hostfile {path}: no hosts in the file (expected lines 'hostname slots=N')")
    return hosts


def _hostname_index(hosts: Sequence[Host], hostname: str) -> int | None:
    short = hostname.split(".", 1)[0]
    for index, host in enumerate(hosts):
        if host.name in (hostname, short) or host.name.split(".", 1)[0] == short:
            return index
    return None


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


@dataclass(frozen=True)
class LaunchPlan:
    """What the command will do: nodes, processes per node, this node's rank, the master."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str | None  # None: --standalone (single node, local rendezvous)
    master_port: int | None
    notes: tuple[str, ...]  # what was inferred, printed before running


def plan_launch(args: argparse.Namespace, hostname: str | None = None) -> LaunchPlan:
    """Resolve the launch arguments (hostfile, defaults) into a `LaunchPlan`; ValueError on conflicts."""
    notes: list[str] = []
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1; got {args.nproc_per_node}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ValueError(f"--master-port must be between 1 and 65535; got {args.master_port}")
    if args.hostfile is not None:
        if args.nnodes is not None or args.master_addr is not None:
            raise ValueError("--hostfile sets the nodes and the master; do not combine it with --nnodes or --master-addr")
        hosts = parse_hostfile(args.hostfile)
        slots = {h.slots for h in hosts}
        if len(slots) > 1:
            listing = ", ".join(f"{h.name}={h.slots}" for h in hosts)
            raise ValueError(f"--hostfile {args.hostfile}: every host must have the same slots; got {listing}")
        nproc = hosts[0].slots
        if args.nproc_per_node is not None and args.nproc_per_node != nproc:
            notes.append(f"--nproc-per-node {args.nproc_per_node} overrides the hostfile's slots={nproc}")
            nproc = args.nproc_per_node
        if args.node_rank is not None:
            node_rank = args.node_rank
        else:
            hostname = hostname if hostname is not None else socket.gethostname()
            index = _hostname_index(hosts, hostname)
            if index is None:
                names = ", ".join(h.name for h in hosts)
                raise ValueError(
                    f"this machine's hostname {hostname!r} is not in --hostfile {args.hostfile} ({names}); "
                    "pass --node-rank"
                )
            node_rank = index
            notes.append(f"node rank {node_rank}: this host {hostname!r} is line {index + 1} of the hostfile")
        nnodes, master_addr = len(hosts), hosts[0].name
        master_port = args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
        notes.insert(
            0, f"hostfile {args.hostfile}: {nnodes} node(s) x {nproc} process(es), master {master_addr}:{master_port}"
        )
    else:
        nnodes = args.nnodes if args.nnodes is not None else 1
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1; got {nnodes}")
        node_rank = args.node_rank if args.node_rank is not None else 0
        if args.nproc_per_node is not None:
            nproc = args.nproc_per_node
        else:
            nproc = _default_nproc()
            notes.append(f"--nproc-per-node not given: {nproc} (the number of CUDA devices, or 1 without CUDA)")
        master_addr, master_port = args.master_addr, args.master_port
        if nnodes > 1:
            if master_addr is None:
                raise ValueError(f"--nnodes {nnodes} needs --master-addr (the host of node rank 0) or --hostfile")
            if master_port is None:
                master_port = DEFAULT_MASTER_PORT
        elif master_addr is not None or master_port is not None:
            master_addr = master_addr or "127.0.0.1"
            master_port = master_port or DEFAULT_MASTER_PORT
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, {nnodes}) for {nnodes} node(s); got {node_rank}")
    return LaunchPlan(nnodes, nproc, node_rank, master_addr, master_port, tuple(notes))


def _command_for(plan: LaunchPlan, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(plan.nproc_per_node)]
    if plan.master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += [
            "--nnodes", str(plan.nnodes), "--node-rank", str(plan.node_rank),
            "--master-addr", plan.master_addr, "--master-port", str(plan.master_port),
        ]
    return cmd + [args.script, *args.script_args]


def build_torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun argv for parsed ``tachyon launch`` arguments (pure: runs nothing)."""
    return _command_for(plan_launch(args), args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``tachyon launch``'s arguments to ``parser`` (the CLI subcommand and `main` share them)."""
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="processes per node (default: number of CUDA devices, 1 without CUDA)")
    parser.add_argument("--nnodes", type=int, default=None, metavar="N", help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=None, metavar="R",
                        help="rank of this node (default 0, or this host's position in --hostfile)")
    parser.add_argument("--master-addr", default=None, metavar="A", help="host of node rank 0 (multi-node)")
    parser.add_argument("--master-port", type=int, default=None, metavar="P",
                        help=f"rendezvous port on the master (default {DEFAULT_MASTER_PORT} for several nodes)")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="DeepSpeed-style hostfile: 'hostname slots=N' per line")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    parser.add_argument("script", help="the training script each process runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def check_script(script: str) -> None:
    """ValueError when ``script`` is not a readable file (before torchrun starts N processes that
    would each fail on it)."""
    path = Path(script)
    if not path.exists():
        raise ValueError(f"script not found: {script!r} (the file each process runs)")
    if not path.is_file():
        raise ValueError(f"script {script!r} is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"script {script!r} is not readable")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM to it when the launcher dies, even by SIGKILL (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux /proc; empty elsewhere)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def read_preemption_record(path: str | Path) -> dict[str, Any] | None:
    """The last record a worker wrote to ``path`` (``TACHYON_PREEMPTION_FILE``), or None."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def run_torchrun(cmd: Sequence[str], env: dict[str, str] | None = None, who: str = "tachyon launch") -> int:
    """Run the torchrun command ``cmd`` and wait for it, forwarding signals (module docstring).

    Returns the preemption exit code when a worker saved on a signal, 128 + the signal number
    when a forwarded signal stopped the job otherwise (the shell's convention), else torchrun's
    exit code. A repeated signal is passed on again (torchrun and the workers take a second
    SIGTERM or SIGINT as "stop now")."""
    env = dict(os.environ if env is None else env)
    fd, record = tempfile.mkstemp(prefix="tachyon-preemption-", suffix=".jsonl")
    os.close(fd)
    env[PREEMPTION_FILE_ENV] = record
    received: list[int] = []
    running: list[subprocess.Popen] = []

    def deliver(signum: int) -> None:
        proc = running[0]
        name = signal.Signals(signum).name
        if name in FORWARDED_TO_WORKERS:
            workers = _children(proc.pid)
            print(f"{who}: {name} received: passing it to the {len(workers)} worker process(es)", file=sys.stderr,
                  flush=True)
            targets = workers
        else:
            print(f"{who}: {name} received: passing it to torchrun (pid {proc.pid}), which stops the workers; "
                  "waiting for it", file=sys.stderr, flush=True)
            targets = [proc.pid]
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def forward(signum: int, frame: Any) -> None:
        del frame
        received.append(signum)
        if running:
            deliver(signum)

    previous: dict[int, Any] = {}
    try:
        for name in (*FORWARDED_TO_TORCHRUN, *FORWARDED_TO_WORKERS):
            sig = getattr(signal, name, None)
            if sig is not None:
                previous[sig] = signal.signal(sig, forward)
        posix = os.name == "posix"
        running.append(subprocess.Popen(list(cmd), env=env, start_new_session=posix,
                                        preexec_fn=_die_with_parent if posix else None))
        for signum in list(received):  # arrived while torchrun was starting
            deliver(signum)
        code = running[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        saved = read_preemption_record(record)
        Path(record).unlink(missing_ok=True)
    if saved is not None:
        print(f"{who}: the job stopped on {saved.get('signal')} after step {saved.get('step')} and saved "
              f"{saved.get('checkpoint')}; exit code {saved.get('exit_code')} (torchrun's: {code}); resume from "
              "that checkpoint", file=sys.stderr, flush=True)
        return int(saved.get("exit_code", 75))
    if received and code != 0:
        return 128 + received[0]
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention


def run(args: argparse.Namespace) -> int:
    """Print what was inferred and the command, then run it (`run_torchrun`); returns torchrun's
    exit code (or the preemption exit code, or 128 + a signal that stopped it).

    A bad argument combination or a missing script prints the error and returns 2 (argparse's
    usage-error code).
    """
    try:
        plan = plan_launch(args)
        if not args.dry_run:
            check_script(args.script)
    except ValueError as error:
        print(f"tachyon launch: error: {error}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"tachyon launch: {note}")
    cmd = _command_for(plan, args)
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return run_torchrun(cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tachyon launch", description="Run a training script on several processes with torchrun."
    )
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tachyon.parallel.launch ...``: parse ``argv`` and `run`."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
