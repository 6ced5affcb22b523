"""Persistent disk tier and warm restart (kvpool.core.persist) with real torch storage.

An engine stand-in writes into every block it computes bytes that are a function of the token
prefix the block ends (as real KV is): after a restart, each block the new manager serves can be
checked bit for bit against that function. Managers are ended by SIGKILL and SIGTERM in child
processes (at a quiescent point and at random moments), or abandoned in-process without any
cleanup, with the manifest and the disk file damaged on top.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

torch = pytest.importorskip("torch")

from test_manager_tiers import GEOM as TIERS_GEOM  # noqa: E402
from test_manager_tiers import DataPlaneMachine  # noqa: E402

from kvpool.config import (  # noqa: E402
    CacheConfig,
    DiskConfig,
    EventsConfig,
    EvictionConfig,
    SequenceRequest,
)
from kvpool.core.manager import KVCacheManager  # noqa: E402
from kvpool.core.persist import MANIFEST_NAME  # noqa: E402
from kvpool.errors import (  # noqa: E402
    CopiesLostError,
    InvalidArgumentError,
    ManifestError,
    StorageError,
    UnsafePathError,
)
from kvpool.events.model import Stored  # noqa: E402
from kvpool.tiers.diskfile import close_pools, persistent_name  # noqa: E402
from kvpool.tiers.manifest import Manifest  # noqa: E402
from kvpool.tiers.storage import GroupGeometry, Tier  # noqa: E402
from kvpool.tiers.torch_storage import TorchStorage  # noqa: E402

TPB = 4
GEOM = GroupGeometry(num_layers=1, kv_heads=1, head_dim=4, dtype="float32")
BLOCK_BYTES = GEOM.block_bytes(TPB)


def config(path: Path | str, *, damaged: str = "refuse", sync_interval_s: float | None = None,
           **kw: object) -> CacheConfig:
    base: dict[str, object] = dict(
        tokens_per_block=TPB, gpu_blocks=6, host_blocks=2, disk_blocks=32,
        layer_geometry=[GEOM], device="cpu", model_id="test-model",
        disk=DiskConfig(path=str(path), persistent=True, manifest_damaged=damaged,
                        sync_interval_s=sync_interval_s),
        eviction=EvictionConfig(offload_min_priority=0),
    )
    base.update(kw)
    return CacheConfig(**base)  # type: ignore[arg-type]


def kv_bytes(prefix: list[int] | tuple[int, ...], group: int = 0) -> bytes:
    """The bytes of the block of ``group`` that ends the token prefix ``prefix`` (NaN
    payloads included)."""
    return hashlib.shake_128(repr((group, tuple(prefix))).encode()).digest(BLOCK_BYTES)


def serve(m: KVCacheManager, sid: str, tokens: list[int]) -> int:
    """Admit, compute the blocks the admission did not reuse, store, release; reused tokens."""
    r = m.add_sequence(SequenceRequest(sid, tokens))
    for g in range(m.config.num_groups):
        pool = m.tensors(g, 0)
        table = r.block_ids[g][0]
        for b in range(r.reused_tokens // TPB, len(table)):
            if table[b] >= 0:
                data = kv_bytes(tokens[:min((b + 1) * TPB, len(tokens))], g)
                pool[table[b]].view(torch.uint8).reshape(-1)[:] = torch.frombuffer(
                    bytearray(data), dtype=torch.uint8)
    m.store_context_blocks(sid, len(tokens))
    m.remove_sequence(sid)
    return r.reused_tokens


def check_disk_blocks(m: KVCacheManager) -> int:
    """Every disk-resident block of the tree holds its prefix's bytes in every group; how many
    (block, group) pairs there are."""
    disks = [m.tensors(g, Tier.DISK) for g in range(m.config.num_groups)]
    n = 0
    for tokens, slots, tiers in m.tree_blocks():
        for g, disk in enumerate(disks):
            if tiers[g] == Tier.DISK and slots[g] >= 0:
                got = disk[slots[g]].view(torch.uint8).reshape(-1).numpy().tobytes()
                assert got == kv_bytes(list(tokens), g), f"wrong bytes for {list(tokens)}"
                n += 1
    return n


def check_onboarded(m: KVCacheManager, prompts: list[list[int]]) -> int:
    """Admit each prompt: the blocks it reuses hold their prefix's bytes on the GPU; the total
    number of reused tokens."""
    total = 0
    for k, tokens in enumerate(prompts):
        r = m.add_sequence(SequenceRequest(f"check{k}", tokens))
        for g in range(m.config.num_groups):
            pool = m.tensors(g, 0)
            for b in range(r.reused_tokens // TPB):
                slot = r.block_ids[g][0][b]
                if slot >= 0:
                    got = pool[slot].view(torch.uint8).reshape(-1).numpy().tobytes()
                    assert got == kv_bytes(tokens[:(b + 1) * TPB], g)
        total += r.reused_tokens
        m.remove_sequence(f"check{k}", store_for_reuse=False)
    m.check_invariants()
    return total


def workload(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing prefixes (a few system prompts, then distinct tails)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8]))] for _ in range(3)]
    return [rng.choice(systems) + [rng.randrange(50, 500) for _ in range(rng.randrange(1, 9))]
            for _ in range(n)]


def crash(m: KVCacheManager) -> None:
    """End a manager as a killed process does: files closed (locks dropped), nothing synced,
    compacted or removed."""
    disk = m.persistent_disk
    assert disk is not None
    os.close(disk.manifest._fd)
    disk.manifest._fd = -1
    close_pools(list(m.storage._disk.values()))  # type: ignore[attr-defined]


CHILD = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from test_persist import config, serve, workload
from kvpool.core.manager import KVCacheManager
m = KVCacheManager(config({path!r}))
prompts = workload({seed}, {n})
for k, tokens in enumerate(prompts):
    serve(m, f"s{{k}}", tokens)
print("READY", flush=True)
k = 0
while {loop}:
    serve(m, f"loop{{k}}", prompts[k % len(prompts)][:-1] + [1000 + k])
    k += 1
time.sleep(60)
"""


def run_child(path: Path, *, seed: int, n: int, loop: bool, sig: int, delay: float) -> None:
    script = textwrap.dedent(CHILD.format(tests=str(Path(__file__).parent), path=str(path),
                                          seed=seed, n=n, loop=loop))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(delay)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == -sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_warm_restart_after_the_process_is_killed(tmp_path: Path, sig: int) -> None:
    """A child stores 12 prompts and is killed; a manager started on the same disk.path finds
    the blocks that were on disk, serves exactly what the killed one would have, and every
    onboarded byte equals the original."""
    prompts = workload(7, 12)
    run_child(tmp_path, seed=7, n=12, loop=False, sig=sig, delay=0)
    assert (tmp_path / persistent_name(0)).exists() and (tmp_path / MANIFEST_NAME).exists()
    # the same calls in this process give the state the child was killed in
    (tmp_path / "ref").mkdir()
    reference = KVCacheManager(config(tmp_path / "ref"))
    for k, tokens in enumerate(prompts):
        serve(reference, f"s{k}", tokens)
    on_disk = {tuple(t) for t, _, tiers in reference.tree_blocks() if tiers[0] == Tier.DISK}
    reference.close()
    m = KVCacheManager(config(tmp_path))
    disk = m.persistent_disk
    assert disk is not None
    restored = {tuple(t) for t, _, tiers in m.tree_blocks() if tiers[0] == Tier.DISK}
    # every block that was on disk is found (a block onboarded or dropped whose slot was not
    # written again may be found too: its bytes are still its own)
    assert on_disk <= restored and len(on_disk) >= 8
    assert disk.restored.blocks == len(restored)
    assert (disk.restored.stale, disk.restored.orphaned, disk.restored.invalid) == (0, 0, 0)
    assert check_disk_blocks(m) == len(restored)
    # a chain on disk from its root is reused at once, bit for bit
    rooted = {t for t in restored if all(t[:j] in restored for j in range(TPB, len(t), TPB))}
    longest = max(rooted, key=len)
    assert m.count_reusable_tokens([*longest, 9999]) == len(longest)
    assert check_onboarded(m, [[*longest, 9999]]) == len(longest)
    # a chain whose first blocks died with the process (they were on the GPU or host tier):
    # once the engine computes them again, the rest is reused from disk
    lost = max(restored - rooted, key=len)
    cut = max(j for j in range(TPB, len(lost), TPB) if lost[:j] not in restored)
    assert m.count_reusable_tokens([*lost, 9999]) < cut
    serve(m, "again", list(lost[:cut]))
    assert m.count_reusable_tokens([*lost, 9999]) == len(lost)
    assert check_onboarded(m, [[*lost, 9999]]) == len(lost)
    m.close()


def test_killed_at_random_moments_never_serves_a_wrong_byte(tmp_path: Path) -> None:
    """SIGKILL while the child admits, evicts and offloads in a loop (mid-call included):
    every block the next manager re-indexes holds its own bytes, twice over."""
    for round_, delay in enumerate((0.05, 0.3)):
        run_child(tmp_path, seed=round_, n=10, loop=True, sig=signal.SIGKILL, delay=delay)
        m = KVCacheManager(config(tmp_path, damaged="keep_prefix"))
        assert check_disk_blocks(m) == m.persistent_disk.restored.blocks  # type: ignore[union-attr]
        check_onboarded(m, workload(round_, 10))
        m.close()


def test_close_spills_the_hotter_tiers_to_disk(tmp_path: Path) -> None:
    """A manager closed on purpose writes its GPU and host blocks to free disk slots: the next
    one finds every block of the tree, each with its own bytes."""
    m = KVCacheManager(config(tmp_path))
    for k, tokens in enumerate(workload(11, 12)):
        serve(m, f"s{k}", tokens)
    tree = {tuple(t): tiers[0] for t, _, tiers in m.tree_blocks()}
    assert set(tree.values()) == {0, 1, 2}
    m.close()
    m = KVCacheManager(config(tmp_path))
    assert {tuple(t) for t, _, _ in m.tree_blocks()} == set(tree)
    assert check_disk_blocks(m) == len(tree)
    assert check_onboarded(m, workload(11, 12)) > 0
    m.close()


def test_no_spill_after_a_failed_copy(tmp_path: Path) -> None:
    """After a copy failed (some blocks may lack their bytes) close() writes nothing more:
    the next manager finds only what was on disk."""
    m = KVCacheManager(config(tmp_path))
    for k, tokens in enumerate(workload(11, 12)):
        serve(m, f"s{k}", tokens)
    on_disk = {tuple(t) for t, _, tiers in m.tree_blocks() if tiers[0] == Tier.DISK}
    m._st.copy_failure = "OSError(5, 'Input/output error')"  # what a failed copy leaves
    m.close()
    m = KVCacheManager(config(tmp_path))
    assert {tuple(t) for t, _, tiers in m.tree_blocks() if tiers[0] == Tier.DISK} == on_disk
    m.close()


def test_a_failed_fsync_of_the_disk_files_is_copies_lost_for_it_and_every_later_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sync() whose data fsync fails changes nothing but raises CopiesLostError (the bytes on
    disk may be gone), and so does every later call that may copy; calls that copy nothing
    keep working."""
    m = KVCacheManager(config(tmp_path))
    for k, tokens in enumerate(workload(12, 6)):
        serve(m, f"s{k}", tokens)
    disk = m.persistent_disk
    assert disk is not None

    def failing() -> None:
        raise StorageError("fsync: Input/output error")

    monkeypatch.setattr(m._st.storage, "sync_disk", failing)
    before = m.debug_state()
    with pytest.raises(CopiesLostError, match="fsync of the disk tier failed"):
        disk.sync()
    assert m.debug_state() == before
    with pytest.raises(CopiesLostError, match="copies nothing more"):
        m.add_sequence(SequenceRequest("later", workload(12, 1)[0]))
    assert m.debug_state() == before and m.tree_blocks()


def test_two_live_managers_cannot_share_a_persistent_tier(tmp_path: Path) -> None:
    m = KVCacheManager(config(tmp_path))
    with pytest.raises(StorageError, match="in use by another live manager"):
        KVCacheManager(config(tmp_path))
    m.close()
    KVCacheManager(config(tmp_path)).close()  # released at close


@pytest.mark.parametrize("name", [".kvpool.lock", persistent_name(0), MANIFEST_NAME,
                                  MANIFEST_NAME + ".tmp"])
def test_a_link_in_disk_path_never_makes_the_manager_write_elsewhere(tmp_path: Path,
                                                                     name: str) -> None:
    """A symbolic link planted at any name the persistent tier uses: the manager refuses to
    start (UnsafePathError naming it), the link's target is as it was; without the link it
    starts, and its manifest and data file are private (0600)."""
    disk, outside = tmp_path / "disk", tmp_path / "outside"
    disk.mkdir()
    outside.mkdir()
    target = outside / "victim"
    target.write_bytes(b"keep me")
    (disk / name).symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link") as err:
        KVCacheManager(config(disk))
    assert str(disk / name) in str(err.value)
    assert target.read_bytes() == b"keep me" and os.listdir(outside) == ["victim"]
    os.remove(disk / name)
    with KVCacheManager(config(disk)):
        for f in (MANIFEST_NAME, persistent_name(0)):
            assert os.stat(disk / f).st_mode & 0o777 == 0o600


def test_a_disk_path_other_users_can_write_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    with pytest.raises(UnsafePathError, match="chmod go-w"):
        KVCacheManager(config(tmp_path))
    assert os.listdir(tmp_path) == []
    tmp_path.chmod(0o700)
    KVCacheManager(config(tmp_path)).close()


def test_close_keeps_the_files_and_clear_cache_forgets_them(tmp_path: Path) -> None:
    prompts = workload(3, 10)
    m = KVCacheManager(config(tmp_path))
    for k, tokens in enumerate(prompts):
        serve(m, f"s{k}", tokens)
    m.close()
    assert (tmp_path / persistent_name(0)).exists()
    m = KVCacheManager(config(tmp_path))
    assert check_disk_blocks(m) > 0
    m.clear_cache()
    m.close()
    m = KVCacheManager(config(tmp_path))
    assert check_disk_blocks(m) == 0 and m.persistent_disk.restored.blocks == 0  # type: ignore[union-attr]
    m.close()


def filled(tmp_path: Path) -> int:
    """A closed persistent tier holding some blocks, then pushed to disk from the GPU and host
    tiers by unrelated prompts; how many blocks are on disk."""
    m = KVCacheManager(config(tmp_path))
    for k, tokens in enumerate(workload(5, 12)):
        serve(m, f"s{k}", tokens)
    for k in range(4):
        serve(m, f"f{k}", [600 + 8 * k + j for j in range(8)])
    n = sum(1 for _, _, tiers in m.tree_blocks() if tiers[0] == Tier.DISK)
    m.close()
    return n


def test_stale_bytes_are_not_served(tmp_path: Path) -> None:
    """A slot overwritten after its record (a crash between a write and its record) is a
    miss: the hash of its bytes no longer matches."""
    filled(tmp_path)
    m = KVCacheManager(config(tmp_path))
    before = {tuple(t): s[0] for t, s, tiers in m.tree_blocks() if tiers[0] == Tier.DISK}
    m.close()
    victim = max(before, key=len)
    with open(tmp_path / persistent_name(0), "r+b") as f:
        f.seek(before[victim] * BLOCK_BYTES + 5)
        f.write(b"\xff")
    m = KVCacheManager(config(tmp_path))
    after = {tuple(t) for t, _, tiers in m.tree_blocks() if tiers[0] == Tier.DISK}
    assert victim not in after and m.persistent_disk.restored.stale == 1  # type: ignore[union-attr]
    assert after == {t for t in before if t[:len(victim)] != victim}
    check_disk_blocks(m)
    m.close()


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[:len(data) - 7])
    elif how == "flipped":
        data[len(data) // 2] ^= 0x40
        path.write_bytes(data)
    else:  # "header"
        data[2] ^= 1
        path.write_bytes(data)


@pytest.mark.parametrize("how", ["truncated", "flipped", "header"])
def test_a_damaged_manifest_is_refused_kept_to_its_intact_prefix_or_discarded(
        tmp_path: Path, how: str) -> None:
    filled(tmp_path)
    manifest = tmp_path / MANIFEST_NAME
    m = KVCacheManager(config(tmp_path))
    n = m.persistent_disk.restored.blocks  # type: ignore[union-attr]
    m.close()  # the restart compacted the manifest: one put per restored block, parents first
    damage(manifest, how)
    with pytest.raises(ManifestError, match="damaged"):
        KVCacheManager(config(tmp_path))
    if how != "header":
        m = KVCacheManager(config(tmp_path, damaged="keep_prefix"))
        kept = m.persistent_disk.restored.blocks  # type: ignore[union-attr]
        assert 0 < kept < n and check_disk_blocks(m) == kept
        m.close()
        damage(manifest, how)
    m = KVCacheManager(config(tmp_path, damaged="discard"))
    assert check_disk_blocks(m) == 0 and m.persistent_disk.restored.blocks == 0  # type: ignore[union-attr]
    m.close()


@pytest.mark.parametrize("change", [{"model_id": "another-model"}, {"tokens_per_block": 2},
                                    {"layer_geometry": [GroupGeometry(1, 1, 4, "float16")]},
                                    {"hash_algo": "v1_block_key"}])
def test_another_namespace_is_refused_or_discarded(tmp_path: Path,
                                                   change: dict[str, object]) -> None:
    filled(tmp_path)
    with pytest.raises(ManifestError, match="another namespace"):
        KVCacheManager(config(tmp_path, **change))
    with pytest.raises(ManifestError, match="another namespace"):
        KVCacheManager(config(tmp_path, damaged="keep_prefix", **change))
    m = KVCacheManager(config(tmp_path, damaged="discard", **change))
    assert m.persistent_disk.restored.blocks == 0 and not m.tree_blocks()  # type: ignore[union-attr]
    m.close()
    m = KVCacheManager(config(tmp_path, **change))  # the discard began a manifest of its own
    assert not m.tree_blocks()
    m.close()
    with pytest.raises(ManifestError, match="another namespace"):
        KVCacheManager(config(tmp_path))


def test_a_storage_without_a_persistent_disk_tier_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    storage = TorchStorage(TPB, [GEOM], cfg.slots, device="cpu", disk_path=tmp_path)
    with pytest.raises(InvalidArgumentError, match="persistent disk tier"):
        KVCacheManager(cfg, storage=storage)
    assert not storage.closed  # the caller's storage is the caller's to close
    storage.close()
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.disk\.persistent needs a disk"):
        CacheConfig(tokens_per_block=4, gpu_blocks=4, disk=DiskConfig(persistent=True))
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.disk\.manifest_damaged"):
        DiskConfig(manifest_damaged="ignore")
    with pytest.raises(InvalidArgumentError, match=r"CacheConfig\.disk\.sync_interval_s must be"):
        DiskConfig(sync_interval_s=0)
    with pytest.raises(InvalidArgumentError, match="model_id"):
        CacheConfig(tokens_per_block=4, gpu_blocks=4, model_id=3)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), stops=st.lists(st.integers(0, 14), min_size=1, max_size=3),
       flip=st.none() | st.integers(0, 32 * BLOCK_BYTES - 1),
       cut=st.none() | st.integers(1, 400), partial=st.booleans(),
       windows=st.sampled_from([[None], [None, None], [None, 8]]))
def test_restart_at_random_points(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                  stops: list[int], flip: int | None, cut: int | None,
                                  partial: bool, windows: list[int | None]) -> None:
    """Serve a workload, abandon the manager after a random number of requests (no cleanup),
    maybe flip a byte of the disk file and cut the manifest's tail, start again, go on; at
    every restart each re-indexed block holds its own bytes, invariants hold, and admission
    matches its plan."""
    path = tmp_path_factory.mktemp("persist")
    prompts = workload(seed, 15)
    # a partial copy needs a GPU slot beside the 4 of a 16-token prompt: 6 always fit
    kw: dict[str, object] = dict(damaged="keep_prefix",
                                 enable_partial_reuse=partial, gpu_blocks=6,
                                 window_sizes=windows, layer_geometry=[GEOM] * len(windows))
    m = KVCacheManager(config(path, **kw))
    done = 0
    for stop in sorted(stops):
        for k in range(done, max(done, stop)):
            serve(m, f"s{k}", prompts[k])
        done = max(done, stop)
        crash(m)
        if flip is not None:
            with open(path / persistent_name(0), "r+b") as f:
                f.seek(flip)
                byte = f.read(1)
                f.seek(flip)
                f.write(bytes([byte[0] ^ 0x10]))
        if cut is not None:
            data = (path / MANIFEST_NAME).read_bytes()
            (path / MANIFEST_NAME).write_bytes(data[:max(0, len(data) - cut)])
        try:
            m = KVCacheManager(config(path, **kw))
        except ManifestError:  # the cut reached the header: only discarding can start
            m = KVCacheManager(config(path, **kw | {"damaged": "discard"}))
        check_disk_blocks(m)
        m.check_invariants()
        request = [SequenceRequest("p", prompts[done % len(prompts)])]
        plan = m.plan_batch(request)
        r = m.add_sequence_batch(request)[0]
        assert r.reused_tokens == plan.requests[0].reused_tokens
        m.remove_sequence("p", store_for_reuse=False)
    check_onboarded(m, prompts)
    m.close()


def test_restored_blocks_are_announced_as_stored_on_the_disk_tier(tmp_path: Path) -> None:
    """A router following the events learns what the restarted manager holds: one stored
    event per restored chain stretch, at cache level 2, and the stretches' blocks are exactly
    the cached blocks."""
    filled(tmp_path)
    m = KVCacheManager(config(tmp_path, events=EventsConfig(buffer_max_size=1000)))
    m.flush_iteration_events()
    stored = [b for e in m.get_latest_events() if isinstance(e.data, Stored)
              for b in e.data.blocks]
    assert stored and {b.cache_level for b in stored} == {Tier.DISK}
    assert {(b.block_hash, 0, int(Tier.DISK)) for b in stored} == m.cached_blocks()
    m.close()


def test_sync_fsyncs_and_compaction_keeps_only_the_paths_in_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a sync interval the manifest is fsynced as calls go; a compaction (forced here:
    the log is far below 1 MiB) forgets the path records no recorded block descends from, and
    the next restart still finds every recorded block."""
    m = KVCacheManager(config(tmp_path, sync_interval_s=1e-9, disk_blocks=6))
    for k, tokens in enumerate(workload(4, 40)):
        serve(m, f"s{k}", tokens)
    disk = m.persistent_disk
    assert disk is not None
    manifest = disk.manifest
    paths_before = set(manifest.paths)
    monkeypatch.setattr(Manifest, "needs_compaction", lambda self: True)
    disk.sync()
    live = set()
    for e in manifest.entries.values():
        key = e.parent
        while key is not None:
            live.add(key)
            key = manifest.paths[key].parent
    assert set(manifest.paths) == live and live < paths_before
    recorded = len(manifest.entries)
    crash(m)
    m = KVCacheManager(config(tmp_path, disk_blocks=6))
    assert m.persistent_disk.restored.slots == recorded  # type: ignore[union-attr]
    assert check_disk_blocks(m) == recorded
    m.close()


def test_the_log_is_compacted_without_a_sync_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With disk.sync_interval_s=None the manifest is still compacted as calls go (here from
    its first byte on): it never grows past twice its live records plus one call's."""
    monkeypatch.setattr("kvpool.tiers.manifest._COMPACT_MIN_BYTES", 0)
    compactions = []
    compact = Manifest.compact
    monkeypatch.setattr(Manifest, "compact", lambda self: compactions.append(1) or compact(self))
    m = KVCacheManager(config(tmp_path, disk_blocks=6))
    disk = m.persistent_disk
    assert disk is not None
    for k, tokens in enumerate(workload(8, 40)):
        serve(m, f"s{k}", tokens)
        live = len(disk.manifest.entries) + len(disk.manifest.paths)
        assert disk.manifest._log_records <= 2 * live + 3 * 6  # one call's drops, puts, paths
    assert len(compactions) > 5
    recorded = len(disk.manifest.entries)
    crash(m)
    m = KVCacheManager(config(tmp_path, disk_blocks=6))
    assert check_disk_blocks(m) == recorded == m.persistent_disk.restored.slots  # type: ignore[union-attr]
    m.close()


def test_sync_from_another_thread_while_calls_run(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """sync() (compacting every time here) from a background thread while the scheduler's
    thread serves: it takes the manager's lock, so the manifest stays whole."""
    monkeypatch.setattr(Manifest, "needs_compaction", lambda self: True)
    m = KVCacheManager(config(tmp_path, disk_blocks=8))
    disk = m.persistent_disk
    assert disk is not None
    stop = threading.Event()
    syncs = []

    def syncing() -> None:
        while not stop.is_set():
            disk.sync()
            syncs.append(1)

    thread = threading.Thread(target=syncing)
    thread.start()
    try:
        for k, tokens in enumerate(workload(6, 30)):
            serve(m, f"s{k}", tokens)
    finally:
        stop.set()
        thread.join()
    recorded = dict(disk.manifest.entries)
    crash(m)
    m = KVCacheManager(config(tmp_path, disk_blocks=8))
    assert len(syncs) > 1 and m.persistent_disk.restored.slots == len(recorded)  # type: ignore[union-attr]
    assert check_disk_blocks(m) == len(recorded)
    m.close()


class PersistentDataPlane(DataPlaneMachine):
    """The tiered data-plane machine of test_manager_tiers (admit, grow, suspend, resume,
    remove; every block on every tier holds its prefix's bytes) on a persistent disk tier,
    with one more rule: the manager ends (killed, or closed on purpose) and a new one starts
    on the same disk.path. Every block the new one re-indexes must hold its bytes."""

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        groups = data.draw(st.integers(1, 2))
        self.tmp = Path(tempfile.mkdtemp(prefix="kvpool-persist-"))
        self.cfg = CacheConfig(
            tokens_per_block=data.draw(st.integers(1, 3)), gpu_blocks=data.draw(st.integers(3, 8)),
            window_sizes=data.draw(st.sampled_from([[None] * groups, [None, 4][:groups]])),
            host_blocks=data.draw(st.integers(1, 5)), disk_blocks=data.draw(st.integers(1, 6)),
            enable_partial_reuse=data.draw(st.booleans()), layer_geometry=[TIERS_GEOM] * groups,
            device="cpu",
            disk=DiskConfig(path=str(self.tmp), persistent=True, sync_interval_s=None),
            eviction=EvictionConfig(offload_min_priority=0))
        self.m = KVCacheManager(self.cfg)

    @precondition(lambda self: self.m is not None and not self.live and not self.suspended
                  and bool(self.m.tree_blocks()))
    @rule(graceful=st.booleans())
    def restart(self, graceful: bool) -> None:
        if graceful:
            self.mgr.close()
        else:
            crash(self.mgr)
        self.m = KVCacheManager(self.cfg)

    def teardown(self) -> None:
        if self.m is not None:
            self.m.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


TestPersistentDataPlane = PersistentDataPlane.TestCase
TestPersistentDataPlane.settings = settings(max_examples=30, stateful_step_count=30,
                                            deadline=None)
