"""The disk half of KvpoolTier (no vLLM needed): bounded, persistent across processes (a clean
exit or SIGKILL), and never handing out bytes that differ from what was stored."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ManifestError, StorageError
from kvpool.integrations.vllm.config import KvpoolTierConfig
from kvpool.integrations.vllm.disk import DiskChunks
from kvpool.integrations.vllm.namespace import tier_namespace
from kvpool.tiers.diskfile import persistent_name

CHUNK = 4096
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _namespace(model: str = "m"):  # type: ignore[no-untyped-def]
    return tier_namespace(None, KvpoolTierConfig(remote_url="redis://x", model=model), CHUNK)


def _payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (CHUNK // 4))


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def _store(disk: DiskChunks, ids: list[int]) -> None:
    placed, _, _ = disk.reserve([_key(i) for i in ids])
    views = [memoryview(_payload(int.from_bytes(k[:32], "big"))) for k, _ in placed]
    for (key, slot), checksum in zip(placed, disk.write(placed, views), strict=True):
        disk.commit(key, slot, checksum)


def _load(disk: DiskChunks, i: int) -> bytes | None:
    found = disk.pin(_key(i))
    if found is None:
        return None
    buf = bytearray(CHUNK)
    try:
        ok = disk.read(found[0], memoryview(buf), found[1])
    finally:
        disk.unpin(_key(i))
    return bytes(buf) if ok else None


WRITER = textwrap.dedent("""
    import json, os, signal, sys
    from kvpool.integrations.vllm.config import KvpoolTierConfig
    from kvpool.integrations.vllm.disk import DiskChunks
    from kvpool.integrations.vllm.namespace import tier_namespace
    path, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ns = tier_namespace(None, KvpoolTierConfig(remote_url="redis://x", model="m"), 4096)
    disk = DiskChunks(path, 64 * 4096, 4096, ns, sync_interval_s=None)
    for i in range(n):
        key = i.to_bytes(32, "big") + b"\\0\\0\\0\\0"
        placed, _, _ = disk.reserve([key])
        (s,) = disk.write(placed, [memoryview(i.to_bytes(4, "little") * 1024)])
        disk.commit(key, placed[0][1], s)
    print(json.dumps(len(disk)), flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    disk.close()
""")


@pytest.mark.parametrize("how", ["close", "kill"])
def test_a_new_process_finds_every_stored_block(tmp_path: Path, how: str) -> None:
    out = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), "40", how],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == (-signal.SIGKILL if how == "kill" else 0), out.stderr
    assert json.loads(out.stdout) == 40
    disk = DiskChunks(str(tmp_path), 64 * CHUNK, CHUNK, _namespace())
    try:
        assert disk.restored.blocks == 40 and disk.restored.invalid == 0
        assert all(_load(disk, i) == _payload(i) for i in range(40))
        _store(disk, [100])  # and it goes on storing
        assert _load(disk, 100) == _payload(100)
    finally:
        disk.close()


def test_damaged_bytes_are_never_handed_out(tmp_path: Path) -> None:
    disk = DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace())
    _store(disk, [1, 2, 3])
    slot = disk.pin(_key(2))
    assert slot is not None
    disk.unpin(_key(2))
    with open(tmp_path / persistent_name(0), "r+b") as f:
        f.seek(slot[0] * CHUNK + 100)
        f.write(b"\xff\xfe")
    assert _load(disk, 2) is None
    assert _load(disk, 1) == _payload(1) and _load(disk, 3) == _payload(3)
    disk.close()


def test_a_truncated_file_fails_reads_not_the_process(tmp_path: Path) -> None:
    disk = DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace())
    _store(disk, [1])
    os.truncate(tmp_path / persistent_name(0), CHUNK // 2)
    with pytest.raises(StorageError, match="truncated"):
        _load(disk, 1)
    disk.close()


def test_another_model_or_layout_never_reads_these_blocks(tmp_path: Path) -> None:
    disk = DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace("a"))
    _store(disk, [1])
    disk.close()
    with pytest.raises(ManifestError, match="another namespace"):
        DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace("b"), on_damage="refuse")
    with pytest.raises(ManifestError, match="another namespace"):
        DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace("b"))
    other = DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace("b"), on_damage="discard")
    assert len(other) == 0 and _load(other, 1) is None
    other.close()


def test_two_live_processes_cannot_share_one_disk_path(tmp_path: Path) -> None:
    disk = DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace())
    with pytest.raises(StorageError, match="in use by another live manager"):
        DiskChunks(str(tmp_path), 8 * CHUNK, CHUNK, _namespace())
    disk.close()


def test_a_disk_too_small_is_refused_at_start(tmp_path: Path) -> None:
    too_big = shutil.disk_usage(tmp_path).free + (1 << 30)
    with pytest.raises(StorageError, match="bytes free"):
        DiskChunks(str(tmp_path), too_big, CHUNK, _namespace())
    assert not (tmp_path / persistent_name(0)).exists()


@settings(max_examples=15)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=6), max_size=25))
def test_the_tier_holds_at_most_its_slots_and_serves_what_it_holds(
        tmp_path_factory: pytest.TempPathFactory, batches: list[list[int]]) -> None:
    disk = DiskChunks(str(tmp_path_factory.mktemp("d")), 8 * CHUNK, CHUNK, _namespace(),
                      sync_interval_s=None)
    try:
        held: set[int] = set()
        for batch in batches:
            placed, evicted, _ = disk.reserve([_key(i) for i in batch])
            held -= {int.from_bytes(k[:32], "big") for k in evicted}
            views = [memoryview(_payload(int.from_bytes(k[:32], "big"))) for k, _ in placed]
            for (key, slot), c in zip(placed, disk.write(placed, views), strict=True):
                disk.commit(key, slot, c)
                held.add(int.from_bytes(key[:32], "big"))
            assert len(disk) == len(held) <= 8
            assert set(batch) <= held or len(set(batch)) > 8
        assert all(_load(disk, i) == _payload(i) for i in held)
    finally:
        disk.close()
