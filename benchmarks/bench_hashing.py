"""Block hashing throughput, per algorithm, the way the manager and the router hash.

Workload: ``--sequences`` prompts (default 100) of ``--blocks`` full blocks (default 1,000) of
``--tpb`` tokens (default 32), i.e. 100,000 blocks, as Python lists of ints drawn uniformly from
a ``--vocab``-sized vocabulary (default Llama 3's 128,256). Modes:

* ``extend(prompt)``: a fresh :class:`BlockHasher` per sequence fed the whole prompt at once
  (the manager admitting a request); the targets apply to this mode.
* ``extend(block)``: one ``extend`` call per block (chunked prefill).
* ``extend(token)``: one call per token (decode), on a tenth of the sequences.
* ``request_block_hashes``: the router's one-shot hashes of each prompt (event encodings
  included; it hashes the prompt minus its last token).

Each mode runs ``--repeat`` times with the garbage collector paused (as ``timeit`` does); the
table shows the best wall-clock rate (``Mtok/s``, which the targets judge) and the best rate by
process CPU time (``Mtok/s cpu``, less disturbed by other load on a shared machine).
``--quick`` shrinks the workload for a smoke run; ``--algos`` and ``--modes`` pick a subset.
``v1_block_key`` runs numba's kernel when the ``jit`` extra is installed (the ``backend``
column says which ran); ``--no-jit`` measures the pure-Python chain instead.

    .venv/bin/python benchmarks/bench_hashing.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable
from typing import Any

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.hashing import jit
from kvpool.hashing.keys import BlockHasher, HashAlgo, request_block_hashes

# Million tokens per second, extend(prompt) mode, on the 2-core development machine.
TARGETS_MTOK_S = {
    HashAlgo.V1_BLOCK_KEY: 4.0,
    HashAlgo.V2_SHA256: 20.0,
    HashAlgo.V2_SHA256_64: 20.0,
    HashAlgo.VLLM_SHA256_CBOR: 3.0,
}


MODES = ("extend(prompt)", "extend(block)", "extend(token)", "request_block_hashes")


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Best wall-clock and best CPU seconds of ``repeat`` runs of ``fn``."""
    wall, cpu = [], []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return min(wall), min(cpu)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    tpb = args.tpb
    n_tok = args.blocks * tpb
    prompts = [[rng.randrange(args.vocab) for _ in range(n_tok)] for _ in range(args.sequences)]
    chunked = [[p[i:i + tpb] for i in range(0, n_tok, tpb)] for p in prompts]
    decode = [[[t] for t in p] for p in prompts[: max(1, args.sequences // 10)]]

    rows: list[dict[str, Any]] = []
    for algo in args.algos or list(HashAlgo):

        def whole(algo: HashAlgo = algo) -> None:
            for p in prompts:
                BlockHasher(algo, tpb).extend(p)

        def per_block(algo: HashAlgo = algo) -> None:
            for chunks in chunked:
                extend = BlockHasher(algo, tpb).extend
                for c in chunks:
                    extend(c)

        def per_token(algo: HashAlgo = algo) -> None:
            for singles in decode:
                extend = BlockHasher(algo, tpb).extend
                for s in singles:
                    extend(s)

        def one_shot(algo: HashAlgo = algo) -> None:
            for p in prompts:
                request_block_hashes(p, tpb, algo)

        modes: list[tuple[str, Callable[[], None], int]] = [
            ("extend(prompt)", whole, len(prompts) * n_tok),
            ("extend(block)", per_block, len(prompts) * n_tok),
            ("extend(token)", per_token, len(decode) * n_tok),
            ("request_block_hashes", one_shot, len(prompts) * (n_tok - 1)),
        ]
        for mode, fn, tokens in modes:
            if args.modes and mode not in args.modes:
                continue
            wall, cpu = _time(fn, args.repeat)
            target = TARGETS_MTOK_S[algo] if mode == "extend(prompt)" else None
            mtok = tokens / wall / 1e6
            rows.append({
                "algorithm": algo.value,
                "backend": jit.backend() if algo is HashAlgo.V1_BLOCK_KEY else "python",
                "mode": mode,
                "tokens": tokens,
                "Mtok/s": round(mtok, 2),
                "Mtok/s cpu": round(tokens / cpu / 1e6, 2) if cpu > 0 else None,
                "ns/block": round(wall / (tokens / tpb) * 1e9),
                "target": target,
                # a --quick smoke run (one repeat, the JIT's first call in it) judges nothing
                "met": None if target is None or args.quick
                else ("yes" if mtok >= target else "NO"),
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sequences", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=1000, help="full blocks per sequence")
    parser.add_argument("--tpb", type=int, default=32, help="tokens per block")
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="10 sequences, 1 repeat: a smoke run, targets not judged")
    parser.add_argument("--no-jit", action="store_true",
                        help="v1_block_key on the pure-Python path even with numba installed")
    parser.add_argument(
        "--modes", type=lambda v: v.split(","), default=None,
        help="comma-separated subset of: " + ", ".join(MODES),
    )
    parser.add_argument(
        "--algos", type=lambda v: [HashAlgo(a) for a in v.split(",")], default=None,
        help="comma-separated subset of: " + ", ".join(a.value for a in HashAlgo),
    )
    args = parser.parse_args(argv)
    unknown = set(args.modes or ()) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.quick:
        args.sequences, args.repeat = 10, 1
    jit.set_enabled(not args.no_jit)
    rows = run(args)
    report(
        "hashing",
        rows,
        title=f"block hashing: {args.sequences} sequences x {args.blocks} blocks x {args.tpb} "
        f"tokens (best of {args.repeat})",
        extra={"config": vars(args)},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
