"""A disk that fills up at random points of random workloads never makes kvpool serve a wrong
byte (issue 29): the persistent disk tier's data file and manifest both fail their writes, and

- every block a request reuses holds, bit for bit, the bytes of its prefix (the workload's
  blocks are a function of their prefix: what an engine's KV is);
- every block the manager's tree names on any tier holds its prefix's bytes, after every call;
- every call that raises leaves ``debug_state()`` unchanged;
- a restart (the disk freed again) re-indexes only blocks whose bytes are right.

The workloads run in a child process (this file run as a script), because the disk fills up
for real there: ``RLIMIT_FSIZE`` lowered under the running tier (a write past it fails with
EFBIG, one that crosses it is cut short: real torn records), or, where a tmpfs can be mounted
in a private mount namespace, a small tmpfs filled by a filler file (ENOSPC). Hypothesis
drives the child: many workloads per test, each with its own points where the disk fills and
is freed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from test_manager_storage_failures import in_private_tmpfs

HERE = Path(__file__).resolve()
SRC = str(HERE.parents[2] / "src")
TPB = 32  # long records: a tmpfs page of manifest fills after a few calls
BLOCK_BYTES = 512  # GroupGeometry(1, 1, 2, "float32") at 32 tokens per block
DISK_BLOCKS = 12
MIN_TOTALS = ("reused_checked", "failed_copies", "manifest_failures", "restored_blocks",
              "restarts", "fills")


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def _run(argv: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_child_env())
    assert out.returncode == 0, f"child failed ({out.returncode}):\n{out.stdout[-3000:]}\n" \
                                f"{out.stderr[-6000:]}"
    totals: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return totals


def test_a_file_size_limit_at_random_points_never_serves_a_wrong_byte() -> None:
    """RLIMIT_FSIZE at random values (a slot boundary of the data file, a few bytes past the
    manifest's end), set and lifted at random points: both files fail their writes."""
    totals = _run([sys.executable, str(HERE), "fsize", "60"], timeout=600)
    for name in MIN_TOTALS:
        assert totals[name] > 0, totals  # the workloads did hit what they test


def test_a_full_tmpfs_at_random_points_never_serves_a_wrong_byte() -> None:
    """A real full filesystem (a 256 KiB tmpfs in a private mount namespace; needs the right to
    mount): the data file is reserved at creation, so the manifest is what fails (ENOSPC)."""
    disk = tempfile.mkdtemp(prefix="kvpool-test-full-")
    try:
        totals = _run([*in_private_tmpfs(disk, "256k"), sys.executable, str(HERE), "enospc",
                       "30", disk], timeout=600)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    for name in ("reused_checked", "manifest_failures", "restored_blocks", "fills"):
        assert totals[name] > 0, totals


# ---------------------------------------------------------------------------- the child


def block_bytes(prefix: array[int] | list[int]) -> bytes:
    """The KV bytes of the block that ends a prefix: a function of the prefix alone."""
    return hashlib.shake_256(array("I", prefix).tobytes()).digest(BLOCK_BYTES)


class Disk:
    """Makes the disk full and frees it again: by RLIMIT_FSIZE, or by a filler file."""

    def __init__(self, mode: str, path: str) -> None:
        self.mode, self.path = mode, path
        self.soft, self.hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        self.filler = os.path.join(path, "filler")

    def fill(self, manifest_room: int, slot_limit: int | None) -> None:
        """Leave ``manifest_room`` bytes of room past the manifest's end (or, by file size,
        let writes fail from slot ``slot_limit`` of the data file on)."""
        manifest = os.path.join(self.path, "kvpool-persistent.manifest")
        size = os.path.getsize(manifest) if os.path.exists(manifest) else 0
        if self.mode == "fsize":
            limit = size + manifest_room if slot_limit is None else slot_limit * BLOCK_BYTES
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, self.hard))
            return
        self.free()
        free = shutil.disk_usage(self.path).free
        with open(self.filler, "wb") as fh:  # tmpfs counts pages: the room is rounded
            fh.write(b"x" * max(0, free - manifest_room))

    def free(self) -> None:
        if self.mode == "fsize":
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.soft, self.hard))
        elif os.path.exists(self.filler):
            os.remove(self.filler)


class Workload:
    """One random workload against a persistent disk tier (see the module docstring)."""

    def __init__(self, disk: Disk, sync_every_call: bool, totals: dict[str, int]) -> None:
        from kvpool import CacheConfig, DiskConfig, GroupGeometry

        self.disk = disk
        self.totals = totals
        self.config = CacheConfig(
            tokens_per_block=TPB, gpu_blocks=8, host_blocks=2, disk_blocks=DISK_BLOCKS,
            layer_geometry=[GroupGeometry(1, 1, 2, "float32")], device="cpu",
            model_id="test/disk-full", enable_partial_reuse=False,
            disk=DiskConfig(path=disk.path, persistent=True,
                            sync_interval_s=1e-9 if sync_every_call else None),
        )
        self.live: dict[int, list[int]] = {}
        self.next_id = 0
        self.m = self.open()

    def open(self) -> Any:
        from kvpool import KVCacheManager

        m = KVCacheManager(self.config)
        assert m.persistent_disk is not None
        self.totals["restored_blocks"] += m.persistent_disk.restored.blocks
        self.check_tree(m)
        return m

    @staticmethod
    def slot_bytes(pool: Any, slot: int) -> bytes:
        import torch

        data: bytes = pool[slot].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return data

    def write_gpu(self, slot: int, prefix: list[int]) -> None:
        import torch

        pool = self.m.tensors(0, 0)
        pool[slot].view(-1).view(torch.uint8)[:] = torch.frombuffer(
            bytearray(block_bytes(prefix)), dtype=torch.uint8)

    def check_tree(self, m: Any) -> None:
        """Every block the tree names on a tier holds its prefix's bytes."""
        pools = [m.tensors(0, t) for t in range(3)]  # the disk's: one read of the whole file
        for tokens, slots, tiers in m.tree_blocks():
            if slots[0] < 0:
                continue
            held = self.slot_bytes(pools[tiers[0]], slots[0])
            assert held == block_bytes(tokens), (
                f"tier {tiers[0]} slot {slots[0]} holds other bytes than block "
                f"{list(tokens)[-TPB:]} (prefix of {len(tokens)} tokens)")

    def call(self, fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        """Run a manager call; one that raises must leave debug_state() unchanged (and so is
        never the CopiesLostError of a call that could not be undone: a full disk only ever
        fails copies to colder tiers, which leave the cache instead)."""
        from kvpool.errors import CopiesLostError, KVPoolError

        before = self.m.debug_state()
        try:
            return fn(), None
        except KVPoolError as exc:
            assert not isinstance(exc, CopiesLostError), repr(exc)
            assert self.m.debug_state() == before, f"{exc!r} changed the manager"
            self.totals["raised"] += 1
            return None, exc

    def admit(self, tokens: list[int]) -> None:
        from kvpool import SequenceRequest

        sid = self.next_id
        self.next_id += 1
        result, exc = self.call(lambda: self.m.add_sequence(SequenceRequest(sid, tokens)))
        if exc is not None:
            return
        table = result.block_ids[0][0]
        reused = result.reused_tokens // TPB
        for i in range(reused):  # what the engine would attend to: its prefix's bytes
            got = self.slot_bytes(self.m.tensors(0, 0), table[i])
            assert got == block_bytes(tokens[:(i + 1) * TPB]), f"reused block {i} is wrong"
            self.totals["reused_checked"] += 1
        for i in range(reused, len(table)):  # the engine computes the rest
            self.write_gpu(table[i], tokens[:(i + 1) * TPB])
        self.live[sid] = tokens

    def grow(self, sid: int, extra: list[int]) -> None:
        _, exc = self.call(lambda: self.m.add_tokens(sid, extra))
        if exc is None:
            old = len(self.live[sid])
            tokens = self.live[sid] = self.live[sid] + extra
            table = self.m.block_ids(sid)
            for i in range(old // TPB, len(table)):  # the partial block and the new ones
                self.write_gpu(table[i], tokens[:(i + 1) * TPB])

    def remove(self, sid: int) -> None:
        _, exc = self.call(lambda: self.m.remove_sequence(sid))
        if exc is None:
            del self.live[sid]

    def close(self) -> None:
        for sid in list(self.live):
            self.remove(sid)
        st = self.m._st
        assert st.copy_failure is None, st.copy_failure  # nothing here is beyond repair
        self.m.close()  # spills the hotter tiers to disk, where the disk lets it
        self.totals["failed_copies"] += st.failed_copies
        self.totals["manifest_failures"] += self.m.persistent_disk.manifest_failures

    def restart(self) -> None:
        self.close()
        self.disk.free()  # the operator freed the disk
        self.totals["restarts"] += 1
        self.m = self.open()


def prompt(blocks: list[int], tail: int) -> list[int]:
    """Block i of a prompt is one of three token runs at that position: prompts share
    prefixes often, and a prefix's blocks always have the same tokens."""
    tokens: list[int] = []
    for pos, choice in enumerate(blocks):
        tokens += [pos * 100 + choice * TPB + j for j in range(TPB)]
    return tokens + [1000 + j for j in range(tail)]


def child(mode: str, examples: int, path: str | None) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, not death
    logging.getLogger("kvpool").setLevel(logging.ERROR)  # the failures are counted instead
    totals = dict.fromkeys((*MIN_TOTALS, "raised"), 0)
    blocks = st.lists(st.integers(0, 1), min_size=1, max_size=5)
    ops: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
        "serve": st.tuples(st.just("serve"), blocks, st.integers(0, 3), st.integers(0, 5)),
        "fill": st.tuples(st.just("fill"), st.integers(0, 300),
                          st.none() | st.integers(0, DISK_BLOCKS) if mode == "fsize"
                          else st.none()),
        "admit": st.tuples(st.just("admit"), blocks, st.integers(0, 3)),
        "grow": st.tuples(st.just("grow"), st.integers(0, 1), st.integers(1, 5)),
        "remove": st.tuples(st.just("remove"), st.integers(0, 1)),
        "free": st.tuples(st.just("free")),
        "restart": st.tuples(st.just("restart")),
    }
    # how often each comes: a tmpfs page of manifest takes more calls to fill than a limit
    weights = {"serve": 6 if mode == "fsize" else 24, "fill": 2, "admit": 1, "grow": 1,
               "remove": 1, "free": 1, "restart": 1}
    op = st.sampled_from([k for k, n in weights.items() for _ in range(n)]).flatmap(
        lambda kind: ops[kind])

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(steps=st.lists(op, min_size=20, max_size=80), sync=st.booleans())
    def workload(steps: list[tuple[Any, ...]], sync: bool) -> None:
        root = path or tempfile.mkdtemp(prefix="kvpool-disk-full-")
        disk = Disk(mode, tempfile.mkdtemp(dir=root))
        try:
            w = Workload(disk, sync, totals)
            for name, *args in steps:
                live = sorted(w.live)
                if name == "serve":  # as W1: admitted, grown, removed
                    sid = w.next_id
                    w.admit(prompt(args[0], args[1]))
                    if sid in w.live:
                        if args[2]:
                            w.grow(sid, [2000 + j for j in range(args[2])])
                        w.remove(sid)
                elif name == "admit" and len(live) < 2:
                    w.admit(prompt(args[0], args[1]))
                elif name == "grow" and live:
                    w.grow(live[args[0] % len(live)], [2000 + j for j in range(args[1])])
                elif name == "remove" and live:
                    w.remove(live[args[0] % len(live)])
                elif name == "fill":
                    disk.fill(args[0], args[1])
                    totals["fills"] += 1
                elif name == "free":
                    disk.free()
                elif name == "restart":
                    w.restart()
                w.check_tree(w.m)
            w.restart()
            w.close()
        finally:
            disk.free()
            shutil.rmtree(disk.path, ignore_errors=True)
            if path is None:
                shutil.rmtree(root, ignore_errors=True)

    workload()
    print(json.dumps(totals))


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
