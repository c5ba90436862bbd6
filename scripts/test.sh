#!/usr/bin/env bash
# The README's second command: install everything (with dev tools), lint, type-check, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy engine service clients bench cuda tests
.venv/bin/pytest -ra "$@"
