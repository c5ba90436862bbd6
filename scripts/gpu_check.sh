#!/usr/bin/env bash
# The GPU check: runs, in order, each step logging to <log dir>/<step>.log and one verdict line
# to <log dir>/verdicts.txt, each step under its own time limit.
#
#   scripts/gpu_check.sh verify               the prepared check (below), continuing past failures
#   scripts/gpu_check.sh kernels tiers        only those steps, in the order given
#   scripts/gpu_check.sh --dry-run verify     on any machine: every step known, every command and
#                                             Python entry point parses, every file the steps read
#                                             tracked by git, the tree small enough to travel
#
# `verify`, correctness first (about 8 minutes on an H200 from a bare machine; GPU_BUDGET_S bounds it):
#   tests-all       pytest tests/gpu, all of it: kernels (sliding window, soft-capping), the engine
#                   against transformers and the torch backend (fp8 KV cache too), every family
#                   (mixture of experts on torch._grouped_mm), decode graphs and async scheduling
#                   token-exact with eager (tiny and 1B models), tiers, one-rank NCCL tensor
#                   parallelism, speculative decoding's verification under cupy
#   sanitize-graph  compute-sanitizer memcheck on a tiny engine replaying decode graphs with the
#                   layer kernels
#   gpu             deja bench gpu: the 1B workload, cupy with graphs and with async scheduling,
#                   against transformers in the same run
#   step            deja bench step at batch 1 and 64: async scheduling and plain graphs (GPU idle
#                   share and host time per step)
#   sanitize        compute-sanitizer memcheck + racecheck on one decode (plain and split-K) and
#                   one prefill launch
#
# Other steps: tests (pytest tests/gpu -x), graphs, kernels, gpu-quick, tiers, parity.
#
# Environment: PYTHON (default python3); GPU_LOG_DIR (default $OUT, else ./gpu_logs);
# GPU_BUNDLE (a .tgz of the log dir rewritten after every step: the device tool brings back few
# files); GPU_BUDGET_S (default 480: a step starts only with 20 s of it left and runs at most
# what is left); KEEP_GOING=1 continues past a failing step outside `verify` too; STEP_BATCHES,
# STEP_MODES, GPU_BACKENDS, GPU_PYTEST_ARGS as below.
set -euo pipefail

PY="${PYTHON:-python3}"
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
VERIFY=(tests-all sanitize-graph gpu step sanitize)
ALL_STEPS=(tests tests-all graphs sanitize sanitize-graph step kernels gpu-quick gpu tiers parity)
# Each step's own limit in seconds (also bounded by what is left of GPU_BUDGET_S).
declare -A LIMIT=([tests]=240 [tests-all]=330 [graphs]=60 [sanitize]=90 [sanitize-graph]=60
  [step]=75 [kernels]=120 [gpu-quick]=90 [gpu]=100 [tiers]=60 [parity]=90)

SANITIZE_FILTER=()
sanitize_filter() {
  # Only deja's kernels (mangled names hold the namespace); torch's own are not ours to check.
  if command -v compute-sanitizer >/dev/null &&
    compute-sanitizer --help 2>&1 | grep -q -- "--kernel-name "; then
    SANITIZE_FILTER=(--kernel-name kns=deja)
  fi
}

bench_model() {
  "$PY" -c 'from engine.testing.tiny_models import ensure_random_llama as e; from pathlib import Path; import os; print(e(Path(os.environ["DEJA_CACHE_DIR"]), "bfloat16"))'
}

run_step() {
  local step=$1 tool case mode model
  sanitize_filter
  case "$step" in
    tests) "$PY" -m pytest tests/gpu ${GPU_PYTEST_ARGS:--x} -q -rs -p no:cacheprovider ;;
    tests-all)  # the engine-level tests first, the kernel sweep (454 launches' worth) last
      "$PY" -m pytest tests/gpu/test_cuda_graphs.py tests/gpu/test_engine_gpu.py \
        tests/gpu/test_families_gpu.py tests/gpu/test_nccl_one_rank.py tests/gpu/test_tiers_gpu.py \
        tests/gpu/test_spec_decode_gpu.py tests/gpu/test_quant_gpu.py tests/gpu/test_kernels.py \
        -q -rs --durations=12 -p no:cacheprovider ;;
    graphs) "$PY" -m pytest tests/gpu/test_cuda_graphs.py -v -s -p no:cacheprovider ;;
    sanitize)
      for tool in memcheck racecheck; do
        for case in decode prefill; do
          echo "== compute-sanitizer --tool $tool: $case"
          compute-sanitizer --tool "$tool" --error-exitcode 1 "${SANITIZE_FILTER[@]}" \
            "$PY" scripts/gpu_sanitize_case.py "$case"
        done
      done ;;
    sanitize-graph)
      compute-sanitizer --tool memcheck --error-exitcode 1 "${SANITIZE_FILTER[@]}" \
        "$PY" scripts/gpu_sanitize_case.py graph ;;
    step)
      model=$(bench_model)
      for mode in ${STEP_MODES:---async-scheduling sync}; do
        [ "$mode" = sync ] && mode=""
        echo "== bench step ${mode:-(graphs, no async scheduling)}"
        "$PY" -m bench.step --device cuda --model "$model" --dtype bfloat16 \
          --batches "${STEP_BATCHES:-1,64}" --steps 32 $mode
      done ;;
    kernels) "$PY" -m bench.kernels --json "$LOGS/kernels.json" ;;
    gpu-quick) "$PY" -m bench.gpu_engine --quick ;;
    gpu) "$PY" -m bench.gpu_engine --backends "${GPU_BACKENDS:-cupy,cupy-async}" \
      --json "$LOGS/gpu_engine.json" ;;
    tiers) "$PY" -m bench.tiers_gpu --json "$LOGS/tiers_gpu.json" ;;
    parity)
      "$PY" -m pytest tests/gpu/test_engine_gpu.py -v -s -p no:cacheprovider \
        -k "cupy_matches_torch_backend" ;;
    *) echo "unknown step $step" >&2; return 2 ;;
  esac
}

# Files each step reads besides the engine itself (checked by --dry-run).
STEP_FILES=(scripts/gpu_check.sh scripts/gpu_sanitize_case.py tests/support/kernel_reference.py
  bench/step.py bench/gpu_engine.py bench/kernels.py bench/tiers_gpu.py engine/testing/tiny_models.py
  bench/hf_baselines.py tests/conftest.py)

dry_run() {
  local fail=0 step f size
  ok() { echo "ok    $*"; }
  bad() { echo "FAIL  $*"; fail=1; }
  bash -n "$SELF" && ok "bash -n $SELF" || bad "bash -n $SELF"
  for step in "${steps[@]}"; do
    [ -n "${LIMIT[$step]:-}" ] && ok "step $step (limit ${LIMIT[$step]} s)" || bad "unknown step $step"
  done
  for f in "${STEP_FILES[@]}" tests/gpu/*.py cuda/*.cu; do
    if git ls-files --error-unmatch "$f" >/dev/null 2>&1; then :; else bad "$f is not tracked by git"; fi
  done
  ok "every file the steps read is tracked"
  for f in tests/gpu/test_*.py; do
    grep -q "$f" "$SELF" || bad "$f is not in the tests-all step's list"
  done
  size=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  if [ "$size" -lt $((60 * 1024 * 1024)) ]; then ok "tracked tree $((size / 1024)) KiB (< 60 MiB)"
  else bad "tracked tree $((size / 1024)) KiB: over what the device tool carries (64 MiB)"; fi
  for f in bench.step bench.gpu_engine bench.kernels bench.tiers_gpu; do
    if "$PY" -m "$f" --help >/dev/null 2>&1; then ok "python -m $f --help"; else bad "python -m $f --help"; fi
  done
  if "$PY" scripts/gpu_sanitize_case.py graph-cpu >"$LOGS/graph-cpu.log" 2>&1; then
    ok "gpu_sanitize_case.py graph-cpu (the graph case's engine, on the CPU)"
  else bad "scripts/gpu_sanitize_case.py graph-cpu (see $LOGS/graph-cpu.log)"; fi
  if "$PY" -m py_compile scripts/gpu_sanitize_case.py; then ok "py_compile gpu_sanitize_case.py"
  else bad "py_compile scripts/gpu_sanitize_case.py"; fi
  if "$PY" -c 'import engine.testing.tiny_models as g; assert callable(g.ensure_random_llama)'; then
    ok "engine.testing.tiny_models.ensure_random_llama"; else bad "engine.testing.tiny_models.ensure_random_llama"; fi
  # Without cupy or CUDA the GPU test modules skip before their own imports: resolve those here.
  if "$PY" - tests/gpu/*.py <<'PYEOF'
import ast, importlib, importlib.abc, importlib.util, sys
class Absent(importlib.abc.MetaPathFinder):  # packages the GPU machine lacks (FACTS.md): redis
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"redis"}:
            raise ImportError(f"{name} is not on the GPU machine: import it only where it is used")
sys.meta_path.insert(0, Absent())
def top_names(path):  # a GPU test module's own names (importing it skips without cupy)
    names = set()
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names

bad = []
for path in sys.argv[1:]:
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if not isinstance(node, ast.ImportFrom) or not node.module or node.module.startswith("cupy"):
            continue
        if node.module.startswith("tests.gpu."):
            have = top_names(node.module.replace(".", "/") + ".py")
            bad += [f"{path}: {node.module}.{a.name}" for a in node.names if a.name not in have]
            continue
        mod = importlib.import_module(node.module)
        bad += [f"{path}: {node.module}.{a.name}" for a in node.names if not hasattr(mod, a.name)
                and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
print("\n".join(bad))
sys.exit(1 if bad else 0)
PYEOF
  then ok "every name the GPU tests import exists (without redis)"; else bad "a GPU test imports a missing name"; fi
  # Collection imports every GPU test module and resolves its parameters; without cupy or CUDA
  # the modules skip, so this also runs with the module-level guards turned off.
  if "$PY" -m pytest tests/gpu --collect-only -q -p no:cacheprovider >"$LOGS/collect.log" 2>&1; then
    ok "pytest --collect-only tests/gpu ($(grep -c '::' "$LOGS/collect.log" || true) tests)"
  else bad "pytest --collect-only tests/gpu (see $LOGS/collect.log)"; fi
  for step in "${steps[@]}"; do
    case "$step" in sanitize | sanitize-graph)
      if command -v compute-sanitizer >/dev/null; then ok "compute-sanitizer found"
      else echo "note  compute-sanitizer is not on this machine (it is on the GPU machine)"; fi ;;
    esac
  done
  [ "$fail" = 0 ] && echo "dry run: ok" || echo "dry run: FAILED"
  return "$fail"
}

verdict_of() {  # the line a step's verdict quotes: pytest's summary, a ratio, or the log's end
  local log=$1
  grep -E "[0-9]+ (passed|failed|errors?)|/ transformers|ERROR SUMMARY|: (NOT )?MET" "$log" \
    2>/dev/null | tail -3 | tr '\n' ' ' | cut -c1-300 ||
    true
}

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ "${1:-}" = "--step" ]; then  # one step, run by the loop below under its time limit
  LOGS="$2"
  run_step "$3"
  exit
fi
cd "$(dirname "$SELF")/.."
LOGS="${GPU_LOG_DIR:-${OUT:-gpu_logs}}"
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1 DEJA_CACHE_DIR="${DEJA_CACHE_DIR:-/tmp/deja-cache}"

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(verify)
keep_going="${KEEP_GOING:-}"
if [ "${steps[*]}" = verify ]; then steps=("${VERIFY[@]}"); keep_going=1; fi

if [ "$DRY" = 1 ]; then dry_run; exit; fi

budget="${GPU_BUDGET_S:-480}"
start_all=$SECONDS
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__)' || true
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$LOGS/env.log"
: >"$LOGS/verdicts.txt"

status_all=0
for step in "${steps[@]}"; do
  left=$((budget - (SECONDS - start_all)))
  limit=${LIMIT[$step]:-120}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "SKIPPED  $step: the budget ($budget s) is spent" | tee -a "$LOGS/verdicts.txt"
    continue
  fi
  echo "===== $step ($(date -u +%T), limit $limit s)"
  start=$SECONDS
  rc=0
  timeout -k 10 "$limit" bash "$SELF" --step "$LOGS" "$step" 2>&1 | tee "$LOGS/$step.log" ||
    rc=${PIPESTATUS[0]}
  took=$((SECONDS - start))
  case "$rc" in
    0) word=PASSED ;;
    124 | 137) word="TIMED OUT" ;;
    *) word="FAILED (exit $rc)" ;;
  esac
  echo "$word  $step in $took s: $(verdict_of "$LOGS/$step.log")" | tee -a "$LOGS/verdicts.txt"
  if [ -n "${GPU_BUNDLE:-}" ]; then tar czf "$GPU_BUNDLE" -C "$LOGS" . || true; fi
  if [ "$rc" != 0 ]; then
    status_all=$rc
    [ -n "$keep_going" ] || break
  fi
done
echo "===== verdicts ($((SECONDS - start_all)) s in all)"
cat "$LOGS/verdicts.txt"
exit "$status_all"
