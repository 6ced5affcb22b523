#!/usr/bin/env bash
# Install vLLM 0.33.0's own code into a kvpool test venv, for kvpool.integrations.vllm's tests
# and benchmarks/bench_vllm_tier.py:  tests/peers/install_vllm.sh VENV   (e.g. .venv)
#
# vLLM is not a kvpool dependency, and its full dependency tree (CUDA torch, flashinfer, ...)
# cannot install on a CPU machine. So the wheel is installed with --no-deps, plus the few
# packages that importing its offloading modules (vllm/v1/kv_offload/, the offloading
# connector's metrics) needs and that kvpool's own extras do not already bring; the venv is the
# one .ci/run builds (the torch, engine, remote and test extras). Versions come from
# constraints.txt. Nothing else is touched: no GPU code of vLLM is imported.
#
# Idempotent and fast: when every pinned version is already installed it only checks that
# (well under a second) and exits. PyPI (or the pip index configured) is the only source.
set -euo pipefail
VENV="${1:?usage: tests/peers/install_vllm.sh VENV}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_vllm.sh: no python at $PY" >&2; exit 2; }
PACKAGES=(vllm oss-harmony openai sniffio pybase64 cachetools cloudpickle py-cpuinfo xgrammar
          apache-tvm-ffi fastapi starlette partial-json-parser llguidance)

if "$PY" - "$ROOT/constraints.txt" "${PACKAGES[@]}" <<'PYEOF'
import importlib.metadata as md, re, sys
pins = {}
for line in open(sys.argv[1]):
    m = re.match(r"\s*([A-Za-z0-9_.-]+)==(\S+)", line)
    if m:
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
missing = []
for name in sys.argv[2:]:
    want = pins.get(name)
    if want is None:
        sys.exit(f"install_vllm.sh: {name} has no pin in constraints.txt")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != want:
        missing.append(f"{name}=={want}")
sys.exit(1 if missing else 0)
PYEOF
then
    echo "install_vllm.sh: vllm and its offloading imports are already installed in $VENV" >&2
    exit 0
fi
"$PY" -m pip install -q --disable-pip-version-check --no-deps -c "$ROOT/constraints.txt" \
    "${PACKAGES[@]}"
"$PY" -c "import vllm.v1.kv_offload.tiering.manager, vllm.v1.kv_offload.tiering.fs.manager" \
    || { echo "install_vllm.sh: vllm's offloading modules do not import" >&2; exit 1; }
echo "install_vllm.sh: installed vllm 0.33.0 (--no-deps) and its offloading imports into $VENV" >&2
