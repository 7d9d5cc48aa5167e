"""Move or check the dependency pins: the newest and the oldest versions tachyon is tested with.

    python tools/pins.py upgrade   # make upgrade-check: newest releases in a scratch venv, run the suite;
                                   # if it passes, rewrite constraints.txt and the "newest" column
                                   # of src/tachyon/tested_versions.json
    python tools/pins.py oldest    # make oldest-check: each bounded dependency at its pyproject lower
                                   # bound (the "oldest" column), run the suite; changes nothing

torch stays at the version constraints.txt pins in both (the CPU wheel; a newer torch from PyPI is
a multi-gigabyte CUDA build), and triton at the version that torch release pins. The suite is the
default one (`pytest tests`), as `make test` runs it. The scratch venv is `.venv-pins/`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
TESTED = ROOT / "src" / "tachyon" / "tested_versions.json"
VENV = ROOT / ".venv-pins"
EXTRAS = ".[test,triton,hf,tensorboard]"
HOLD = ("torch", "triton")  # never moved by `upgrade`
HEADER = """\
# Exact versions the default test suite last passed with (every install into .venv honours this
# file through .venv/pip.conf, written by `make`). torch stays at the 2.13.0 CPU wheel and triton
# at the version torch pins. Do not edit by hand: `make upgrade-check` rewrites it (tools/pins.py).
"""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_normalize(name)] = version.strip()
    return pins


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kwargs)


def _fresh_venv() -> Path:
    if VENV.exists():
        shutil.rmtree(VENV)
    _run([sys.executable, "-m", "venv", str(VENV)], check=True)
    python = VENV / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    return python


def _freeze(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                         check=True).stdout
    pins = {}
    for line in out.splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_normalize(name)] = version.split("+")[0]
    pins.pop("tachyon", None)
    return pins


def _suite(python: Path) -> int:
    return _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]).returncode


def upgrade() -> int:
    held = {name: version for name, version in read_constraints().items() if name in HOLD}
    python = _fresh_venv()
    holds = [f"{name}=={version}" for name, version in held.items()]
    _run([str(python), "-m", "pip", "install", "-q", *holds], check=True)
    hold_file = VENV / "hold.txt"
    hold_file.write_text("\n".join(holds) + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "-c", str(hold_file), "-e", EXTRAS], check=True)
    new = _freeze(python)
    old = read_constraints()
    moved = {n: (old.get(n), v) for n, v in sorted(new.items()) if old.get(n) != v}
    for name, (before, after) in moved.items():
        print(f"  {name}: {before or '-'} -> {after}")
    if _suite(python) != 0:
        print("upgrade-check: the suite FAILED with the versions above; constraints.txt is unchanged")
        return 1
    CONSTRAINTS.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(new.items())))
    tested = json.loads(TESTED.read_text())
    for name, entry in tested["tested"].items():
        if _normalize(name) in new:
            entry["newest"] = new[_normalize(name)]
    TESTED.write_text(json.dumps(tested, indent=2) + "\n")
    print(f"upgrade-check: the suite passed; {len(moved)} pins moved in constraints.txt and {TESTED.name}")
    return 0


def oldest() -> int:
    tested = json.loads(TESTED.read_text())["tested"]
    pins = read_constraints()
    python = _fresh_venv()
    wanted = [f"{name}=={pins[_normalize(name)]}" for name in HOLD]
    wanted += [f"{name}=={entry['oldest']}" for name, entry in tested.items() if name not in HOLD]
    _run([str(python), "-m", "pip", "install", "-q", *wanted[:1]], check=True)
    _run([str(python), "-m", "pip", "install", "-q", "-e", EXTRAS, *wanted], check=True)
    print("oldest-check: installed", ", ".join(wanted))
    status = _suite(python)
    print(f"oldest-check: the suite {'passed' if status == 0 else 'FAILED'} at the oldest versions")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("upgrade", "oldest"))
    args = parser.parse_args(argv)
    return upgrade() if args.mode == "upgrade" else oldest()


if __name__ == "__main__":
    sys.exit(main())
