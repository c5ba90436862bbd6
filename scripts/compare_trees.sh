#!/usr/bin/env bash
# Alternates an older commit and the working tree on the tiny model, in one run: batch-1 decode
# steps/s and the core's host work outside the forward at batch 256 (`bench.step`), and offline
# throughput of 256 mixed requests (`bench.offline`, deja alone). SKIP_OFFLINE=1 leaves out the
# offline run. The README's one-step figures came from `scripts/compare_trees.sh 2854be9`.
#
#   scripts/compare_trees.sh OLD_COMMIT [REPS]
set -euo pipefail
old=${1:?usage: scripts/compare_trees.sh OLD_COMMIT [REPS]}
reps=${2:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"
wt=$(mktemp -d /tmp/deja-old-XXXXXX)
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || rm -rf "$wt"; rm -f "$wt.step.json"' EXIT
git -C "$root" worktree add --detach "$wt" "$old" >/dev/null 2>&1
for rep in $(seq "$reps"); do
  for tree in "$wt" "$root"; do
    cd "$tree"
    steps=$(PYTHONPATH=$tree "$py" -m bench.step --model tiny --batches 1 --steps 400 2>&1 |
      awk '$1 == "1" {print $NF}')
    # the core's host work outside the forward, from the JSON (n/a where a tree's bench has none)
    PYTHONPATH=$tree "$py" -m bench.step --model tiny --batches 256 --steps 64 \
      --json "$wt.step.json" >/dev/null 2>&1 || true
    host=$("$py" -c 'import json, sys
try:
    print(round(json.load(open(sys.argv[1]))["results"][0]["ms"]["host"], 3))
except Exception:
    print("n/a")' "$wt.step.json")
    rm -f "$wt.step.json"
    offline=skipped
    [ -n "${SKIP_OFFLINE:-}" ] || offline=$(PYTHONPATH=$tree "$py" -m bench.offline --model tiny --skip-generate \
      --skip-generate-batch --parity 0 --num-requests 256 2>&1 |
      awk '/^deja \(ours\) / {print $(NF - 1)}')
    name=$([ "$tree" = "$root" ] && echo "working tree" || echo "$old")
    echo "rep $rep $name: batch-1 steps/s $steps, batch-256 host ms $host, offline tok/s $offline"
  done
done
