"""``kvpool replay``: what hit rate and latency will a workload get, with this memory and this
routing policy?

Replays a workload (the built-in synthetic multi-turn workload by default, or a Mooncake JSONL
trace with ``--trace``) on a simulated cluster of engines, once per routing policy, and prints
one column per policy next to the workload's hit-rate bounds. See :mod:`kvpool.replay.cluster`
and :mod:`kvpool.replay.engine_sim` for the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool.config import CacheConfig
from kvpool.errors import InvalidArgumentError, KVPoolError
from kvpool.planner import ModelSpec, format_size, parse_size
from kvpool.replay.cluster import (
    POLICIES,
    TRANSPORTS,
    ClusterConfig,
    ReplayResult,
    block_cache,
    planned_cache,
    replay,
)
from kvpool.replay.engine_sim import SchedulerConfig, TimeModel
from kvpool.replay.report import render, to_json, to_markdown, write_plot
from kvpool.replay.workloads import (
    DEFAULT_TOKENS_PER_HASH_ID,
    SyntheticParams,
    Workload,
    generate_synthetic,
    load_mooncake,
)

DEFAULT_MODEL: Final = "llama-3-8b"
DEFAULT_GPU_MEM: Final = 8 << 30
DEFAULT_TOKENS_PER_BLOCK: Final = 32
DEFAULT_WORKERS: Final = 4

# (SyntheticParams field, flag, help): the synthetic workload's knobs on the command line.
_SYNTHETIC_FLAGS: Final = (
    ("num_requests", "--requests", "requests in all"),
    ("num_system_prompts", "--system-prompts", "distinct chat system prompts"),
    ("system_prompt_tokens", "--system-prompt-tokens", "tokens of each system prompt"),
    ("turns_per_conversation", "--turns", "mean turns of a chat conversation"),
    ("user_tokens", "--user-tokens", "mean tokens of a user message"),
    ("output_tokens", "--output-tokens", "mean output tokens of a turn"),
    ("agent_fraction", "--agent-fraction", "fraction of conversations that are agent sessions"),
    ("num_agent_prefixes", "--agent-prefixes", "distinct agent (tool definition) prefixes"),
    ("agent_prefix_tokens", "--agent-prefix-tokens", "tokens of each agent prefix"),
    ("agent_turns_per_conversation", "--agent-turns", "mean steps of an agent session"),
    ("tool_output_tokens", "--tool-output-tokens", "mean tokens of a tool result"),
    ("arrival_rate_per_s", "--rate", "new conversations per second (Poisson)"),
    ("think_time_s", "--think-time", "mean extra gap between chat turns (s)"),
    ("agent_think_time_s", "--agent-think-time", "mean extra gap between agent steps (s)"),
    ("min_think_time_s", "--min-think-time", "minimum gap between turns (s)"),
    ("max_prompt_tokens", "--max-prompt-tokens", "longest prompt"),
)

# TimeModel field -> (flag, unit scale from the flag's unit to seconds, unit)
_TIME_FLAGS: Final = (
    ("weight_read_s", "--weight-read-ms", 1e-3, "ms", "step floor (weights read)"),
    ("token_compute_s", "--token-compute-us", 1e-6, "us", "linear layers per token"),
    ("attention_pair_s", "--attention-pair-ns", 1e-9, "ns", "prefill attention per token pair"),
    ("kv_read_s", "--kv-read-ns", 1e-9, "ns", "decode attention per context token"),
)


def register(subparsers: Any) -> None:
    """Add the ``replay`` parser to the ``kvpool`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="replay a workload on simulated engines and compare routing policies",
        description=(
            "Replay a workload on a simulated cluster: real kvpool managers (metadata only) "
            "behind a continuous-batching scheduler with a GPU time model, fed by the KV-aware "
            "router through the real event path. Each routing policy replays the same "
            "workload on a fresh cluster; the table compares them with the workload's "
            "unlimited-cache bound and each run's Belady bound. With no argument: the "
            "built-in synthetic multi-turn workload on 4 workers."
        ),
        formatter_class=_DefaultsFormatter,
    )
    w = p.add_argument_group("workload (default: the built-in synthetic multi-turn workload)")
    w.add_argument("--trace", type=Path, metavar="FILE", help="a Mooncake-format JSONL trace")
    w.add_argument("--limit", type=_positive, metavar="N", help="first N requests of the trace")
    w.add_argument(
        "--tokens-per-hash-id", type=_positive, default=DEFAULT_TOKENS_PER_HASH_ID,
        metavar="N", help="tokens one trace hash id stands for",
    )
    w.add_argument(
        "--seed", type=_nonneg, default=0, metavar="N",
        help="seed of the synthetic workload, of trace token ids, generated tokens and the "
        "random policy",
    )
    defaults = SyntheticParams()
    for name, flag, text in _SYNTHETIC_FLAGS:
        value = getattr(defaults, name)
        real = isinstance(value, float)
        kind: Callable[[str], Any] = _nonneg_float if real else _positive
        w.add_argument(flag, dest=f"syn_{name}", type=kind, default=value,
                       metavar="X" if real else "N", help=f"synthetic: {text}")

    c = p.add_argument_group("cluster")
    c.add_argument("--workers", type=_positive, default=DEFAULT_WORKERS, metavar="N",
                   help="simulated engines")
    c.add_argument(
        "--policies", type=_policies, default=",".join(POLICIES), metavar="LIST",
        help=f"routing policies to compare, comma-separated ({', '.join(POLICIES)})",
    )
    c.add_argument("--transport", choices=TRANSPORTS, default="inproc",
                   help="how events reach the router (zmq: vLLM msgpack over 127.0.0.1)")
    c.add_argument(
        "--jobs", type=_positive, default=min(2, os.cpu_count() or 1), metavar="N",
        help="policies replayed at once (processes); results do not depend on it",
    )

    m = p.add_argument_group("memory (per worker)")
    m.add_argument("--model", default=DEFAULT_MODEL, metavar="PRESET",
                   help="model preset the planner sizes blocks for (see kvpool plan "
                   "--list-models)")
    m.add_argument(
        "--gpu-mem", type=_size, metavar="SIZE",
        help=f"GPU KV budget (default: {format_size(DEFAULT_GPU_MEM)}, raised to what the "
        "workload's longest request needs)",
    )
    m.add_argument("--host-mem", type=_size, default=0, metavar="SIZE", help="host KV budget")
    m.add_argument("--disk-mem", type=_size, default=0, metavar="SIZE", help="disk KV budget")
    m.add_argument("--gpu-blocks", type=_positive, metavar="N",
                   help="GPU blocks instead of a model and budgets (one full-attention group)")
    m.add_argument("--host-blocks", type=_nonneg, default=0, metavar="N",
                   help="host blocks (with --gpu-blocks)")
    m.add_argument("--disk-blocks", type=_nonneg, default=0, metavar="N",
                   help="disk blocks (with --gpu-blocks)")
    m.add_argument("--tokens-per-block", type=_positive, default=DEFAULT_TOKENS_PER_BLOCK,
                   metavar="N", help="tokens per block")
    m.add_argument("--no-partial-reuse", action="store_true",
                   help="reuse whole blocks only")

    s = p.add_argument_group("scheduler and time model (per worker)")
    sched = SchedulerConfig()
    s.add_argument("--max-batch-size", type=_positive, default=sched.max_batch_size,
                   metavar="N", help="concurrent sequences")
    s.add_argument("--max-num-tokens", type=_positive, default=sched.max_num_tokens,
                   metavar="N", help="tokens per scheduler step")
    s.add_argument("--no-chunked-prefill", action="store_true",
                   help="compute each prompt in one step")
    tm = TimeModel()
    for name, flag, scale, unit, text in _TIME_FLAGS:
        s.add_argument(flag, dest=f"tm_{name}", type=_nonneg_float,
                       default=round(getattr(tm, name) / scale, 6), metavar=unit.upper(),
                       help=f"{text} ({unit})")

    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    o.add_argument("--plot", type=Path, metavar="PATH",
                   help="plot hit rate and TTFT per policy over time (PNG)")
    o.add_argument("--markdown", type=Path, metavar="PATH",
                   help="write a markdown table ('-' prints it)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` where a default says something (not None, not a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def run(args: argparse.Namespace) -> int:
    """Load the workload, size the cluster, replay every policy and report."""
    console = Console()
    workload = _workload(args)
    config = _cluster(args, workload)
    progress_console = Console(stderr=True)
    show = not args.no_progress and progress_console.is_terminal
    if show:
        with Progress(
            TextColumn("{task.description:>13}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=progress_console,
            transient=True,
        ) as bar:
            tasks = {
                p: bar.add_task(p, total=len(workload), start=False) for p in args.policies
            }

            def progress(policy: str) -> Callable[[int], None]:
                task = tasks[policy]

                def advance(n: int) -> None:
                    bar.start_task(task)
                    bar.advance(task, n)

                return advance

            result = replay(workload, config, args.policies, progress=progress, jobs=args.jobs)
    else:
        result = replay(workload, config, args.policies, jobs=args.jobs)
    render(result, console)
    _write_outputs(args, result, console)
    return 0


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        return load_mooncake(
            args.trace, tokens_per_hash_id=args.tokens_per_hash_id, limit=args.limit,
            seed=args.seed,
        )
    if args.limit is not None:
        raise InvalidArgumentError("--limit applies to --trace; use --requests for the "
                                   "synthetic workload")
    params = {name: getattr(args, f"syn_{name}") for name, _, _ in _SYNTHETIC_FLAGS}
    return generate_synthetic(SyntheticParams(seed=args.seed, **params))


def _cluster(args: argparse.Namespace, workload: Workload) -> ClusterConfig:
    scheduler = SchedulerConfig(
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        chunked_prefill=not args.no_chunked_prefill,
    )
    time_model = TimeModel(**{
        name: getattr(args, f"tm_{name}") * scale for name, _, scale, _, _ in _TIME_FLAGS
    })
    tpb = args.tokens_per_block
    longest = max(len(r.tokens) + r.output_length for r in workload.requests)
    partial = not args.no_partial_reuse
    description: dict[str, Any]
    cache: CacheConfig
    if args.gpu_blocks is not None:
        if args.gpu_mem is not None or args.host_mem or args.disk_mem:
            raise InvalidArgumentError("--gpu-blocks replaces --gpu-mem/--host-mem/--disk-mem")
        cache = block_cache(
            args.gpu_blocks, host_blocks=args.host_blocks, disk_blocks=args.disk_blocks,
            tokens_per_block=tpb, partial_reuse=partial,
        )
        description = {"gpu_blocks": args.gpu_blocks, "host_blocks": args.host_blocks,
                       "disk_blocks": args.disk_blocks}
    else:
        if args.host_blocks or args.disk_blocks:
            raise InvalidArgumentError("--host-blocks/--disk-blocks need --gpu-blocks")
        model = ModelSpec.preset(args.model)
        gpu = args.gpu_mem
        if gpu is None:
            gpu = max(DEFAULT_GPU_MEM, _fit_budget(model, longest, tpb))
        cache, _ = planned_cache(
            model, gpu_bytes=gpu, host_bytes=args.host_mem, disk_bytes=args.disk_mem,
            tokens_per_block=tpb, scheduler=scheduler,
            max_seq_len=max(model.max_seq_len, longest), partial_reuse=partial,
        )
        description = {
            "model": args.model,
            "gpu_mem": format_size(gpu),
            "host_mem": format_size(args.host_mem) if args.host_mem else None,
            "disk_mem": format_size(args.disk_mem) if args.disk_mem else None,
            "gpu_mem_auto": args.gpu_mem is None,
        }
    return ClusterConfig(
        cache=cache, workers=args.workers, scheduler=scheduler, time_model=time_model,
        transport=args.transport, seed=args.seed, description=description,
    )


def _fit_budget(model: ModelSpec, longest: int, tpb: int) -> int:
    """The smallest whole GiB holding one request of ``longest`` tokens in every group (the
    planner adds its own floors; a CapacityError then names what is missing)."""
    blocks = -(-longest // tpb)
    per_block = sum(g.bytes_per_block(tpb) for g in model.layer_groups())
    gib = 1 << 30
    return -(-(blocks * per_block) // gib) * gib


def _write_outputs(args: argparse.Namespace, result: ReplayResult, console: Console) -> None:
    if args.json is not None:
        _write(args.json, json.dumps(to_json(result), indent=2) + "\n")
        console.print(f"wrote {args.json}")
    if args.markdown is not None:
        text = to_markdown(result)
        if str(args.markdown) == "-":
            sys.stdout.write(text)
        else:
            _write(args.markdown, text)
            console.print(f"wrote {args.markdown}")
    if args.plot is not None:
        write_plot(result, args.plot)
        console.print(f"wrote {args.plot}")


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise KVPoolError(f"cannot write {path}: {exc.strerror or exc}") from None


# ----------------------------------------------------------------------------- arg types


def _policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad) or repr(text)}; valid: {', '.join(POLICIES)}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"policies repeat: {text}")
    return names


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int(text: str, lo: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < lo:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _int(text, 1)


def _nonneg(text: str) -> int:
    return _int(text, 0)


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value
