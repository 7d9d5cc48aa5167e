#!/usr/bin/env bash
# Everything a GPU is needed for: install tachyon, run the GPU tests, run the benchmark scripts,
# and write the results (logs, CSV, a markdown summary) into OUTDIR.
#   bash benchmarks/gpu.sh OUTDIR [--only tests,layernorm,...] [--timeout SECONDS] [--quick]
# --only: a comma-separated selection of steps: "tests" (pytest -m gpu) and benchmark names
#   (bench_<name>.py: layernorm, elementwise, mlp, attention, fp8_cast, optim, transformer_kernel,
#   te_layer, engine, ...); default: all of them, tests first. --timeout: the limit for each step
#   (default 0 = none), so that one slow step cannot use up a whole session's time.
#   --tests "PATHS": the test paths of the "tests" step (default: tests), e.g. "tests/kernels"
#   to split the GPU tests over several calls. --tar FILE: at the end, everything in OUTDIR as one
#   .tgz (a device call brings back only a few files: give OUTDIR outside $OUT and FILE inside it).
#   Other arguments (e.g. --quick) go to every benchmark script.
# Tests: with pytest-xdist there, TACHYON_TEST_WORKERS (default 12) processes share the GPU (the
#   time is Triton compiling, on the CPUs); with pytest-timeout, 300 s per test at most. Every
#   failure goes to OUTDIR/gpu-failures.txt as it happens, so a run cut off by --timeout still
#   names its failures.
# On an offline GPU machine, wheels for pydantic & co. may be carried in .whl/ (see README).
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUTDIR [--only STEPS] [--timeout SECONDS] [--quick]}
shift
only="" limit=0 tests=tests tarball="" args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only=${2:?--only needs a comma-separated list}; shift 2 ;;
    --timeout) limit=${2:?--timeout needs seconds}; shift 2 ;;
    --tests) tests=${2:?--tests needs test paths}; shift 2 ;;
    --tar) tarball=${2:?--tar needs a file name}; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export TACHYON_BENCH_OUT="$out" TACHYON_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --target /tmp/tachyon-site .whl/*.whl
  export PYTHONPATH=/tmp/tachyon-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-}
$py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || echo "pip install -e . failed (using PYTHONPATH=src): see install.log"

selected() {  # selected NAME: true when --only is empty or lists NAME
  [ -z "$only" ] && return 0
  case ",$only," in *",$1,"*) return 0 ;; *) return 1 ;; esac
}
timed() {  # timed CMD...: run with the per-step limit, if any
  if [ "$limit" -gt 0 ]; then timeout "$limit" "$@"; else "$@"; fi
}

{
  echo "# GPU run $(date -u +%Y-%m-%d) commit $TACHYON_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $py -m tachyon info
} | tee -a "$out/summary.md"

status=0
if selected tests; then
  echo "## pytest -m gpu $tests" | tee -a "$out/summary.md"
  extra=()
  $py -c "import xdist" 2>/dev/null && extra+=(-n "${TACHYON_TEST_WORKERS:-12}")
  $py -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 300)
  export TACHYON_FAILURE_LOG="$out/gpu-failures.txt"
  # shellcheck disable=SC2086  # $tests is a list of paths
  timed $py -m pytest -q -m gpu -p no:cacheprovider --durations=15 ${extra[@]+"${extra[@]}"} $tests 2>&1 \
    | tee "$out/pytest-gpu.log" | tail -n 30
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  unset TACHYON_FAILURE_LOG
  if [ -s "$out/gpu-failures.txt" ]; then grep '^=== FAILED' "$out/gpu-failures.txt" | tee -a "$out/summary.md"; fi
  tail -n 1 "$out/pytest-gpu.log" >>"$out/summary.md"
fi

for script in benchmarks/bench_*.py; do
  name=$(basename "$script" .py)
  selected "${name#bench_}" || continue
  echo "## $name" | tee -a "$out/summary.md"
  start=$(date +%s)
  if timed $py "$script" "${args[@]}" >"$out/$name.log" 2>&1; then
    cat "$out/$name.log" >>"$out/summary.md"
  else
    status=1
    echo "FAILED or timed out after $(( $(date +%s) - start )) s: see $name.log" | tee -a "$out/summary.md"
    tail -n 20 "$out/$name.log"
  fi
  echo "($name: $(( $(date +%s) - start )) s)" | tee -a "$out/summary.md"
done
if [ -n "$tarball" ]; then
  tar czf "$tarball" -C "$(dirname "$out")" "$(basename "$out")" && echo "results: $tarball"
fi
exit $status
