#!/usr/bin/env bash
# Everything a GPU is needed for, in one budgeted command (500 s by default): install tachyon, a warm
# phase, then the timed steps one at a time, in this order by default:
#   smoke    benchmarks/gpu_smoke.py: every Triton kernel once at a real shape, bf16 then fp16, against
#            its reference; the BERT layer's one-node path and its CUDA-graph replay bit for bit
#   te_layer the TE-tutorial layer (torch.nn, TransformerLayer, graphed, FP8 recipes, ...), bf16
#   profile  benchmarks/gpu_profile.py: kernel tables (GPU time per kernel, idle gaps) of one
#            BERT-Large layer (eager, HF, graphed) and one TE-tutorial layer forward + backward
#   sweep    benchmarks/bench_sweep.py --quick: every candidate config of the kernels under work
#   then the benchmark scripts with --quick: inference (decode latency, fp16 / INT8, CUDA graphs),
#            transformer_kernel, attention, layernorm, mlp, with what is left of the budget
#            (eager, CUDA-graph and host time per row, beside the anchors in the same run)
# and writes logs, CSV and a markdown summary into OUTDIR. Every script prints each row as it is
# measured and appends it to its CSV, so a step cut off by its limit keeps what it measured (its
# rows go into summary.md).
# Warm phase: first, the selected steps' scripts run all at once with TACHYON_BENCH_WARM=1 (see
# benchmarks/common.py: each timed callable runs twice, nothing is measured or written; the smoke
# and the sweep split into several processes), under one cap (--warm-cap, default 120 s, and never
# more than half the budget left). Triton's compiled binaries and torch.compile's caches are on disk,
# shared by the processes of one call, so the timed steps after it start with every kernel, autotuning
# config and compiled graph built (autotuning choices are made again in each process: binaries persist).
# A warm process that fails or is cut off is logged in OUTDIR/warm/ and ignored.
#   bash benchmarks/gpu.sh OUTDIR [--only STEPS] [--budget SECONDS] [--timeout SECONDS] [--full] [--tar FILE]
#                                 [--warm-cap SECONDS | --no-warm] [--dry-run]
# --only: a comma-separated selection of steps: smoke, profile, sweep, tests (pytest -m gpu; not in
#   the default) and benchmark names (bench_<name>.py: layernorm, elementwise, mlp, attention,
#   fp8_cast, optim, transformer_kernel, te_layer, engine, inference, sweep, zero3, ...). zero3 (not in
#   the default; never warmed beside others): ZeRO-3 step time against plain FSDP2 and the largest GPT
#   that trains on the GPU with and without offload (bench_zero3.py --gpu; 180 s).
# --budget: seconds for all steps together (default 500); each step runs under its own limit (the
#   table below) or what is left of the budget, whichever is less; a step cut off keeps what it wrote.
# --timeout: one limit for every step instead of the table's. --full: the benchmarks without --quick
#   (the full shapes; more than one device call). --tests "PATHS": the test paths of the "tests" step
#   (default: tests). --tar FILE: at the end, everything in OUTDIR as one .tgz (a device call brings
#   back only a few files: give OUTDIR outside $OUT and FILE inside it). --dry-run: print the warm
#   phase's and the steps' commands with their limits, run nothing.
#   Other arguments go to every benchmark script.
# The commit recorded is $TACHYON_COMMIT where set (pass it: a copied tree's git metadata can be
# stale), else git's HEAD.
# Tests: with pytest-xdist there, TACHYON_TEST_WORKERS (default 12) processes share the GPU; with
#   pytest-timeout, 300 s per test at most. Every failure goes to OUTDIR/gpu-failures.txt as it
#   happens, so a run cut off still names its failures.
# On an offline GPU machine, wheels for pydantic & co. may be carried in .whl/ (see README).
set -uo pipefail
out=${1:?usage: benchmarks/gpu.sh OUTDIR [--only STEPS] [--budget SECONDS] [--timeout SECONDS] [--full] [--tar FILE]}
shift
only="" limit=0 budget=500 tests=tests tarball="" quick=(--quick) args=() warm_cap=120 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only=${2:?--only needs a comma-separated list}; shift 2 ;;
    --timeout) limit=${2:?--timeout needs seconds}; shift 2 ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --tests) tests=${2:?--tests needs test paths}; shift 2 ;;
    --tar) tarball=${2:?--tar needs a file name}; shift 2 ;;
    --full) quick=(); shift ;;
    --warm-cap) warm_cap=${2:?--warm-cap needs seconds}; shift 2 ;;
    --no-warm) warm_cap=0; shift ;;
    --dry-run) dry_run=1; shift ;;
    --quick) shift ;;  # the default
    *) args+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
TACHYON_COMMIT=${TACHYON_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export TACHYON_BENCH_OUT="$out" TACHYON_COMMIT
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
started=$(date +%s)
sim=0  # --dry-run: the seconds the steps would have taken at their limits (so the budget's cuts show)
now() { echo $(( $(date +%s) + sim )); }

if [ "$dry_run" = 0 ]; then
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --target /tmp/tachyon-site .whl/*.whl
    export PYTHONPATH=/tmp/tachyon-site:${PYTHONPATH:-}
  fi
  $py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || echo "pip install -e . failed (using PYTHONPATH=src): see install.log"
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-}

# Default steps, most wanted first, and their limits in seconds; the budget cuts the later ones short.
# The limits are for a warm cache, estimated from the H100 run of 2026-11-28 (torch 2.11, triton 3.6),
# whose steps ran cold or half cold:
#   smoke      cold: 8 of 40 cases in 80 s (~10 s each: compilation). Warm: imports ~8 s + 40 cases at
#              ~0.5 s (three runs of an op, autotuning from cached binaries) ~ 30 s -> 40
#   te_layer   cold: ~9 variants (bf16) in 70 s. Warm, --quick is bf16 only: 11 variants x 2 modes at
#              ~1 s (3 calls, do_bench, graph, host, peak memory) + 4 graph captures + torch.compile
#              from its cache (~15 s) + imports ~ 50 s -> 60
#   profile    cold: nothing in 55 s. Warm: imports (transformers) ~10 s + 4 layers x (8 steps +
#              profiler processing, ~4 s) ~ 30 s -> 40
#   sweep      cold: 32 rows in 130 s. Warm: 55 rows (2 attention shapes with SDPA rows, MLP, norm)
#              at ~0.7 s + the default rows' autotuning ~25 s + imports ~ 75 s -> 90
#   inference  cold: no row in 58 s (every row also tried a graph capture and 10 host-timed
#              generate() calls; now neither). Warm: GPT-2 Large init ~10 s + per batch (1, 16):
#              HF eager ~6 s, 4 tachyon engines ~5 s each, HF torch.compile ~20 s -> ~110 s: 90 (the
#              compiled-HF rows, last, may be cut)
#   transformer_kernel  91 s cut off after the speed table (13 rows), in the max-batch search.
#              Warm: speed rows ~45 s + the search (2 seqs x 3 stacks x ~12 tries at ~1 s) -> 100
#   attention, layernorm, mlp: 31 s, 36 s, 27 s in the second call of that day (warm cache) -> 40, 45, 35
# Warm phase 120 s + these = 625 s > the 500 s budget: attention, layernorm and mlp (complete in that
# second call) are the ones cut; a second call (--only attention,layernorm,mlp --no-warm on the same
# machine: the caches are still there) gets them.
default_steps="smoke te_layer profile sweep inference transformer_kernel attention layernorm mlp"
step_limit() {
  case "$1" in
    smoke) echo 40 ;; te_layer) echo 60 ;; profile) echo 40 ;; sweep) echo 90 ;; inference) echo 90 ;;
    transformer_kernel) echo 100 ;; attention) echo 40 ;; layernorm) echo 45 ;; mlp) echo 35 ;;
    zero3) echo 180 ;; tests) echo 300 ;; *) echo 120 ;;
  esac
}
if [ -n "$only" ]; then steps=${only//,/ }; else steps=$default_steps; fi

step_cmd() {  # step_cmd STEP: the step's command line, one argument per line (nothing for "tests")
  case "$1" in
    tests) ;;
    smoke|profile) printf '%s\n' "$py" "benchmarks/gpu_$1.py" ;;
    *)
      printf '%s\n' "$py" "benchmarks/bench_$1.py" ${quick[@]+"${quick[@]}"}
      [ "$1" = inference ] && echo --gpu-only  # its CPU part (counts under the interpreter) runs in CI
      [ "$1" = zero3 ] && echo --gpu  # step time vs plain FSDP2 and the largest GPT; its bytes part runs on CPU
      [ ${#args[@]} -gt 0 ] && printf '%s\n' "${args[@]}"
      ;;
  esac
  return 0
}

warm_cmds() {  # one line per warm process: NAME<TAB>the command, shell-quoted
  local step cmd=() extra
  for step in $steps; do
    case "$step" in
      tests|zero3) continue ;;  # zero3 fills the GPU's memory on purpose: never beside other processes
      smoke|profile) ;;
      *) [ -f "benchmarks/bench_$step.py" ] || continue ;;
    esac
    mapfile -t cmd < <(step_cmd "$step")
    case "$step" in
      smoke)  # its cases compile one after the other: 3 processes per dtype
        for extra in bf16:0 bf16:1 bf16:2 fp16:0 fp16:1 fp16:2; do
          printf '%s\t%s--dtype %s --shard %s/3\n' "smoke-${extra/:/-}" "$(printf '%q ' "${cmd[@]}")" \
            "${extra%:*}" "${extra#*:}"
        done ;;
      sweep)  # one process per attention shape, one for the MLP and norm sweeps
        for extra in bert-s128 bert-s512 gpt-s2048; do
          [ "$extra" = bert-s512 ] && [ ${#quick[@]} -gt 0 ] && continue  # --quick leaves it out
          printf '%s\t%s--only attention --shapes %s\n' "sweep-$extra" "$(printf '%q ' "${cmd[@]}")" "$extra"
        done
        printf '%s\t%s--only mlp,norm\n' "sweep-mlp-norm" "$(printf '%q ' "${cmd[@]}")" ;;
      *) printf '%s\t%s\n' "$step" "$(printf '%q ' "${cmd[@]}")" ;;
    esac
  done
}

warm_phase() {  # every warm process at once, under one cap; failures logged in OUTDIR/warm and ignored
  local cap=$warm_cap left=$(( budget - ($(now) - started) ))
  [ $(( left / 2 )) -lt "$cap" ] && cap=$(( left / 2 ))
  local name line pids=() names=() wstart; wstart=$(date +%s)
  if [ "$dry_run" = 1 ]; then
    echo "warm phase (cap $cap s), all at once with TACHYON_BENCH_WARM=1:"
    warm_cmds | while IFS=$'\t' read -r name line; do echo "  [$name] $line"; done
    sim=$(( sim + cap ))
    return 0
  fi
  mkdir -p "$out/warm"
  while IFS=$'\t' read -r name line; do
    TACHYON_BENCH_WARM=1 TACHYON_BENCH_OUT="$out/warm" TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4} \
      timeout -k 5 "$cap" bash -c "exec $line" >"$out/warm/$name.log" 2>&1 &
    pids+=($!) names+=("$name")
  done < <(warm_cmds)
  local i failed=()
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || failed+=("${names[$i]} (exit $?)")
  done
  local msg="warm phase: ${#pids[@]} processes, $(( $(date +%s) - wstart )) s wall (cap $cap s)"
  [ ${#failed[@]} -gt 0 ] && msg+="; failed or cut off (ignored; logs in warm/): ${failed[*]}"
  echo "$msg" | tee -a "$out/summary.md"
}

timed() {  # timed NAME CMD...: run under min(the step's limit, the budget left)
  local name=$1; shift
  local cap; cap=$(step_limit "$name")
  [ "$limit" -gt 0 ] && cap=$limit
  local left=$(( budget - ($(now) - started) ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -le 5 ]; then echo "skipped $name: the budget of $budget s is spent"; return 124; fi
  if [ "$dry_run" = 1 ]; then
    echo "  [$name] limit $cap s (at most $(( $(now) - started + cap )) s in all): $(printf '%q ' "$@")"; sim=$(( sim + cap )); return 0
  fi
  timeout -k 5 "$cap" "$@"
}

to_summary() {  # to_summary LOG OK: a step's log into summary.md; streamed rows as a table
  local log=$1 ok=$2
  if [ "$ok" = 1 ]; then
    grep -v '^row |' "$log" >>"$out/summary.md"
  else  # cut off or failed: every row it measured, the tail of everything else
    if grep -q '^row |' "$log"; then
      echo "rows measured before it stopped:" >>"$out/summary.md"
      sed -n 's/^row //p' "$log" >>"$out/summary.md"
    fi
    grep -v '^row |' "$log" | tail -n 80 | tee -a "$out/summary.md"
  fi
}

if [ "$dry_run" = 1 ]; then
  echo "dry run: commit $TACHYON_COMMIT, budget $budget s, steps: $steps"
else
  {
    echo "# GPU run $(date -u +%Y-%m-%d) commit $TACHYON_COMMIT"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    $py -m tachyon info
  } | tee -a "$out/summary.md"
fi

[ "$warm_cap" -gt 0 ] && warm_phase

status=0
for step in $steps; do
  [ "$dry_run" = 1 ] || echo "## $step" | tee -a "$out/summary.md"
  start=$(date +%s)
  case "$step" in
    tests)
      extra=()
      $py -c "import xdist" 2>/dev/null && extra+=(-n "${TACHYON_TEST_WORKERS:-12}")
      $py -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 300)
      if [ "$dry_run" = 1 ]; then timed tests $py -m pytest -q -m gpu ${extra[@]+"${extra[@]}"} $tests; continue; fi
      export TACHYON_FAILURE_LOG="$out/gpu-failures.txt"
      # shellcheck disable=SC2086  # $tests is a list of paths
      timed tests $py -m pytest -q -m gpu -p no:cacheprovider --durations=15 ${extra[@]+"${extra[@]}"} $tests 2>&1 \
        | tee "$out/pytest-gpu.log" | tail -n 30
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      unset TACHYON_FAILURE_LOG
      if [ -s "$out/gpu-failures.txt" ]; then grep '^=== FAILED' "$out/gpu-failures.txt" | tee -a "$out/summary.md"; fi
      tail -n 1 "$out/pytest-gpu.log" >>"$out/summary.md"
      ;;
    *)
      case "$step" in smoke|profile) log=$out/$step.log ;; *) log=$out/bench_$step.log ;; esac
      mapfile -t cmd < <(step_cmd "$step")
      if [ ! -f "${cmd[1]}" ]; then echo "no step named $step" | tee -a "$out/summary.md"; status=1; continue; fi
      if [ "$dry_run" = 1 ]; then timed "$step" "${cmd[@]}"; continue; fi
      if timed "$step" "${cmd[@]}" >"$log" 2>&1; then to_summary "$log" 1
      else
        status=1
        echo "FAILED or cut off after $(( $(date +%s) - start )) s: see $(basename "$log")" | tee -a "$out/summary.md"
        to_summary "$log" 0
      fi
      ;;
  esac
  echo "($step: $(( $(date +%s) - start )) s; $(( $(date +%s) - started )) s in all)" | tee -a "$out/summary.md"
done
if [ -n "$tarball" ] && [ "$dry_run" = 0 ]; then
  tar czf "$tarball" -C "$(dirname "$out")" "$(basename "$out")" && echo "results: $tarball"
fi
exit $status
