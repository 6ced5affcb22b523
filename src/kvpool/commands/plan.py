"""``kvpool plan``: size the KV cache pools of a model for a memory budget.

Prints one row per layer group (bytes per block, slots per tier, the GPU floor and the
constraint that set it), the constraints' needs, and writes the plan as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool.errors import InvalidArgumentError, KVPoolError
from kvpool.planner import (
    ModelSpec,
    PoolPlan,
    format_size,
    parse_size,
    plan_pools,
    presets,
)

DEFAULT_MAX_NUM_TOKENS = 8192
DEFAULT_TOKENS_PER_BLOCK = 32


def register(subparsers: Any) -> None:
    """Add the ``plan`` parser to the ``kvpool`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="size the KV cache pools of a model for a memory budget",
        description=(
            "Size the KV cache pools (slots per tier and layer group) of a model preset for a "
            "memory budget. Every layer group gets at least --max-batch-size GPU slots; the "
            "bytes above the floors follow a typical step (one prefill chunk plus decodes at "
            "half the maximum length)."
        ),
    )
    p.add_argument("--model", metavar="PRESET", help="model preset (see --list-models)")
    p.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    p.add_argument("--gpu-mem", type=_size, metavar="SIZE", help="GPU budget, e.g. 40GiB")
    p.add_argument("--host-mem", type=_size, default=0, metavar="SIZE", help="host budget")
    p.add_argument("--disk-mem", type=_size, default=0, metavar="SIZE", help="disk budget")
    p.add_argument("--max-batch-size", type=_positive, metavar="N", help="concurrent sequences")
    p.add_argument(
        "--max-num-tokens",
        type=_positive,
        default=DEFAULT_MAX_NUM_TOKENS,
        metavar="N",
        help=f"tokens per scheduler step (default {DEFAULT_MAX_NUM_TOKENS})",
    )
    p.add_argument(
        "--max-seq-len",
        type=_positive,
        metavar="N",
        help="longest sequence (default: the model's)",
    )
    p.add_argument(
        "--tokens-per-block",
        type=_positive,
        default=DEFAULT_TOKENS_PER_BLOCK,
        metavar="N",
        help=f"tokens per block (default {DEFAULT_TOKENS_PER_BLOCK})",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan the pools, print them, write JSON if asked. Errors raise :class:`KVPoolError`."""
    console = Console()
    if args.list_models:
        _print_models(console)
        return 0
    missing = [
        flag
        for flag, value in (
            ("--model", args.model),
            ("--gpu-mem", args.gpu_mem),
            ("--max-batch-size", args.max_batch_size),
        )
        if value is None
    ]
    if missing:
        raise InvalidArgumentError(f"missing {', '.join(missing)} (or use --list-models)")
    model = ModelSpec.preset(args.model)
    plan = plan_pools(
        model,
        args.tokens_per_block,
        args.gpu_mem,
        args.host_mem,
        args.disk_mem,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len or model.max_seq_len,
    )
    _print_plan(console, plan)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise KVPoolError(f"cannot write {args.json}: {exc.strerror or exc}") from None
        console.print(f"wrote {args.json}")
    return 0


def _print_plan(console: Console, plan: PoolPlan) -> None:
    budget = ", ".join(
        f"{name} {format_size(b)}"
        for name, b in zip(("GPU", "host", "disk"), plan.budget_bytes, strict=True)
        if b or name == "GPU"
    )
    table = Table(
        title=(
            f"{plan.model}: {plan.tokens_per_block} tokens/block, {budget}; "
            f"batch {plan.max_batch_size}, {plan.max_num_tokens} tokens/step, "
            f"max_seq_len {plan.max_seq_len}"
        )
    )
    for col in ("group", "attention", "layers", "bytes/block", "GPU slots", "host slots"):
        table.add_column(col, justify="left" if col == "attention" else "right")
    table.add_column("disk slots", justify="right")
    table.add_column("GPU floor", justify="right")
    table.add_column("floor set by")
    table.add_column("typical need", justify="right")
    for g in plan.groups:
        gpu, host, disk = g.slots_per_tier
        table.add_row(
            str(g.index),
            g.label,
            str(len(g.layers)),
            format_size(g.bytes_per_block),
            f"{gpu:,}",
            f"{host:,}",
            f"{disk:,}",
            f"{g.min_slots:,}",
            g.floor_reason,
            f"{g.typical_need:,}",
        )
    console.print(table)

    needs = Table(title="batches (slots needed per layer group)")
    needs.add_column("batch")
    needs.add_column("what")
    for g in plan.groups:
        needs.add_column(f"group {g.index}", justify="right")
    for c in (*plan.constraints, plan.typical_step):
        needs.add_row(c.name, c.description, *(f"{n:,}" for n in c.needs))
    console.print(needs)
    for tier, name in enumerate(("GPU", "host", "disk")):
        if plan.budget_bytes[tier]:
            console.print(
                f"{name}: {format_size(plan.used_bytes(tier))} of "
                f"{format_size(plan.budget_bytes[tier])} used"
            )
    for note in plan.notes:
        console.print(f"note: {note}")


def _print_models(console: Console) -> None:
    table = Table(title="model presets")
    table.add_column("preset")
    table.add_column("layers", justify="right")
    table.add_column("layer groups")
    table.add_column("KV bytes/token", justify="right")
    table.add_column("max_seq_len", justify="right")
    for name, model in presets().items():
        groups = model.layer_groups()
        table.add_row(
            name,
            str(len(model.layers)),
            ", ".join(f"{g.label} ×{len(g.layers)}" for g in groups),
            format_size(sum(g.bytes_per_token for g in groups)),
            f"{model.max_seq_len:,}",
        )
    console.print(table)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
