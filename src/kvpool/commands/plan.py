"""``kvpool plan``: size the KV cache pools of a model for a memory budget.

Prints one column per layer group (bytes per block, slots per tier, the GPU floor and the
constraint that set it, the typical step's need; as many groups per table as the terminal
holds), the constraints' needs, warns when a group's GPU pool holds less than half of a typical
step, and writes the plan as JSON with ``--json`` (its folder checked before any work).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from kvpool.commands._args import check_writable, positive, size, warn
from kvpool.errors import InvalidArgumentError, KVPoolError
from kvpool.planner.capacity import (
    GroupPlan,
    ModelSpec,
    PoolPlan,
    format_size,
    plan_pools,
    presets,
)
from kvpool.planner.hybrid import HybridPlan, hybrid_presets, plan_hybrid
from kvpool.replay.report import wrap_phrases

DEFAULT_MAX_NUM_TOKENS = 8192
DEFAULT_TOKENS_PER_BLOCK = 32
SHORT_OF_TYPICAL = 0.5  # warn when a group's GPU pool holds less than this of a typical step


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
    p.add_argument("--gpu-mem", type=size, metavar="SIZE", help="GPU budget, e.g. 40GiB")
    p.add_argument("--host-mem", type=size, default=0, metavar="SIZE", help="host budget")
    p.add_argument("--disk-mem", type=size, default=0, metavar="SIZE", help="disk budget")
    p.add_argument("--max-batch-size", type=positive, metavar="N", help="concurrent sequences")
    p.add_argument(
        "--max-num-tokens",
        type=positive,
        default=DEFAULT_MAX_NUM_TOKENS,
        metavar="N",
        help=f"tokens per scheduler step (default {DEFAULT_MAX_NUM_TOKENS})",
    )
    p.add_argument(
        "--max-seq-len",
        type=positive,
        metavar="N",
        help="longest sequence (default: the model's)",
    )
    p.add_argument(
        "--tokens-per-block",
        type=positive,
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
    check_writable(args.json, "--json")
    if args.model in hybrid_presets():  # attention + recurrent state (docs/hybrid.md)
        hplan = plan_hybrid(hybrid_presets()[args.model], args.tokens_per_block, args.gpu_mem,
                            args.host_mem, args.disk_mem, max_batch_size=args.max_batch_size)
        _print_hybrid(console, hplan)
        return _write_json(console, args.json, hplan.to_dict())
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
    _warn_if_short(plan)
    return _write_json(console, args.json, plan.to_dict())


def _write_json(console: Console, path: Path | None, doc: dict[str, Any]) -> int:
    if path is not None:
        try:
            path.write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as exc:
            raise KVPoolError(f"cannot write {path}: {exc.strerror or exc}") from None
        console.print(f"wrote {path}")
    return 0


def _print_hybrid(console: Console, plan: HybridPlan) -> None:
    """A hybrid model's pools: attention blocks and state slots per tier."""
    spec = plan.spec
    console.print(
        f"[bold]{spec.name}: {spec.attention_layers} attention layers, {spec.state_layers} "
        f"recurrent layers; block {plan.tokens_per_block} tokens (vLLM: "
        f"{spec.vllm_block_size()})[/]", highlight=False)
    table = Table(title="pools (group 0 attention, group 1 recurrent state)")
    table.add_column("group")
    table.add_column("slot", justify="right")
    for name in ("GPU", "host", "disk"):
        table.add_column(name, justify="right")
    table.add_row("0 attention", format_size(plan.block_bytes),
                  *(f"{n:,}" for n in plan.attention_blocks))
    table.add_row("1 state", format_size(spec.state_bytes),
                  *(f"{n:,}" for n in plan.state_slots))
    console.print(table)
    console.print(f"GPU state slots: {plan.running_slots:,} running (one per sequence) + "
                  f"{plan.state_slots[0] - plan.running_slots:,} checkpoints", highlight=False)
    for t, name in enumerate(("GPU", "host", "disk")):
        if plan.budget_bytes[t]:
            console.print(f"{name}: {format_size(plan.used_bytes(t))} of "
                          f"{format_size(plan.budget_bytes[t])} used", highlight=False)


def _print_plan(console: Console, plan: PoolPlan) -> None:
    budget = ", ".join(
        f"{name} {format_size(b)}"
        for name, b in zip(("GPU", "host", "disk"), plan.budget_bytes, strict=True)
        if b or name == "GPU"
    )
    heading = (f"{plan.model}:", f"{plan.tokens_per_block} tokens/block,", f"{budget};",
               f"batch {plan.max_batch_size},", f"{plan.max_num_tokens} tokens/step,",
               f"max_seq_len {plan.max_seq_len}")
    for line in wrap_phrases(heading, console.width):  # broken between phrases only
        console.print(f"[bold]{line}[/]", highlight=False, soft_wrap=True)
    title: str | None = None
    # One column per layer group (as many per table as the terminal holds), a row per figure.
    groups = list(plan.groups)
    while groups:
        count = len(groups)
        while True:
            table = _group_table(title, groups[:count], plan.budget_bytes)
            if count == 1 or _fits(console, table):
                break
            count -= 1
        console.print(table)
        groups = groups[count:]
        title = f"{plan.model} (continued)"

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


def _group_table(title: str | None, groups: list[GroupPlan], budget: tuple[int, ...]) -> Table:
    table = Table(title=title)
    table.add_column("layer group")
    for g in groups:
        table.add_column(str(g.index), justify="right")
    table.add_row("attention", *(g.label for g in groups))
    table.add_row("layers", *(str(len(g.layers)) for g in groups))
    table.add_row("bytes/block", *(format_size(g.bytes_per_block) for g in groups))
    for tier, name in enumerate(("GPU", "host", "disk")):
        if tier == 0 or budget[tier]:
            table.add_row(f"{name} slots", *(f"{g.slots_per_tier[tier]:,}" for g in groups))
    table.add_row("GPU floor", *(f"{g.min_slots:,}" for g in groups))
    table.add_row("floor set by", *(g.floor_reason for g in groups))
    table.add_row("typical step need", *(f"{g.typical_need:,}" for g in groups))
    return table


def _fits(console: Console, table: Table) -> bool:
    unbounded = console.options.update_width(1 << 20)
    return Measurement.get(console, unbounded, table).maximum <= console.width


def _warn_if_short(plan: PoolPlan) -> None:
    """One warning line when a group's GPU pool holds far less than a typical step needs."""
    short = [g for g in plan.groups if g.slots_per_tier[0] < SHORT_OF_TYPICAL * g.typical_need]
    if not short:
        return
    g = min(short, key=lambda g: g.slots_per_tier[0] / g.typical_need)
    warn(
        "plan",
        f"layer group {g.index} ({g.label}) gets {g.slots_per_tier[0]:,} GPU slots, "
        f"{g.slots_per_tier[0] / g.typical_need:.0%} of the {g.typical_need:,} a typical step "
        "needs: steps will run smaller batches or preempt; raise --gpu-mem or lower "
        "--max-batch-size / --max-num-tokens",
    )


def _print_models(console: Console) -> None:
    table = Table(title="model presets")
    table.add_column("preset", no_wrap=True, min_width=18)
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
    for name, h in hybrid_presets().items():
        table.add_row(name, str(h.num_layers),
                      f"full ×{h.attention_layers}, state ×{h.state_layers}",
                      format_size(h.attention_bytes_per_token), f"{h.max_seq_len:,}")
    console.print(table)
