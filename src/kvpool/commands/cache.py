"""``kvpool cache``: what kvpool keeps on disk between runs, and clearing it.

kvpool stores one thing between runs: models converted to safetensors by ``kvpool serve``
(:func:`kvpool.engine.models.cache_dir`, ``$KVPOOL_CACHE_DIR`` or ``~/.cache/kvpool``), an
entry per source file and version of it. ``kvpool cache`` lists the entries with their sizes;
``kvpool cache clear`` removes them (the next ``kvpool serve`` converts its model again).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from kvpool.errors import KVPoolError
from kvpool.planner.capacity import format_size


def register(subparsers: Any) -> None:
    """Add the ``cache`` parser to the ``kvpool`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "cache",
        help="list or clear what kvpool stored on disk (converted models)",
        description="List (the default) or clear what kvpool keeps between runs: the models "
        "kvpool serve converted, under $KVPOOL_CACHE_DIR (else $XDG_CACHE_HOME/kvpool, else "
        "~/.cache/kvpool).",
    )
    p.add_argument("action", nargs="?", choices=("list", "clear"), default="list",
                   help="list the entries with their sizes, or remove them all "
                   "(default: list)")
    p.set_defaults(func=run)


def root() -> Path:
    """The cache directory (the engine's, which needs the ``engine`` extra to import)."""
    try:
        from kvpool.engine.models import cache_dir
    except ImportError as exc:
        raise KVPoolError(
            f"kvpool cache needs the engine extra ({exc.name} is missing): only kvpool serve "
            "stores anything, and it needs the same"
        ) from None
    return cache_dir()


def entries(folder: Path) -> list[tuple[Path, int, float]]:
    """(path, bytes, modified) per entry: each converted model, and any stray file."""
    found = []
    for top in sorted(folder.iterdir()) if folder.is_dir() else []:
        children = sorted(top.iterdir()) if top.is_dir() and top.name == "models" else [top]
        for entry in children:
            found.append((entry, _size(entry), entry.stat().st_mtime))
    return found


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> int:
    folder = root()
    found = entries(folder)
    total = sum(size for _, size, _ in found)
    if args.action == "clear":
        for path, _, _ in found:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        print(f"kvpool cache: removed {len(found)} entries, {format_size(total)}, from {folder}")
        return 0
    if not found:
        print(f"kvpool cache: {folder} holds nothing")
        return 0
    print(f"kvpool cache: {folder}")
    for path, size, modified in found:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(modified))
        unfinished = "  (unfinished conversion)" if path.name.startswith(".") else ""
        print(f"  {format_size(size):>12}  {when}  {path.relative_to(folder)}{unfinished}")
    print(f"  {format_size(total):>12}  in all; kvpool cache clear removes it")
    return 0
