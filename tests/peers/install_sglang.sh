#!/usr/bin/env bash
# Install SGLang 0.5.23's own code into a virtual environment for kvpool's SGLang tests
# (tests/integrations/test_integration_sglang*.py), from PyPI only:
#
#   tests/peers/install_sglang.sh VENV        (e.g. tests/peers/install_sglang.sh .venv)
#
# VENV already holds kvpool with its test extras (torch CPU, redis, hypothesis, ...). The sglang
# wheel goes in with --no-deps (its full dependency list is a CUDA serving stack), then the few
# packages that importing its HiCache storage, storage factory, host pools and cache controller
# needs on a CPU machine, each pinned in constraints.txt and installed with --no-deps, so that
# nothing can replace the CPU torch. torchvision is the one import that PyPI cannot satisfy on a
# CPU torch; tests/peers/sglang_env.py serves it with an inert shim in the tests.
#
# Idempotent: when every pinned package is already installed it only checks, in about a second.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV" >&2
    exit 2
fi
VENV="$1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    echo "$0: $PY is not a Python interpreter (create the venv and install kvpool first)" >&2
    exit 2
fi

# sglang and the packages its HiCache modules import beyond kvpool's extras (exact pins in
# constraints.txt; found by importing them in a venv holding only kvpool's extras)
PACKAGES=(sglang orjson pybase64 triton starlette ipython traitlets dill apache-tvm-ffi
          sentencepiece compressed-tensors loguru)
PINS=()
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i -E "^${name//-/[-_]}==" "$ROOT/constraints.txt" | head -1 || true)
    if [ -z "$pin" ]; then
        echo "$0: $name has no exact pin in constraints.txt" >&2
        exit 2
    fi
    PINS+=("$pin")
done

if "$PY" - "${PINS[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
missing = []
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have != want:
        missing.append(pin)
sys.exit(1 if missing else 0)
PYEOF
then
    echo "[install_sglang] already installed: ${#PINS[@]} pinned packages (${PINS[0]}, ...)"
    exit 0
fi

echo "[install_sglang] installing ${PINS[*]} (--no-deps)"
"$PY" -m pip install -q --disable-pip-version-check --no-deps -c "$ROOT/constraints.txt" "${PINS[@]}"
"$PY" - <<'PYEOF'
import sys
import torch
if torch.version.cuda is not None:
    sys.exit(f"refusing: torch {torch.__version__} is a CUDA build; kvpool's tests use the CPU one")
PYEOF
echo "[install_sglang] done"
