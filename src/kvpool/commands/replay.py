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
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool.commands._args import (
    HelpFormatter,
    check_writable,
    nonneg,
    nonneg_float,
    note,
    positive,
    positive_float,
    size,
    warn,
)
from kvpool.config import CacheConfig
from kvpool.errors import InvalidArgumentError, KVPoolError
from kvpool.planner.capacity import ModelSpec, format_size
from kvpool.replay.cluster import (
    POLICIES,
    TRANSPORTS,
    ClusterConfig,
    ReplayResult,
    block_cache,
    planned_cache,
    replay,
)
from kvpool.replay.report import render, to_json, to_markdown, write_plot
from kvpool.replay.simmodel import SchedulerConfig, TimeModel, gpu_capacity, peak_blocks
from kvpool.replay.workloads import (
    BUILTIN_TRACES,
    DEFAULT_TOKENS_PER_HASH_ID,
    SyntheticParams,
    Workload,
    builtin_trace,
    generate_synthetic,
    load_mooncake,
)

DEFAULT_MODEL: Final = "llama-3-8b"
DEFAULT_GPU_MEM: Final = 8 << 30
DEFAULT_TOKENS_PER_BLOCK: Final = 32
DEFAULT_WORKERS: Final = 4
EXIT_STATUS: Final = """exit status:
  0    done
  1    no request of the workload can ever be admitted (it says what to raise)
  2    a bad option, trace or output file
  130  interrupted by SIGINT (Ctrl-C); its worker processes are stopped first
       (and die with it if it is killed); a second signal exits at once
  143  interrupted by SIGTERM (kill, timeout), as for SIGINT"""
PROGRESS_INTERVAL_S: Final = 10.0
"""Without a terminal, one progress line on stderr this often (CI logs)."""

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

# Real-valued knobs that cannot be zero.
_POSITIVE_REALS: Final = frozenset({"arrival_rate_per_s"})

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
        epilog=EXIT_STATUS,
        formatter_class=_DefaultsFormatter,
    )
    w = p.add_argument_group("workload (default: the built-in synthetic multi-turn workload)")
    w.add_argument(
        "--trace", metavar="FILE|NAME",
        help="a Mooncake-format JSONL trace (.jsonl, or .jsonl.gz), or a trace shipped with "
        f"kvpool: {', '.join(BUILTIN_TRACES)} (the Mooncake FAST'25 conversation trace, "
        "12,031 requests)",
    )
    w.add_argument("--limit", type=positive, metavar="N", help="first N requests of the trace")
    w.add_argument(
        "--tokens-per-hash-id", type=positive, metavar="N",
        help=f"tokens one trace hash id stands for (default {DEFAULT_TOKENS_PER_HASH_ID})",
    )
    w.add_argument(
        "--seed", type=nonneg, default=0, metavar="N",
        help="seed of the synthetic workload, of trace token ids, generated tokens and the "
        "random policy",
    )
    defaults = SyntheticParams()
    for name, flag, text in _SYNTHETIC_FLAGS:
        value = getattr(defaults, name)
        real = isinstance(value, float)
        kind: Callable[[str], Any] = positive if not real else (
            positive_float if name in _POSITIVE_REALS else nonneg_float)
        w.add_argument(flag, dest=f"syn_{name}", type=kind, metavar="X" if real else "N",
                       help=f"synthetic: {text} (default {value})")

    _cluster_args(p.add_argument_group("cluster"))
    _memory_args(p.add_argument_group("memory (per worker)"))
    _scheduler_args(p.add_argument_group("scheduler and time model (per worker)"))
    _output_args(p.add_argument_group("output"))
    p.set_defaults(func=run)


def _cluster_args(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--workers", type=positive, default=DEFAULT_WORKERS, metavar="N",
                   help="simulated engines")
    c.add_argument(
        "--policies", type=_policies, default=",".join(POLICIES), metavar="LIST",
        help=f"routing policies to compare, comma-separated ({', '.join(POLICIES)})",
    )
    c.add_argument("--transport", choices=TRANSPORTS, default="inproc",
                   help="how events reach the router (zmq: vLLM msgpack over 127.0.0.1)")
    c.add_argument(
        "--jobs", type=positive, default=min(2, os.cpu_count() or 1), metavar="N",
        help="policies replayed at once (processes); results do not depend on it",
    )
    c.add_argument(
        "--remote-mem", type=size, default=0, metavar="SIZE",
        help="a shared remote tier of SIZE for the whole cluster (one in-process store with "
        "a server's LRU): workers write the blocks leaving their tiers and prefetch before "
        "admission; reports the hit rate it adds ('from shared tier')",
    )
    c.add_argument("--remote-blocks", type=nonneg, default=0, metavar="N",
                   help="the shared tier in blocks (with --gpu-blocks)")


def _memory_args(m: argparse._ArgumentGroup) -> None:
    m.add_argument("--model", metavar="PRESET",
                   help="model preset the planner sizes blocks for (see kvpool plan "
                   f"--list-models; default {DEFAULT_MODEL})")
    m.add_argument(
        "--gpu-mem", type=size, metavar="SIZE",
        help=f"GPU KV budget (default: {format_size(DEFAULT_GPU_MEM)}, raised to what the "
        "workload's longest request needs)",
    )
    m.add_argument("--host-mem", type=size, default=0, metavar="SIZE", help="host KV budget")
    m.add_argument("--disk-mem", type=size, default=0, metavar="SIZE", help="disk KV budget")
    m.add_argument("--gpu-blocks", type=positive, metavar="N",
                   help="GPU blocks instead of a model and budgets (one full-attention group)")
    m.add_argument("--host-blocks", type=nonneg, default=0, metavar="N",
                   help="host blocks (with --gpu-blocks)")
    m.add_argument("--disk-blocks", type=nonneg, default=0, metavar="N",
                   help="disk blocks (with --gpu-blocks)")
    m.add_argument("--tokens-per-block", type=positive, default=DEFAULT_TOKENS_PER_BLOCK,
                   metavar="N", help="tokens per block")
    m.add_argument("--no-partial-reuse", action="store_true",
                   help="reuse whole blocks only")


def _scheduler_args(s: argparse._ArgumentGroup) -> None:
    sched = SchedulerConfig()
    s.add_argument("--max-batch-size", type=positive, default=sched.max_batch_size,
                   metavar="N", help="concurrent sequences")
    s.add_argument("--max-num-tokens", type=positive, default=sched.max_num_tokens,
                   metavar="N", help="tokens per scheduler step")
    s.add_argument("--no-chunked-prefill", action="store_true",
                   help="compute each prompt in one step")
    tm = TimeModel()
    for name, flag, scale, unit, text in _TIME_FLAGS:
        s.add_argument(flag, dest=f"tm_{name}", type=nonneg_float,
                       default=round(getattr(tm, name) / scale, 6), metavar=unit.upper(),
                       help=f"{text} ({unit})")


def _output_args(o: argparse._ArgumentGroup) -> None:
    o.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    o.add_argument("--plot", type=Path, metavar="PATH",
                   help="plot hit rate and TTFT per policy over time (PNG)")
    o.add_argument("--markdown", type=Path, metavar="PATH",
                   help="write a markdown table ('-' prints it)")
    o.add_argument("--no-progress", action="store_true",
                   help="no progress bar (without a terminal: no progress lines)")


class _DefaultsFormatter(HelpFormatter):
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
    """Check the options, load the workload, size the cluster, replay every policy, report."""
    _check_options(args)
    console = Console()
    workload = _workload(args)
    config = _cluster(args, workload)
    if not _admissible(args, workload, config):
        return 1
    progress_console = Console(stderr=True)
    if args.no_progress:
        result = replay(workload, config, args.policies, jobs=args.jobs)
    elif progress_console.is_terminal:
        with _progress_bar(progress_console, args.policies, len(workload)) as progress:
            result = replay(workload, config, args.policies, progress=progress, jobs=args.jobs)
    else:
        with _progress_lines(args.policies, len(workload)) as progress:
            result = replay(workload, config, args.policies, progress=progress, jobs=args.jobs)
    render(result, console)
    _write_outputs(args, result, console)
    return 0


def _check_options(args: argparse.Namespace) -> None:
    """Options that make no sense together, and output files that could not be written: all
    refused before any work."""
    synthetic = [flag for name, flag, _ in _SYNTHETIC_FLAGS
                 if getattr(args, f"syn_{name}") is not None]
    if args.trace is not None and synthetic:
        raise InvalidArgumentError(
            f"{', '.join(synthetic)} shape the synthetic workload, not a --trace "
            "(use --limit to replay fewer trace requests)"
        )
    if args.trace is None:
        for flag, value in (("--limit", args.limit),
                            ("--tokens-per-hash-id", args.tokens_per_hash_id)):
            if value is not None:
                raise InvalidArgumentError(
                    f"{flag} applies to --trace; use --requests for the synthetic workload"
                )
    if args.gpu_blocks is not None:
        given = [flag for flag, value in (("--gpu-mem", args.gpu_mem),
                                          ("--host-mem", args.host_mem),
                                          ("--disk-mem", args.disk_mem),
                                          ("--model", args.model)) if value]
        if given:
            raise InvalidArgumentError(
                f"--gpu-blocks replaces {'/'.join(given)} (a block count instead of a model "
                "and budgets)"
            )
        if args.remote_mem:
            raise InvalidArgumentError("with --gpu-blocks the shared tier is --remote-blocks")
    elif args.host_blocks or args.disk_blocks:
        raise InvalidArgumentError("--host-blocks/--disk-blocks need --gpu-blocks")
    elif args.remote_blocks:
        raise InvalidArgumentError(
            "--remote-blocks needs --gpu-blocks (with a model, the shared tier is --remote-mem)"
        )
    for flag in ("json", "markdown", "plot"):
        check_writable(getattr(args, flag), f"--{flag}")


@contextmanager
def _progress_bar(
    console: Console, policies: list[str], total: int
) -> Iterator[Callable[[str], Callable[[int], None]]]:
    with Progress(
        TextColumn("{task.description:>13}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        tasks = {p: bar.add_task(p, total=total, start=False) for p in policies}

        def progress(policy: str) -> Callable[[int], None]:
            task = tasks[policy]

            def advance(n: int) -> None:
                bar.start_task(task)
                bar.advance(task, n)

            return advance

        yield progress


@contextmanager
def _progress_lines(
    policies: list[str], total: int
) -> Iterator[Callable[[str], Callable[[int], None]]]:
    """Without a terminal (a CI log): one line on stderr every :data:`PROGRESS_INTERVAL_S`,
    whether or not a request completed since the last one."""
    done = dict.fromkeys(policies, 0)
    start = time.monotonic()
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(PROGRESS_INTERVAL_S):
            counts = ", ".join(f"{p} {done[p]:,}" for p in policies)
            print(f"kvpool replay: {time.monotonic() - start:.0f} s, requests done of "
                  f"{total:,}: {counts}", file=sys.stderr, flush=True)

    def progress(policy: str) -> Callable[[int], None]:
        def advance(n: int) -> None:
            done[policy] += n

        return advance

    print(f"kvpool replay: {total:,} requests, policies {', '.join(policies)}", file=sys.stderr,
          flush=True)
    thread = threading.Thread(target=report, name="kvpool-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        path = builtin_trace(args.trace) if args.trace in BUILTIN_TRACES else Path(args.trace)
        tpi = args.tokens_per_hash_id or DEFAULT_TOKENS_PER_HASH_ID
        return load_mooncake(path, tokens_per_hash_id=tpi, limit=args.limit, seed=args.seed)
    defaults = SyntheticParams()
    params = {
        name: getattr(defaults, name) if getattr(args, f"syn_{name}") is None
        else getattr(args, f"syn_{name}")
        for name, _, _ in _SYNTHETIC_FLAGS
    }
    try:
        return generate_synthetic(SyntheticParams(seed=args.seed, **params))
    except InvalidArgumentError as exc:  # name the flag, not the dataclass field
        raise InvalidArgumentError(_flag_names(str(exc))) from None


def _flag_names(message: str) -> str:
    """``message`` with each synthetic workload field named by its flag."""
    for name, flag, _ in _SYNTHETIC_FLAGS:
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


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
    remote: tuple[int, tuple[int, ...]] = (args.remote_blocks, ())  # bytes, per-group block
    if args.gpu_blocks is not None:
        cache = block_cache(
            args.gpu_blocks, host_blocks=args.host_blocks, disk_blocks=args.disk_blocks,
            tokens_per_block=tpb, partial_reuse=partial,
        )
        description = {"gpu_blocks": args.gpu_blocks, "host_blocks": args.host_blocks,
                       "disk_blocks": args.disk_blocks}
    else:
        name = args.model or DEFAULT_MODEL
        model = ModelSpec.preset(name)
        gpu = args.gpu_mem
        if gpu is None:
            gpu = max(DEFAULT_GPU_MEM, _fit_budget(model, longest, tpb))
            if gpu > DEFAULT_GPU_MEM:
                note("replay", f"GPU budget raised from {format_size(DEFAULT_GPU_MEM)} to "
                     f"{format_size(gpu)} per worker so that the longest request "
                     f"({longest:,} tokens with its output) fits; --gpu-mem sets it")
        cache, plan = planned_cache(
            model, gpu_bytes=gpu, host_bytes=args.host_mem, disk_bytes=args.disk_mem,
            tokens_per_block=tpb, scheduler=scheduler,
            max_seq_len=max(model.max_seq_len, longest), partial_reuse=partial,
        )
        remote = (args.remote_mem, tuple(g.bytes_per_block for g in plan.groups))
        description = {
            "model": name,
            "gpu_mem": format_size(gpu),
            "host_mem": format_size(args.host_mem) if args.host_mem else None,
            "disk_mem": format_size(args.disk_mem) if args.disk_mem else None,
            "gpu_mem_auto": args.gpu_mem is None,
            "remote_mem": format_size(args.remote_mem) if args.remote_mem else None,
        }
    return ClusterConfig(
        cache=cache, workers=args.workers, scheduler=scheduler, time_model=time_model,
        transport=args.transport, seed=args.seed, description=description,
        remote_bytes=remote[0], remote_block_bytes=remote[1] if remote[0] else (),
    )


def _admissible(args: argparse.Namespace, workload: Workload, config: ClusterConfig) -> bool:
    """False, with one line saying why and what to change, when no request of the workload
    can ever run on a worker; a warning when some cannot (they count as rejected)."""
    cache = config.cache
    have = gpu_capacity(cache)
    rejected = [r for r in workload.requests if peak_blocks(cache, r) > have]
    if not rejected:
        return True
    tpb = cache.tokens_per_block
    need = min(peak_blocks(cache, r) for r in rejected)
    flag = f"--gpu-blocks to at least {need:,}" if args.gpu_blocks is not None else "--gpu-mem"
    if len(rejected) == len(workload):
        print(f"kvpool replay: error: no request can ever be admitted: the shortest needs "
              f"{need:,} GPU blocks of {tpb} tokens at its peak and a worker has {have:,}; "
              f"raise {flag} (or shorten the workload)", file=sys.stderr)
        return False
    warn("replay", f"{len(rejected):,} of {len(workload):,} requests need more than a "
         f"worker's {have:,} GPU blocks and will be rejected; raise {flag.split()[0]} to "
         "admit them")
    return True


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
