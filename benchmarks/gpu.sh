#!/usr/bin/env bash
# Everything a GPU is needed for, in one budgeted command: install tachyon, then by default (about
# 8.5 minutes on an H100/H200, Triton compilation included):
#   smoke    benchmarks/gpu_smoke.py: every Triton kernel once at a real shape, fp16 and bf16, against
#            its reference; the BERT layer's one-node path and its CUDA-graph replay bit for bit
#   profile  benchmarks/gpu_profile.py: kernel tables (GPU time per kernel, idle gaps) of one
#            BERT-Large layer (eager, graphed, HF) and one TE-tutorial layer forward + backward
#   sweep    benchmarks/bench_sweep.py --quick: every candidate config of the kernels under work
#   the benchmark scripts with --quick: transformer_kernel, te_layer, attention, layernorm, mlp, and
#            inference (decode latency, fp16 / INT8, CUDA graphs) with what is left of the budget
#            (eager, CUDA-graph and host time per row, beside the anchors in the same run)
# and writes logs, CSV and a markdown summary into OUTDIR.
#   bash benchmarks/gpu.sh OUTDIR [--only STEPS] [--budget SECONDS] [--timeout SECONDS] [--full] [--tar FILE]
# --only: a comma-separated selection of steps: smoke, profile, sweep, tests (pytest -m gpu; not in
#   the default) and benchmark names (bench_<name>.py: layernorm, elementwise, mlp, attention,
#   fp8_cast, optim, transformer_kernel, te_layer, engine, inference, sweep, ...).
# --budget: seconds for all steps together (default 500); each step runs under its own limit (the
#   table below) or what is left of the budget, whichever is less; a step cut off keeps what it wrote.
# --timeout: one limit for every step instead of the table's. --full: the benchmarks without --quick
#   (the full shapes; more than one device call). --tests "PATHS": the test paths of the "tests" step
#   (default: tests). --tar FILE: at the end, everything in OUTDIR as one .tgz (a device call brings
#   back only a few files: give OUTDIR outside $OUT and FILE inside it).
#   Other arguments go to every benchmark script.
# Tests: with pytest-xdist there, TACHYON_TEST_WORKERS (default 12) processes share the GPU; with
#   pytest-timeout, 300 s per test at most. Every failure goes to OUTDIR/gpu-failures.txt as it
#   happens, so a run cut off still names its failures.
# On an offline GPU machine, wheels for pydantic & co. may be carried in .whl/ (see README).
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUTDIR [--only STEPS] [--budget SECONDS] [--timeout SECONDS] [--full] [--tar FILE]}
shift
only="" limit=0 budget=500 tests=tests tarball="" quick=(--quick) args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only=${2:?--only needs a comma-separated list}; shift 2 ;;
    --timeout) limit=${2:?--timeout needs seconds}; shift 2 ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --tests) tests=${2:?--tests needs test paths}; shift 2 ;;
    --tar) tarball=${2:?--tar needs a file name}; shift 2 ;;
    --full) quick=(); shift ;;
    --quick) shift ;;  # the default
    *) args+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export TACHYON_BENCH_OUT="$out" TACHYON_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
started=$(date +%s)

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --target /tmp/tachyon-site .whl/*.whl
  export PYTHONPATH=/tmp/tachyon-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-}
$py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || echo "pip install -e . failed (using PYTHONPATH=src): see install.log"

# default steps and their limits in seconds (the budget cuts the later ones short if needed)
default_steps="smoke profile sweep transformer_kernel te_layer attention layernorm mlp inference"
step_limit() {
  case "$1" in
    smoke) echo 80 ;; profile) echo 55 ;; sweep) echo 130 ;; transformer_kernel) echo 90 ;; te_layer) echo 70 ;;
    attention) echo 40 ;; layernorm) echo 30 ;; mlp) echo 25 ;; inference) echo 60 ;; tests) echo 300 ;; *) echo 120 ;;
  esac
}
if [ -n "$only" ]; then steps=${only//,/ }; else steps=$default_steps; fi

timed() {  # timed NAME CMD...: run under min(the step's limit, the budget left)
  local name=$1; shift
  local cap; cap=$(step_limit "$name")
  [ "$limit" -gt 0 ] && cap=$limit
  local left=$(( budget - ($(date +%s) - started) ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -le 5 ]; then echo "skipped $name: the budget of $budget s is spent"; return 124; fi
  timeout "$cap" "$@"
}

{
  echo "# GPU run $(date -u +%Y-%m-%d) commit $TACHYON_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $py -m tachyon info
} | tee -a "$out/summary.md"

status=0
for step in $steps; do
  echo "## $step" | tee -a "$out/summary.md"
  start=$(date +%s)
  case "$step" in
    tests)
      extra=()
      $py -c "import xdist" 2>/dev/null && extra+=(-n "${TACHYON_TEST_WORKERS:-12}")
      $py -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 300)
      export TACHYON_FAILURE_LOG="$out/gpu-failures.txt"
      # shellcheck disable=SC2086  # $tests is a list of paths
      timed tests $py -m pytest -q -m gpu -p no:cacheprovider --durations=15 ${extra[@]+"${extra[@]}"} $tests 2>&1 \
        | tee "$out/pytest-gpu.log" | tail -n 30
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      unset TACHYON_FAILURE_LOG
      if [ -s "$out/gpu-failures.txt" ]; then grep '^=== FAILED' "$out/gpu-failures.txt" | tee -a "$out/summary.md"; fi
      tail -n 1 "$out/pytest-gpu.log" >>"$out/summary.md"
      ;;
    smoke|profile)
      script=benchmarks/gpu_$step.py
      if timed "$step" $py "$script" >"$out/$step.log" 2>&1; then cat "$out/$step.log" >>"$out/summary.md"
      else status=1; echo "FAILED or cut off after $(( $(date +%s) - start )) s: see $step.log" | tee -a "$out/summary.md"
           tail -n 40 "$out/$step.log" | tee -a "$out/summary.md"; fi
      ;;
    *)
      script=benchmarks/bench_$step.py
      if [ ! -f "$script" ]; then echo "no step named $step" | tee -a "$out/summary.md"; status=1; continue; fi
      step_args=()
      [ "$step" = inference ] && step_args=(--gpu-only)  # its CPU part (counts under the interpreter) runs in CI
      if timed "$step" $py "$script" ${quick[@]+"${quick[@]}"} ${step_args[@]+"${step_args[@]}"} \
          ${args[@]+"${args[@]}"} >"$out/bench_$step.log" 2>&1; then
        cat "$out/bench_$step.log" >>"$out/summary.md"
      else
        status=1
        echo "FAILED or cut off after $(( $(date +%s) - start )) s: see bench_$step.log" | tee -a "$out/summary.md"
        tail -n 20 "$out/bench_$step.log" | tee -a "$out/summary.md"
      fi
      ;;
  esac
  echo "($step: $(( $(date +%s) - start )) s; $(( $(date +%s) - started )) s in all)" | tee -a "$out/summary.md"
done
if [ -n "$tarball" ]; then
  tar czf "$tarball" -C "$(dirname "$out")" "$(basename "$out")" && echo "results: $tarball"
fi
exit $status
