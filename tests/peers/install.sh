#!/usr/bin/env bash
# The other engines' own code for kvpool's integration tests: vLLM 0.33.0 and SGLang 0.5.23,
# each --no-deps with the few packages its modules import (pins in constraints.txt).
#   bash tests/peers/install.sh VENV   (e.g. .venv)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$HERE/install_vllm.sh" "${1:?usage: tests/peers/install.sh VENV}"
bash "$HERE/install_sglang.sh" "$1"
