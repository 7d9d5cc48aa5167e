"""Save on preemption: a signal (SIGTERM from ``kill``, ``docker stop`` or Kubernetes; SIGUSR1
from SLURM's ``--signal``) ends training at a step boundary with a checkpoint, on every rank.

    "preemption": {"enabled": true, "save_dir": "ckpt", "signals": ["SIGTERM", "SIGUSR1"], "exit_code": 75}

1. The handler only records the signal (and says so on stderr): the rank finishes what it is
   doing. A second signal of the same kind restores the previous handler and delivers itself
   again (e.g. terminates at once): the way out when the save cannot finish.
2. At the next optimizer step the ranks agree (`tachyon.engine.nonfinite.StepGuard`: one MAX
   all-reduce of ``[non-finite, signal number]`` per step), so every rank stops after the same
   step even when only one got the signal.
3. That step completes (or is skipped, if non-finite) on every rank; then the engine saves
   ``save_dir/global_step<N>`` with ``client_state`` from ``handler.client_state`` (a callable,
   default none), and raises `Preempted`: a SystemExit carrying ``exit_code`` (75 by default,
   EX_TEMPFAIL of sysexits.h: "try again later"), the step and the checkpoint. Uncaught, the
   process exits with that code without a traceback.
4. When the launcher set ``TACHYON_PREEMPTION_FILE`` (`tachyon launch`, `tachyon train`), rank 0
   writes a JSON line there ({"step", "checkpoint", "signal", "exit_code"}) so the launcher can
   report it after torchrun ends.

With the section off (the default) no handler is installed, and the flag is not sent.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tachyon.parallel.launch import PREEMPTION_FILE_ENV


class Preempted(SystemExit):
    """Training stopped on a signal after saving ``checkpoint`` at ``step`` (``code``: the exit code)."""

    def __init__(self, code: int, step: int, checkpoint: str, signal_name: str) -> None:
        super().__init__(code)
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name

    def __str__(self) -> str:
        return (f"{self.signal_name}: stopped after step {self.step}, checkpoint saved to {self.checkpoint} "
                f"(exit code {self.code})")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptionHandler:
    """The ``preemption`` config section at work for one engine (module docstring).

    Args:
        section: the validated `tachyon.config.sections.PreemptionConfig`.
        rank: this process's global rank (rank 0 reports).
    """

    def __init__(self, section: Any, rank: int = 0) -> None:
        self.enabled = bool(section.enabled)
        self.save_dir = section.save_dir
        self.exit_code = int(section.exit_code)
        self.signals = [getattr(signal, name) for name in section.signals if hasattr(signal, name)]
        self.rank = rank
        self.requested: int | None = None
        """The signal this rank received (None: none yet)."""
        self.agreed: int | None = None
        """The signal the ranks agreed to stop on (set by the step guard)."""
        self.client_state: Callable[[], dict] | None = None
        """Returns the ``client_state`` for the preemption checkpoint (e.g. the data position)."""
        self._previous: dict[int, Any] = {}
        if self.enabled:
            self.install()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "preemption.enabled needs signal handlers, which Python installs only in the main thread; "
                "call tachyon.initialize from the main thread, or turn the preemption section off"
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Restore the handlers that were there before (engine.destroy)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.requested == signum:  # asked twice: give the signal its previous meaning
            previous = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.write(2, f"rank {self.rank}: {signal_name(signum)} again: not waiting for the checkpoint\n".encode())
            signal.raise_signal(signum)
            return
        self.requested = signum
        os.write(2, f"rank {self.rank}: {signal_name(signum)} received: finishing the current optimizer step, then "
                    f"saving a checkpoint in {self.save_dir} and exiting with code {self.exit_code}\n".encode())

    @property
    def flag(self) -> float:
        """This rank's contribution to the stop agreement: the signal number, 0 for none."""
        return float(self.requested or 0)

    def stop(self, engine: Any) -> None:
        """Save and raise `Preempted` (every rank, at the same step boundary)."""
        signum = self.agreed or self.requested or 0
        name = signal_name(signum) if signum else "a signal"
        self.requested = self.agreed = None  # a caller that catches Preempted and goes on is not stopped again
        client_state = self.client_state() if self.client_state is not None else {}
        tag = f"global_step{engine.global_steps}"
        engine.save_checkpoint(self.save_dir, tag=tag, client_state=client_state)
        path = str(Path(self.save_dir) / tag)
        if self.rank == 0:
            record = os.environ.get(PREEMPTION_FILE_ENV)
            if record:
                line = {"step": engine.global_steps, "checkpoint": path, "signal": name, "exit_code": self.exit_code}
                try:
                    with open(record, "a") as handle:
                        handle.write(json.dumps(line) + "\n")
                except OSError as error:
                    print(f"tachyon: cannot record the preemption in {record}: {error}", file=sys.stderr)
            print(f"tachyon: {name}: stopped after step {engine.global_steps}; checkpoint saved to {path}; exiting "
                  f"with code {self.exit_code} (load_checkpoint({str(self.save_dir)!r}) resumes)", file=sys.stderr,
                  flush=True)
        self.uninstall()
        raise Preempted(self.exit_code, engine.global_steps, path, name)


__all__ = ["PREEMPTION_FILE_ENV", "Preempted", "PreemptionHandler", "signal_name"]
