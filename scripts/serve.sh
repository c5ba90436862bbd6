#!/usr/bin/env bash
# The README's first command: install everything, then serve the demo model over gRPC.
# Extra arguments go to `deja serve` (see `deja serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/deja serve "$@"
