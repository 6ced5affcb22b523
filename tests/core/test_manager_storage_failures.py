"""Storage failures through the manager (ARCHITECTURE §7.6, issue 21): a call that would copy
blocks while the storage cannot (closed, a disk-tier file removed or truncated) raises
StorageError with the manager unchanged and no event, and later calls work.

The real disk tier runs in subprocesses, so a SIGBUS (what a memory-mapped tier did on a
truncated file) shows up as the child's signal exit instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.config import CacheConfig, DiskConfig, EventsConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import CopiesLostError, KVPoolError, StorageError
from kvpool.events.index import EventIndex
from kvpool.tiers.storage import BlockCopy, GroupGeometry, MetadataStorage

SRC = str(Path(__file__).resolve().parents[2] / "src")


def snapshot(m: KVCacheManager) -> dict[str, Any]:
    """Everything observable: the debug state (stats included), pool usage, cached blocks."""
    usage = [
        m.slot_usage(t, g) for t in range(m.config.num_tiers) for g in range(m.config.num_groups)
    ]
    tree = sorted((bytes(toks), slots, tiers) for toks, slots, tiers in m.tree_blocks())
    return {"debug": m.debug_state(), "usage": usage, "tree": tree, "cached": m.cached_blocks()}


def drained_events(m: KVCacheManager) -> list[Any]:
    m.flush_iteration_events()
    return m.get_latest_events(0)


class Flaky(MetadataStorage):
    """A metadata storage that can be told to fail its next check or its next copy."""

    def __init__(self, tokens_per_block: int) -> None:
        super().__init__(tokens_per_block)
        self.fail_check = False
        self.fail_copy = False
        self.copy_calls = 0

    def check(self) -> None:
        if self.fail_check:
            self.fail_check = False
            raise StorageError("injected: the storage cannot copy now")
        super().check()

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        self.copy_calls += 1
        if self.fail_copy:
            self.fail_copy = False
            raise StorageError("injected: the disk failed during the copy")
        super().copy_blocks(copies)


# ---------------------------------------------------------------------------- closed storage


def tiered(**kw: Any) -> KVCacheManager:
    kw = {"tokens_per_block": 4, "gpu_blocks": 4, "host_blocks": 4, "disk_blocks": 4,
          "events": EventsConfig(buffer_max_size=10_000), **kw}
    return KVCacheManager(CacheConfig(**kw))


def fill_gpu_and_host(m: KVCacheManager) -> None:
    """Cached blocks on every tier: each prompt's two blocks push the previous ones down."""
    for i in range(5):
        m.add_sequence(SequenceRequest(i, list(range(100 * i, 100 * i + 9))))
        m.remove_sequence(i)


def offloading_admission(m: KVCacheManager) -> None:
    m.add_sequence(SequenceRequest("new", list(range(900, 909))))


def onboarding_admission(m: KVCacheManager) -> None:
    m.add_sequence(SequenceRequest("again", list(range(0, 9))))  # prompt 0 went to disk


def growth_that_evicts(m: KVCacheManager) -> None:
    m.add_tokens("grow", [7])


def suspension(m: KVCacheManager) -> None:
    m.suspend("grow")


def resumption(m: KVCacheManager) -> None:
    m.resume("held")


def partial_copy(m: KVCacheManager) -> None:
    m.add_sequence(SequenceRequest("partial", [1, 2, 3, 4, 5, 6, 99]))


def prepare(call: Callable[[KVCacheManager], None]) -> KVCacheManager:
    if call is partial_copy:  # one tier: the only copies are partial-block copies
        m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=8,
                                       events=EventsConfig(buffer_max_size=10_000)))
        # a running sequence's stored blocks: partly matching one means copying it
        m.add_sequence(SequenceRequest("src", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
        m.store_context_blocks("src", 8)
        return m
    m = tiered()
    fill_gpu_and_host(m)
    if call in (growth_that_evicts, suspension):
        m.add_sequence(SequenceRequest("grow", list(range(500, 508))))  # 2 full blocks
    if call is resumption:
        m.add_sequence(SequenceRequest("held", list(range(600, 606))))
        m.suspend("held")
    return m


CALLS = [offloading_admission, onboarding_admission, growth_that_evicts, suspension,
         resumption, partial_copy]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_a_call_that_would_copy_on_a_closed_storage_changes_nothing(
    call: Callable[[KVCacheManager], None],
) -> None:
    m = prepare(call)
    copies = m.storage.stats().batched_ops
    drained_events(m)
    before = snapshot(m)
    m.storage.close()
    with pytest.raises(StorageError, match="closed"):
        call(m)
    assert snapshot(m) == before
    assert drained_events(m) == []
    m.check_invariants()
    assert m.storage.stats().batched_ops == copies
    # the same call on an open storage copies (so the closed one really had to refuse)
    twin = prepare(call)
    call(twin)
    assert twin.storage.stats().batched_ops > copies


def test_an_unreadable_disk_slot_refuses_the_admission_before_anything_changes(
    tmp_path: Path,
) -> None:
    """The disk slots an admission onboards are read before it changes anything: a read that
    fails (the file's descriptor made write-only under the running tier, so every ``pread``
    fails at the OS while ``fstat`` and the checks still pass) refuses the call with the
    manager unchanged and no event; readable again, the same call admits and onboards."""
    pytest.importorskip("torch")
    cfg = CacheConfig(tokens_per_block=4, gpu_blocks=4, host_blocks=4, disk_blocks=8,
                      layer_geometry=[GroupGeometry(1, 1, 64, "float32")], device="cpu",
                      disk=DiskConfig(path=str(tmp_path)),
                      events=EventsConfig(buffer_max_size=10_000))
    with KVCacheManager(cfg) as m:
        fill_gpu_and_host(m)
        on_disk = [t for _, _, tiers in m.tree_blocks() for t in tiers if t == 2]
        assert on_disk  # prompt 0's blocks went to disk
        drained_events(m)
        (path,) = m.storage.disk_files  # type: ignore[attr-defined]
        pool_fd = m.storage._disk[0]._fd  # type: ignore[attr-defined]
        saved = os.dup(pool_fd)
        write_only = os.open(path, os.O_WRONLY)
        os.dup2(write_only, pool_fd)
        before = snapshot(m)
        try:
            with pytest.raises(StorageError, match="cannot read the disk tier"):
                onboarding_admission(m)
            assert snapshot(m) == before and drained_events(m) == []
        finally:
            os.dup2(saved, pool_fd)
            os.close(saved)
            os.close(write_only)
        onboarding_admission(m)
        assert m.sequences["again"].committed_blocks == 2  # both blocks reused
        m.check_invariants()


def test_calls_that_copy_nothing_keep_working_after_close() -> None:
    m = tiered()
    fill_gpu_and_host(m)
    m.add_sequence(SequenceRequest("a", list(range(700, 706))))
    m.close()
    m.add_tokens("a", [1])  # fits its last block: no allocation, no copy
    m.store_context_blocks("a", 4)
    m.remove_sequence("a")
    m.check_invariants()


# ---------------------------------------------------------------------------- property


@st.composite
def configs(draw: st.DrawFn) -> CacheConfig:
    host = draw(st.integers(0, 5))
    return CacheConfig(tokens_per_block=draw(st.integers(1, 3)),
                       gpu_blocks=draw(st.integers(3, 10)), host_blocks=host,
                       disk_blocks=draw(st.integers(0, 5)) if host else 0,
                       enable_partial_reuse=draw(st.booleans()),
                       max_beam_width=draw(st.integers(1, 2)),
                       events=EventsConfig(buffer_max_size=1_000_000))


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9], [5, 5, 5, 5, 5, 5]]


class FailingStorageMachine(RuleBasedStateMachine):
    """Random calls with a storage failure injected at a random moment: a refused call
    leaves the manager as it was (debug state, usage, tree, stats, no event), and the calls
    after it work. A copy failing after the check (no check could see it, and the storage
    does not say which copies failed, so all count): when the call only moved blocks to
    colder tiers, they leave the cache and the call completes; when it brought a block a
    sequence uses, the call raises and the manager stays consistent and refuses every later
    call that would copy."""

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.storage = Flaky(1)
        self.live: dict[int, int] = {}
        self.held: set[int] = set()
        self.next_id = 0
        self.broken = False
        self.repaired = 0  # calls whose failed copies were repaired without raising
        self.index = EventIndex(strict=True)

    @initialize(cfg=configs())
    def setup(self, cfg: CacheConfig) -> None:
        self.storage = Flaky(cfg.tokens_per_block)
        self.m = KVCacheManager(cfg, storage=self.storage)

    @property
    def mgr(self) -> KVCacheManager:
        assert self.m is not None
        return self.m

    def attempt(self, call: Callable[[], object]) -> bool:
        """Run a call; if it raises, nothing may have changed. True if it succeeded."""
        injected = self.storage.fail_check
        copy_injected = self.storage.fail_copy
        before = snapshot(self.mgr)
        copies = self.storage.copy_calls
        ev = self.mgr.events
        mark = (ev.num_pending, ev.next_event_id)  # type: ignore[union-attr]
        try:
            call()
        except StorageError as exc:
            # CopiesLostError: the one error after which the manager may have changed, raised
            # by the call whose copies were lost and by every later call that may copy
            assert isinstance(exc, CopiesLostError) == (
                self.broken or (copy_injected and not self.storage.fail_copy)), repr(exc)
            if copy_injected and not self.storage.fail_copy:
                # the copy ran and failed, bringing a block a sequence uses (beyond repair):
                # the call's bookkeeping stays (what it registered, suspended or resumed is
                # the manager's word now) and the manager refuses every later copy
                self.broken = True
                seqs = self.mgr.sequences
                self.live = {k: q.beam_width for k, q in seqs.items() if not q.suspended}  # type: ignore[misc]
                self.held = {k for k, q in seqs.items() if q.suspended}  # type: ignore[misc]
                return False
            assert injected or self.broken, "a storage error nobody injected"
            assert snapshot(self.mgr) == before, "a refused call changed the manager"
            assert self.storage.copy_calls == copies, "a refused call copied"
            assert (ev.num_pending, ev.next_event_id) == mark, "a refused call emitted"  # type: ignore[union-attr]
            return False
        except KVPoolError:
            assert snapshot(self.mgr) == before, "a failed call changed the manager"
            return False
        if injected or self.broken:  # a call that copies must have asked the storage first
            assert self.storage.copy_calls == copies, "copied without checking the storage"
        if copy_injected and not self.storage.fail_copy:
            # the copy ran and failed, but only blocks moving to a colder tier were lost:
            # they left the cache (the consistent invariant checks the rest), nothing raised
            assert self.mgr._st.failed_copies > 0 and self.mgr._st.copy_failure is None
            self.repaired += 1
        return True

    @rule()
    def fail_next_check(self) -> None:
        self.storage.fail_check = True

    @rule()
    def fail_next_copy(self) -> None:
        self.storage.fail_copy = True

    @rule(prompts=st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=2),
          tail=st.integers(0, 3), beams=st.integers(1, 2))
    def admit(self, prompts: list[int], tail: int, beams: int) -> None:
        beams = min(beams, self.mgr.config.max_beam_width)
        reqs = []
        for p in prompts:
            reqs.append(SequenceRequest(self.next_id, [*PROMPTS[p], tail], beam_width=beams))
            self.next_id += 1
        if self.attempt(lambda: self.mgr.add_sequence_batch(reqs)):
            self.live.update((r.seq_id, beams) for r in reqs)  # type: ignore[misc]

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), k=st.integers(1, 4))
    def grow(self, data: st.DataObject, k: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.attempt(lambda: self.mgr.add_tokens(sid, [3] * k))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        n = len(self.mgr.sequences[sid].tokens)
        assert self.attempt(lambda: self.mgr.store_context_blocks(sid, n))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.attempt(lambda: self.mgr.remove_sequence(sid))
        del self.live[sid]

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def suspend(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        if self.attempt(lambda: self.mgr.suspend(sid)):
            del self.live[sid]
            self.held.add(sid)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.held)))
        if self.attempt(lambda: self.mgr.resume(sid)):
            self.held.discard(sid)
            self.live[sid] = self.mgr.sequences[sid].beam_width

    @rule()
    def clear(self) -> None:
        assert self.attempt(self.mgr.clear_cache)

    @invariant()
    def consistent(self) -> None:
        if self.m is None:
            return
        self.m.check_invariants()
        self.index.apply_all(drained_events(self.m))
        assert set(self.index.cached) == self.m.cached_blocks()

    def teardown(self) -> None:
        if self.m is None:
            return
        self.storage.fail_check = self.storage.fail_copy = False
        for sid in [*self.live, *self.held]:
            self.m.remove_sequence(sid)
        self.m.clear_cache()
        self.m.check_invariants()
        for t, per_group in enumerate(self.m.config.slots):
            for g, n in enumerate(per_group):
                assert self.m.slot_usage(t, g)["free"] == n


TestFailingStorage = FailingStorageMachine.TestCase


# ---------------------------------------------------------------------------- real disk tier

CHILD_PRELUDE = """
import json, os, sys
from kvpool import (CacheConfig, DiskConfig, EventsConfig, GroupGeometry, KVCacheManager,
                    SequenceRequest, StorageError)

def snapshot(m):
    return json.dumps(m.debug_state(), default=repr, sort_keys=True) + repr(
        sorted(m.cached_blocks()))

def manager(disk):
    cfg = CacheConfig(tokens_per_block=4, gpu_blocks=4, host_blocks=4, disk_blocks=8,
                      layer_geometry=[GroupGeometry(1, 1, 64, "float32")], device="cpu",
                      disk=DiskConfig(path=disk), events=EventsConfig(buffer_max_size=10_000))
    m = KVCacheManager(cfg)
    for i in range(6):  # blocks pushed down to the disk tier
        m.add_sequence(SequenceRequest(i, list(range(100 * i, 100 * i + 9))))
        m.remove_sequence(i)
    return m
"""


def run_child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvpool-test-fail-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


DAMAGED_FILE = """
outcome = {}
for damage in ("truncated", "removed"):
    disk = os.path.join(sys.argv[1], damage)
    os.mkdir(disk)
    m = manager(disk)
    (path,) = m.storage.disk_files
    if damage == "truncated":
        os.truncate(path, 4096)
    else:
        os.remove(path)
    m.flush_iteration_events(); m.get_latest_events(0)
    before = snapshot(m)
    for name, call in [
        ("onboard", lambda: m.add_sequence(SequenceRequest("a", list(range(0, 9))))),
        ("offload", lambda: m.add_sequence(SequenceRequest("b", list(range(900, 909))))),
    ]:
        try:
            call()
            outcome[damage, name] = "ok"
        except StorageError as exc:
            outcome[damage, name] = str(exc)
        m.flush_iteration_events()
        outcome[damage, name, "unchanged"] = snapshot(m) == before and not m.get_latest_events(0)
    m.check_invariants()
    m.close()
    outcome[damage, "files left"] = os.listdir(disk)
print(json.dumps({" ".join(k): v for k, v in outcome.items()}))
"""


def test_damaged_or_limited_disk_files_are_storage_errors_not_crashes(disk_dir: Path) -> None:
    """A truncated or removed file: refused before anything changes. A file size limit:
    refused at creation; lowered under a running tier, the write fails inside the copy (no
    check can see it coming): the blocks it was writing leave the cache, the call completes
    and later calls work."""
    out = run_child(DAMAGED_FILE + FSIZE_CHILD, str(disk_dir))
    assert out.returncode == 0, f"child died (signal {-out.returncode}): {out.stderr[-2000:]}"
    damaged, limited = map(json.loads, out.stdout.splitlines())
    result = damaged
    for damage in ("truncated", "removed"):
        for call in ("onboard", "offload"):
            assert damage in result[f"{damage} {call}"], result
            assert result[f"{damage} {call} unchanged"] is True
        assert result[f"{damage} files left"] == []
    assert "cannot create the disk tier" in limited["create"]
    assert limited["left after create"] == []
    assert limited["write"] == "ok", limited  # repaired: the blocks left the cache
    assert limited["registered"] is True
    assert limited["failed copies"] > 0 and limited["dropped from disk"] > 0, limited
    assert limited["later"] == "ok"  # the manager goes on (only misses)
    assert limited["left"] == []


KILLED_CHILD = """
m = manager(sys.argv[1])
print(json.dumps(m.storage.disk_files), flush=True)
os.kill(os.getpid(), 9)
"""

LIVE_CHILD = """
import signal
m = manager(sys.argv[1])
child = os.fork()  # a forked child inherits the pools and the SIGTERM handler
if child == 0:
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(3)
assert os.waitpid(child, 0)[1] == signal.SIGTERM  # and dies of it, leaving our files alone
print(json.dumps(m.storage.disk_files), flush=True)
sys.stdin.read()
"""


def test_disk_files_of_dead_owners_are_reclaimed_live_ones_kept_and_sigterm_removes_them(
    disk_dir: Path,
) -> None:
    dead = run_child(KILLED_CHILD, str(disk_dir))
    assert dead.returncode == -9
    dead_files = json.loads(dead.stdout)
    assert dead_files and all(os.path.exists(f) for f in dead_files)  # SIGKILL leaves them
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    with subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(LIVE_CHILD), str(disk_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    ) as live:
        try:
            assert live.stdout is not None
            live_files = json.loads(live.stdout.readline())
            # the live child, starting, reclaimed the dead one's files
            assert not any(os.path.exists(f) for f in dead_files)
            cfg = CacheConfig(tokens_per_block=4, gpu_blocks=2, host_blocks=2, disk_blocks=2,
                              layer_geometry=[GroupGeometry(1, 1, 64, "float32")], device="cpu",
                              disk=DiskConfig(path=str(disk_dir)))
            with KVCacheManager(cfg) as m:
                mine = m.storage.disk_files  # type: ignore[attr-defined]
                assert sorted(os.listdir(disk_dir)) == sorted(
                    os.path.basename(f) for f in [*live_files, *mine]
                )
            # a live owner's files stay (also when a child it forked got SIGTERM)
            assert all(os.path.exists(f) for f in live_files)
            live.terminate()
            assert live.wait(timeout=60) == -15  # the default action still runs after cleanup
        finally:
            live.kill()
    assert os.listdir(disk_dir) == []  # SIGTERM removed the live child's files


FSIZE_CHILD = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding the limit is then EFBIG, not death
disk = os.path.join(sys.argv[1], "fsize")
os.mkdir(disk)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
out = {}
# a disk tier larger than the file size limit: refused at creation, nothing left behind
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
try:
    manager(disk)
    out["create"] = "ok"
except StorageError as exc:
    out["create"] = str(exc)
out["left after create"] = os.listdir(disk)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
m = manager(disk)
# the limit lowered under the running tier: a write past it fails inside the copy, where no
# check could see it coming; the blocks it was offloading to disk leave the cache instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
on_disk = sum(t == 2 for _, _, tiers in m.tree_blocks() for t in tiers)
try:
    m.add_sequence(SequenceRequest("b", list(range(900, 909))))
    out["write"] = "ok"
except StorageError as exc:
    out["write"] = str(exc)
m.check_invariants()
out["registered"] = "b" in m.sequences
out["failed copies"] = m._st.failed_copies
out["dropped from disk"] = on_disk - sum(t == 2 for _, _, tiers in m.tree_blocks() for t in tiers)
m.remove_sequence("b")
try:
    m.add_sequence(SequenceRequest("c", list(range(800, 809))))
    out["later"] = "ok"
except StorageError as exc:
    out["later"] = str(exc)
m.check_invariants()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
m.close()
out["left"] = os.listdir(disk)
print(json.dumps(out))
"""


def in_private_tmpfs(disk: str, size: str) -> list[str]:
    """The command prefix that runs a command with a tmpfs of ``size`` (mode 0700) mounted at
    ``disk`` in a private mount namespace; skips the test where that cannot be done (needs
    ``unshare`` and the right to mount, e.g. root in a container that allows it)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    private = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    mount = f"mount -t tmpfs -o size={size},mode=700 tmpfs"
    probe = subprocess.run([*private, f'{mount} "$1"', "sh", disk],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace: {probe.stderr.strip()}")
    return [*private, f'{mount} "$1" && shift && exec "$@"', "sh", disk]


FULL_DISK_CHILD = """
import torch
from kvpool.tiers.storage import BlockCopy
from kvpool.tiers.torch_storage import TorchStorage
disk = sys.argv[1]
out = {}
geometry = GroupGeometry(1, 1, 256, "float32")  # 8 KiB blocks (4 tokens)
with open(os.path.join(disk, "filler"), "wb") as fh:
    fh.write(b"x" * (64 * 1024 - 3 * 8192))  # leaves room for fewer than 4 blocks
try:
    TorchStorage(4, [geometry], [[2], [2], [4]], device="cpu", disk_path=disk)
    out["no room"] = "ok"
except StorageError as exc:
    out["no room"] = str(exc)
out["left"] = sorted(os.listdir(disk))
os.remove(os.path.join(disk, "filler"))
s = TorchStorage(4, [geometry], [[2], [2], [4]], device="cpu", disk_path=disk)
fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT)
try:  # now fill the disk to the last byte
    while True:
        os.write(fd, b"x" * 512)
except OSError as exc:
    out["filled"] = exc.errno
os.close(fd)
pool = s.tensors(0)
pool.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
want = pool.clone()
s.copy_blocks([BlockCopy(0, 0, 1, 0, 0), BlockCopy(0, 1, 1, 1, 0)])
s.copy_blocks([BlockCopy(1, 0, 2, 3, 0), BlockCopy(1, 1, 2, 2, 0)])
pool.zero_()
s.copy_blocks([BlockCopy(2, 3, 0, 0, 0), BlockCopy(2, 2, 0, 1, 0)])
out["round trip"] = bool(torch.equal(s.tensors(0).view(torch.uint8), want.view(torch.uint8)))
s.close()
print(json.dumps(out))
"""


def test_a_full_disk_refuses_the_tier_at_creation_and_never_fails_a_later_write(
    disk_dir: Path,
) -> None:
    """A real full filesystem: a 64 KiB tmpfs mounted in a private mount namespace (needs
    ``unshare`` and the right to mount, e.g. root in a container that allows it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    script = CHILD_PRELUDE + textwrap.dedent(FULL_DISK_CHILD)
    out = subprocess.run(
        [*in_private_tmpfs(str(disk_dir), "64k"), sys.executable, "-c", script, str(disk_dir)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert "bytes free" in result["no room"]
    assert result["left"] == ["filler"]
    assert result["filled"] == 28  # ENOSPC: the disk really was full
    assert result["round trip"] is True
