"""The disk tier's files (kvpool.tiers.diskfile) without torch: locks, reclaim, checks, SIGTERM."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import xxhash

from kvpool.errors import StorageError, UnsafePathError
from kvpool.tiers.diskfile import (
    LOCK_NAME,
    close_pools,
    create_pools,
    open_persistent_pools,
    persistent_name,
    reclaim,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_pools_are_named_after_their_owner_sized_and_removed_on_close(tmp_path: Path) -> None:
    pools = create_pools(tmp_path, {0: (3, 64), 2: (1, 128)})
    assert sorted(pools) == [0, 2]
    for group, pool in pools.items():
        name = os.path.basename(pool.path)
        assert name.startswith(f"kvpool-{os.getpid()}-g{group}-") and name.endswith(".kv")
        assert os.path.getsize(pool.path) == pool.size
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p.path) for p in pools.values())
    pools[0].write([2, 0], [memoryview(b"a" * 64), memoryview(b"b" * 64)])
    out = [memoryview(bytearray(64)) for _ in range(3)]
    pools[0].read([0, 1, 2], out)
    assert [bytes(b) for b in out] == [b"b" * 64, bytes(64), b"a" * 64]
    close_pools(list(pools.values()))
    assert os.listdir(tmp_path) == []
    with pytest.raises(StorageError, match="closed"):
        pools[0].check()


def test_reclaim_removes_unlocked_files_and_keeps_locked_ones(tmp_path: Path) -> None:
    orphan = tmp_path / "kvpool-1-g0-dead.kv"
    orphan.write_bytes(b"x")
    other = tmp_path / "notes.kv"  # not a kvpool name: never touched
    other.write_bytes(b"x")
    pools = create_pools(tmp_path, {0: (1, 8)})  # reclaims first
    assert not orphan.exists() and other.exists()
    # a file whose lock is held (here by another open file description) belongs to a live
    # owner and stays
    assert reclaim(str(tmp_path)) == []
    assert os.path.exists(pools[0].path)
    stale = tmp_path / "kvpool-2-g0-old.kv"
    stale.write_bytes(b"x")
    fd = os.open(stale, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert reclaim(str(tmp_path)) == []
    finally:
        os.close(fd)
    assert reclaim(str(tmp_path)) == [str(stale)]
    close_pools(list(pools.values()))
    assert sorted(os.listdir(tmp_path)) == ["notes.kv"]


def test_check_sees_a_truncated_or_removed_file(tmp_path: Path) -> None:
    pools = create_pools(tmp_path, {0: (4, 16), 1: (4, 16)})
    truncated, removed = pools[0], pools[1]
    truncated.check()
    os.truncate(truncated.path, 16 * 3 + 1)
    with pytest.raises(StorageError, match="truncated to 49 bytes"):
        truncated.check()
    with pytest.raises(StorageError, match="ends inside slot 3"):
        truncated.read([3], [memoryview(bytearray(16))])
    os.remove(removed.path)
    with pytest.raises(StorageError, match="removed while in use"):
        removed.check()
    close_pools(list(pools.values()))


def test_a_full_or_missing_directory_is_refused_before_any_file(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        create_pools(tmp_path / "missing", {0: (1, 8)})
    with pytest.raises(StorageError, match="disk_path is None"):
        create_pools(None, {0: (1, 8)})
    with pytest.raises(StorageError, match="bytes free"):
        create_pools(tmp_path, {0: (1, 1 << 62)})
    assert os.listdir(tmp_path) == []


GRACEFUL = """
import os, signal, sys
from kvpool.tiers.diskfile import create_pools
stopped = []
signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
pools = create_pools(sys.argv[1], {0: (2, 8)})
pool = pools[0]
os.kill(os.getpid(), signal.SIGTERM)
# the graceful handler ran after ours: the name is gone, the data still usable till close
assert stopped == [signal.SIGTERM], stopped
assert os.listdir(sys.argv[1]) == []
pool.check()
pool.write([1], [memoryview(b"z" * 8)])
out = memoryview(bytearray(8))
pool.read([1], [out])
assert bytes(out) == b"z" * 8
pool.close()
print("ok")
"""


def test_sigterm_chains_to_a_graceful_handler_and_the_files_stay_usable(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(GRACEFUL), str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok"]



def test_persistent_pools_keep_their_name_and_bytes_and_are_never_removed(
        tmp_path: Path) -> None:
    """Stable names, the bytes of the last process kept, resized to the layout, locked while
    open, not removed at close or by reclaim, and a hash of every block written."""
    pools = open_persistent_pools(tmp_path, {0: (3, 16), 1: (2, 8)})
    assert {os.path.basename(p.path) for p in pools.values()} == {
        persistent_name(0), persistent_name(1)}
    pools[0].write([1], [memoryview(b"q" * 16)])
    assert list(pools[0].checksums or ()) == [0, xxhash.xxh3_64_intdigest(b"q" * 16), 0]
    assert pools[0].hash_slots([1, 0]) == [xxhash.xxh3_64_intdigest(b"q" * 16),
                                           xxhash.xxh3_64_intdigest(bytes(16))]
    with pytest.raises(StorageError, match="in use by another live manager"):
        open_persistent_pools(tmp_path, {0: (3, 16)})
    assert os.path.exists(pools[1].path)  # the refused open removed nothing
    close_pools(list(pools.values()))
    assert reclaim(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == sorted([persistent_name(0), persistent_name(1)])
    pools = open_persistent_pools(tmp_path, {0: (5, 16)})  # more slots: grown, bytes kept
    assert os.path.getsize(pools[0].path) == 5 * 16
    out = memoryview(bytearray(16))
    pools[0].read([1], [out])
    assert bytes(out) == b"q" * 16 and list(pools[0].checksums or ()) == [0] * 5
    close_pools(list(pools.values()))
    pools = open_persistent_pools(tmp_path, {0: (1, 16)})  # fewer: cut
    assert os.path.getsize(pools[0].path) == 16
    close_pools(list(pools.values()))


PERSISTENT_SIGTERM = """
import os, signal, sys
from kvpool.tiers.diskfile import create_pools, open_persistent_pools
kept = open_persistent_pools(sys.argv[1], {0: (2, 8)})
gone = create_pools(sys.argv[1], {0: (2, 8)})
print(kept[0].path, gone[0].path, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_sigterm_removes_the_owned_files_but_not_the_persistent_ones(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PERSISTENT_SIGTERM), str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == -15, out.stderr[-2000:]
    kept, gone = out.stdout.split()
    assert os.path.exists(kept) and not os.path.exists(gone)


# ---------------------------------------------------------------------------- file safety


@pytest.mark.parametrize("name", [LOCK_NAME, persistent_name(0)])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "plain"])
def test_a_link_at_the_lock_or_a_data_file_is_refused_and_its_target_untouched(
    tmp_path: Path, name: str, persistent: bool,
) -> None:
    """A symbolic link planted at ``.kvpool.lock`` or at a persistent data file's name never
    makes kvpool write through it: an UnsafePathError naming the path, the target as it was
    (an existing file) or not created (a dangling link)."""
    if name != LOCK_NAME and not persistent:
        pytest.skip("plain tiers make new, randomly named files (O_EXCL)")
    outside = tmp_path / "outside"
    outside.mkdir()
    target, nowhere = outside / "victim", outside / "created"
    target.write_bytes(b"keep me")
    opener = open_persistent_pools if persistent else create_pools
    for dest in (target, nowhere):
        d = tmp_path / f"disk-{dest.name}"
        d.mkdir()
        (d / name).symlink_to(dest)
        with pytest.raises(UnsafePathError, match="symbolic link") as err:
            opener(d, {0: (2, 64)})
        assert str(d / name) in str(err.value)
        assert target.read_bytes() == b"keep me" and not nowhere.exists()
        assert os.path.islink(d / name)  # left for the operator to look at
        os.remove(d / name)
        close_pools(list(opener(d, {0: (2, 64)}).values()))  # removed: the tier starts


def test_persistent_files_are_private_and_only_regular_files_of_ours(tmp_path: Path) -> None:
    pools = open_persistent_pools(tmp_path, {0: (2, 64)})
    path = Path(pools[0].path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    close_pools(list(pools.values()))
    path.chmod(0o644)  # an older release's file: narrowed when opened
    close_pools(list(open_persistent_pools(tmp_path, {0: (2, 64)}).values()))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.mkfifo(other / persistent_name(0))
    with pytest.raises(UnsafePathError, match="not a regular file"):
        open_persistent_pools(other, {0: (2, 64)})
    if os.geteuid() == 0:  # root can give the file away
        os.chown(path, 12345, 12345)
        with pytest.raises(UnsafePathError, match="belongs to uid 12345"):
            open_persistent_pools(tmp_path, {0: (2, 64)})


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o707, 0o722])
def test_a_directory_other_users_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(mode)
    for opener in (create_pools, open_persistent_pools):
        with pytest.raises(UnsafePathError, match="written by other users") as err:
            opener(d, {0: (2, 64)})
        assert repr(str(d)) in str(err.value) and "chmod go-w" in str(err.value)
    assert os.listdir(d) == []  # refused before any file


def test_a_directory_of_ours_writable_by_our_group_is_used_and_another_users_is_refused(
    tmp_path: Path,
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(0o770)  # ours, group-writable (a per-user group, as with umask 002)
    close_pools(list(create_pools(d, {0: (2, 64)}).values()))
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    os.chown(d, 12345, 12345)
    d.chmod(0o700)
    with pytest.raises(UnsafePathError, match="owner uid 12345"):
        create_pools(d, {0: (2, 64)})


PARTIAL_WRITE = """
import os, resource, signal, sys
from kvpool.tiers.diskfile import DiskWriteError, close_pools, open_persistent_pools
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
pools = open_persistent_pools(sys.argv[1], {0: (4, 64)})
pool = pools[0]
pool.write([0, 1, 2, 3], [memoryview(bytes([i]) * 64) for i in range(4)])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 64 + 10, hard))  # slot 2 cut short, 3 past
try:
    pool.write([3, 0, 2, 1], [memoryview(b"n" * 64) for _ in range(4)])
    print("written")
except DiskWriteError as exc:
    print(sorted(exc.slots), [pool.checksums[s] == 0 for s in range(4)])
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print(pool.hash_slots([0, 1]) == [pool.checksums[0], pool.checksums[1]])
close_pools(list(pools.values()))
"""


def test_a_failed_write_names_its_slots_writes_the_others_and_forgets_their_hashes(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PARTIAL_WRITE, str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[2, 3] [False, False, True, True]", "True"]
