#!/usr/bin/env bash
# The GPU figures of kvpool in one run (at most 8 minutes: every step has a timeout), into one JSON:
#   1. the CUDA tests: Triton copy kernel = torch bit for bit, host<->device included; the
#      engine's logit tests (equal greedy tokens on fp32 tiny models, reuse, offload,
#      preemption) on the GPU with CUDA graphs; a step under set_sync_debug_mode("error");
#   2. bench_copy.py on CUDA (copy_blocks, 256 KiB blocks, against one contiguous copy);
#   3. bench_engine.py --device cuda, bf16, random weights of SmolLM2's, Llama-3.2-1B's and
#      Llama-3-8B's shapes, against transformers' generate and generate_batch.
#
# Usage: benchmarks/gpu_check.sh [OUT.json]      (default results/gpu_check.json)
#        benchmarks/gpu_check.sh --dry [OUT.json] (CPU: every step, tiny sizes; checks the script)
# PYTHON picks the interpreter (default .venv/bin/python). Each step's exit status is recorded;
# the script goes on after a failed step and exits non-zero at the end if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry" ]; then dry=1; shift; fi
out=${1:-results/gpu_check.json}
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$(dirname "$out")"
: > "$work/steps"

step() {  # step NAME TIMEOUT_S CMD...: run, keep its status and time
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name: $*" >&2
    timeout "$limit" "$@" > "$work/$name.log" 2>&1
    rc=$?
    tail -n 25 "$work/$name.log" >&2
    echo "$name $rc $(( $(date +%s) - start ))" >> "$work/steps"
}

tests=(tests/tiers/test_copy_kernels.py tests/engine/test_engine_static.py tests/engine/test_engine_logits.py)
if [ "$dry" = 1 ]; then
    step tests 300 "$py" -m pytest -q -p no:cacheprovider -x "${tests[@]}" -k "not gpt_oss"
    step bench_copy 120 "$py" benchmarks/bench_copy.py --blocks 64 --repeats 1 \
        --no-alternatives --out "$work/bench_copy.json"
    step engine_smollm2 300 "$py" benchmarks/bench_engine.py --device cpu --dtype float32 \
        --random-weights smollm2 --layers 2 --quick --batch 4 --out "$work/engine_smollm2.json"
else
    step tests 120 env KVPOOL_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider \
        "${tests[@]}" tests/tiers/test_storage.py
    step bench_copy 45 "$py" benchmarks/bench_copy.py --quick --no-cpu \
        --out "$work/bench_copy.json"
    for shape in smollm2 llama-3.2-1b llama-3-8b; do
        quick=() limit=90
        [ "$shape" = llama-3-8b ] && quick=(--quick) limit=140
        step "engine_$shape" "$limit" "$py" benchmarks/bench_engine.py --device cuda \
            --dtype bfloat16 --random-weights "$shape" --batch 32 --repeats 2 "${quick[@]}" \
            --out "$work/engine_$shape.json"
    done
fi

"$py" - "$work" "$out" "$dry" <<'EOF'
import json, pathlib, subprocess, sys
work, out, dry = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3] == "1"
try:
    card = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout
except OSError:
    card = ""
result = {"dry": dry, "device": card.strip() or None, "steps": {}}
for line in (work / "steps").read_text().splitlines():
    name, rc, secs = line.split()
    log = (work / f"{name}.log").read_text(errors="replace").splitlines()
    entry = {"rc": int(rc), "seconds": int(secs), "log_tail": log[-15:]}
    path = work / f"{name}.json"
    if path.exists():
        entry["result"] = json.loads(path.read_text())
    result["steps"][name] = entry
out.write_text(json.dumps(result, indent=2) + "\n")
failed = [n for n, e in result["steps"].items() if e["rc"] != 0]
print(f"wrote {out}; failed steps: {failed or 'none'}")
sys.exit(1 if failed else 0)
EOF
