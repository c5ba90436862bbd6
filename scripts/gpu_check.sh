#!/usr/bin/env bash
# GPU bring-up check: runs, in order, each step logging to $OUT/<step>.log (default ./gpu_logs):
#   tests     pytest tests/gpu -x (override the flags with GPU_PYTEST_ARGS)
#   sanitize  compute-sanitizer memcheck + racecheck on one decode (plain and split-K) and one
#             prefill launch (scripts/gpu_sanitize_case.py), checking deja's kernels only
#   sanitize-graph  compute-sanitizer memcheck on a tiny engine replaying decode CUDA graphs
#   graphs    pytest tests/gpu/test_cuda_graphs.py (replay vs eager, token-exact)
#   step      deja bench step on the 1B bench model: CUDA graphs with --async-scheduling, without,
#             and --enforce-eager (STEP_MODES overrides the list; "sync" is the plain run)
#   kernels   deja bench kernels (bench/kernels.py)
#   gpu-quick deja bench gpu --quick (bench/gpu_engine.py)
#   gpu       deja bench gpu (512 requests, cupy and torch backends, transformers baseline)
#   tiers     CPU tier on CUDA: swap-in / spill through KVStore vs torch pinned copies (bench/tiers_gpu.py)
#   parity    greedy parity bf16, cupy vs torch backend, on the engine (tests/gpu/test_engine_gpu.py)
#
#   scripts/gpu_check.sh                 all steps
#   scripts/gpu_check.sh kernels tiers   only those, in the order given
# Run from the repository root; PYTHON picks the interpreter (default python3). Stops at the
# first failing step (exit status of that step) unless KEEP_GOING=1.
set -euo pipefail

OUT="${OUT:-gpu_logs}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1 DEJA_CACHE_DIR="${DEJA_CACHE_DIR:-/tmp/deja-cache}"

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize kernels gpu-quick gpu tiers parity)

# Only deja's kernels (mangled names hold the namespace); torch's own are not ours to check.
SANITIZE_FILTER=()
if command -v compute-sanitizer >/dev/null &&
  compute-sanitizer --help 2>&1 | grep -q -- "--kernel-name "; then
  SANITIZE_FILTER=(--kernel-name kns=deja)
fi

sanitize() {
  local tool
  for tool in memcheck racecheck; do
    for case in decode prefill; do
      echo "== compute-sanitizer --tool $tool: $case"
      compute-sanitizer --tool "$tool" --error-exitcode 1 "${SANITIZE_FILTER[@]}" \
        "$PY" scripts/gpu_sanitize_case.py "$case"
    done
  done
}

run_step() {
  case "$1" in
    sanitize-graph)
      compute-sanitizer --tool memcheck --error-exitcode 1 "${SANITIZE_FILTER[@]}" \
        "$PY" scripts/gpu_sanitize_case.py graph ;;
    graphs) "$PY" -m pytest tests/gpu/test_cuda_graphs.py -v -s -p no:cacheprovider ;;
    step)
      local model
      model=$("$PY" -c 'from bench.gpu_engine import ensure_random_llama as e; from pathlib import Path; import os; print(e(Path(os.environ["DEJA_CACHE_DIR"]), "bfloat16"))')
      for mode in ${STEP_MODES:---async-scheduling sync --enforce-eager}; do
        [ "$mode" = sync ] && mode=""
        echo "== bench step ${mode:-(graphs, no async scheduling)}"
        "$PY" -m bench.step --device cuda --model "$model" --dtype bfloat16 \
          --batches "${STEP_BATCHES:-1,16,64,256}" --steps 32 $mode
      done ;;
    tests) "$PY" -m pytest tests/gpu ${GPU_PYTEST_ARGS:--x} -q -rs -p no:cacheprovider ;;
    sanitize) sanitize ;;
    kernels) "$PY" -m bench.kernels --json "$OUT/kernels.json" ;;
    gpu-quick) "$PY" -m bench.gpu_engine --quick ;;
    gpu) "$PY" -m bench.gpu_engine --backends "${GPU_BACKENDS:-cupy,cupy-async,cupy-eager,torch}" \
      --json "$OUT/gpu_engine.json" ;;
    tiers) "$PY" -m bench.tiers_gpu --json "$OUT/tiers_gpu.json" ;;
    parity)
      "$PY" -m pytest tests/gpu/test_engine_gpu.py -v -s -p no:cacheprovider \
        -k "cupy_matches_torch_backend" ;;
    *) echo "unknown step $1" >&2; return 2 ;;
  esac
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__)' || true
} 2>&1 | tee "$OUT/env.log"

for step in "${steps[@]}"; do
  echo "===== $step ($(date -u +%T))"
  start=$SECONDS
  if run_step "$step" 2>&1 | tee "$OUT/$step.log"; then
    echo "===== $step passed in $((SECONDS - start)) s"
  else
    status=$?
    echo "===== $step FAILED (exit $status) after $((SECONDS - start)) s"
    [ -n "${KEEP_GOING:-}" ] || exit "$status"
  fi
done
