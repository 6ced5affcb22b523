"""Warm restart of a persistent disk tier: a manifest kept in step with the disk slots, and the
blocks it names put back into a new manager's tree.

A manager with ``CacheConfig.disk.persistent`` set opens its disk files under stable names
(:func:`kvpool.tiers.diskfile.open_persistent_pools`) and a manifest beside them
(``kvpool-persistent.manifest``, :mod:`kvpool.tiers.manifest`) whose header is the manager's
namespace (:class:`~kvpool.tiers.remote.namespace.RemoteNamespace`: ``model_id``, geometry per layer
group, tokens per block, hash algorithm).

Keeping it in step, at the end of every call that copies blocks (``CacheState.finish_call``):

1. before the copies run, a ``drop`` record for every recorded disk slot they will write;
2. the copies (the storage hashes each block it writes to the disk tier: xxh3_64);
3. after them, one ``put`` record per disk slot now holding a cached block of the tree: layer
   group, slot, full chained key, tokens, parent key (or the reuse scope of a chain's first
   block) and the hash of the bytes written; and a ``path`` record (key, tokens, parent or
   scope, no slot) for each of its ancestors that none names yet, root first.

A disk slot the manager stops using without writing it (onboarded, dropped) keeps its ``put``:
its bytes are still that block's, so reusing them after a restart is correct. ``clear_cache``
empties the manifest. ``close`` first spills the GPU and host tiers' cached blocks into free
disk slots (:meth:`PersistentDisk.spill`), so a graceful restart keeps the whole cache as far
as the disk tier holds it.

The rule that keeps stale bytes out: at a warm restart a recorded block is re-indexed only if
the xxh3_64 of the bytes its slot holds *now* equals the hash recorded with it. Whatever
happened between a record and the end of the process - bytes rewritten after their record, a
record on disk whose bytes were not (a machine crash), a ``drop`` that was lost, a damaged
file - leaves bytes that differ from the recorded hash, and the block is a miss (serving a
wrong block would take a 64-bit hash collision). Each record carries its own checksum too
(:mod:`kvpool.tiers.manifest`), so a damaged record is never applied; a damaged or foreign manifest
is refused with :class:`~kvpool.errors.ManifestError` unless ``disk.manifest_damaged`` says to
keep its intact prefix or discard it.

What is re-indexed: every chain from a scope's root that leads to a trusted slot. Its blocks
whose bytes are on disk get their disk slots; the others (they were on the GPU or host tier
when the process ended, or their slot was reused since) become path blocks without slots.
Admission stops a match at a path block in a full-attention group, so they serve nothing by
themselves, but once the engine computes that prefix again its commit fills them (as for any
path block) and the disk-resident rest of the chain is reused. A trusted slot no recorded chain
reaches (its path records were lost with a damaged tail) is freed (``orphaned``). Retention
priorities are not kept: the blocks enter the disk tier's eviction queue with the default
priority, in manifest order, and are announced as stored events on the disk tier. The manifest
is then rewritten to exactly what was re-indexed, parents before children (a torn tail later
loses leaves first).

Durability: records are written with ``write(2)`` at the end of each call, so they survive the
process (SIGKILL included); the disk files and then the manifest are fsynced every
``disk.sync_interval_s`` seconds of calls, by :meth:`PersistentDisk.sync` and at ``close``. A
record that was not fsynced when the machine crashed is lost (a miss), or disowned by the rule.

Failures (a full disk, a file size limit, an I/O error) never skip a call's data copies and
never make a call raise: the records are an index whose every entry the rule checks, so a
record that cannot be written costs only a miss after a restart. A ``drop`` that is lost
leaves a ``put`` whose hash the new bytes do not match; a ``put`` that is lost leaves its block
unrecorded; a failed compaction leaves the old log. A disk slot whose *data* write failed holds
no block (the manager drops it: :meth:`kvpool.core.state.CacheState.copy`), so no ``put`` names it.
Each failure is counted (``manifest_failures`` in :meth:`PersistentDisk.stats`, with the last
error) and logged (the first of each run of failures). An fsync of the disk files that fails
is different: the kernel may have dropped the bytes it could not write, so a later read could
return old ones; the manager then refuses every call that may copy, saying why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from array import array
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvpool.core.radix import NO_SLOT, Run, SlotId
from kvpool.errors import (
    CopiesLostError,
    CopyFailedError,
    InvalidArgumentError,
    ManifestError,
    StorageError,
)
from kvpool.eviction.priority import DEFAULT_PRIORITY
from kvpool.hashing.keys import BlockKey
from kvpool.tiers.manifest import Manifest, ManifestEntry, OnDamage
from kvpool.tiers.remote.namespace import RemoteNamespace
from kvpool.tiers.storage import BlockCopy, Tier

if TYPE_CHECKING:
    from kvpool.core.state import CacheState
    from kvpool.core.views import Scope

__all__ = ["MANIFEST_NAME", "PersistentDisk", "PersistentStorage", "RestoreStats", "attach"]

MANIFEST_NAME = "kvpool-persistent.manifest"
_ON_DAMAGE: dict[str, OnDamage] = {
    "refuse": "raise", "keep_prefix": "keep_prefix", "discard": "discard",
}
_DISK = int(Tier.DISK)
log = logging.getLogger(__name__)


@runtime_checkable
class PersistentStorage(Protocol):
    """What a persistent disk tier needs of the storage (``TorchStorage(persistent=True)``)."""

    @property
    def persistent(self) -> bool: ...

    def disk_checksums(self, layer_group: int, slots: Sequence[int]) -> list[int]: ...

    def read_disk_checksums(self, layer_group: int, slots: Sequence[int]) -> list[int]: ...

    def sync_disk(self) -> None: ...

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class RestoreStats:
    """What a warm restart found: blocks re-indexed with their disk slots (``blocks``,
    ``slots``) and the path blocks above them (no bytes: ``path_blocks``), and recorded slots
    it did not trust (``stale``: bytes differ from their hash), could not place (``orphaned``:
    no recorded chain from a root) or found invalid (``invalid``: a slot or group that no
    longer exists, a conflicting record)."""

    blocks: int = 0
    path_blocks: int = 0
    slots: int = 0
    stale: int = 0
    orphaned: int = 0
    invalid: int = 0


@dataclass(slots=True)
class _Block:
    """One recorded block: its entries' common fields and its trusted slot per group."""

    tokens: tuple[int, ...]
    parent: BlockKey | None
    scope: Scope
    order: int
    slots: dict[int, SlotId] = field(default_factory=dict)


def _path_entry(key: BlockKey, b: _Block) -> ManifestEntry:
    """The path record of a recorded block."""
    scope = b.scope if b.parent is None else (None, None)
    return ManifestEntry(0, 0, key, b.tokens, b.parent, 0, *scope)


def attach(state: CacheState, *, owns_storage: bool,
           lock: AbstractContextManager[Any]) -> PersistentDisk | None:
    """The persistent disk tier of a new manager's state (None when ``disk.persistent`` is
    off), its recorded blocks already re-indexed; ``lock`` is the manager's (re-entrant) lock,
    which :meth:`PersistentDisk.sync` takes. On an error the storage is closed if the manager
    built it (``owns_storage``), so its files are unlocked."""
    if not state.config.disk.persistent:
        return None
    disk: PersistentDisk | None = None
    try:
        disk = PersistentDisk(state, lock)
        disk.restore()
    except BaseException:
        if disk is not None:
            disk.manifest.close()
        if owns_storage:
            state.storage.close()
        raise
    return disk


class PersistentDisk:
    """A manager's persistent disk tier: its manifest, kept in step (module docstring)."""

    def __init__(self, state: CacheState, lock: AbstractContextManager[Any]) -> None:
        config = state.config
        storage = state.storage
        if not isinstance(storage, PersistentStorage) or not storage.persistent:
            raise InvalidArgumentError(
                "CacheConfig.disk.persistent needs a storage with a persistent disk tier "
                f"(TorchStorage(..., persistent=True)), got {storage!r:.80}"
            )
        assert config.disk.path is not None  # CacheConfig checks it
        self._st = state
        self._lock = lock
        self._storage = storage
        self.namespace = RemoteNamespace.from_config(config, model=config.model_id)
        path = os.path.join(os.fspath(config.disk.path), MANIFEST_NAME)
        try:
            self.manifest = Manifest(path, self.namespace,
                                     on_damage=_ON_DAMAGE[config.disk.manifest_damaged])
        except ManifestError as exc:
            raise ManifestError(
                f"the persistent disk tier cannot start: {exc}. In CacheConfig, "
                "disk.manifest_damaged='discard' starts with an empty disk tier instead, "
                "'keep_prefix' keeps the blocks recorded before the damage"
            ) from exc
        self.restored = RestoreStats()
        self._interval = config.disk.sync_interval_s
        self._last_sync = time.monotonic()
        self._scopes: dict[int, Scope] = {}  # id(root run) -> its scope
        self._closed = False
        self.manifest_failures = 0  # manifest writes that failed (records left out)
        self.last_manifest_error: str | None = None
        self._failing = False  # the last manifest write failed (log the first of a run only)

    # ---------------------------------------------------------------- keeping it in step

    def before_copy(self, copies: Sequence[BlockCopy]) -> None:
        """Record that the disk slots ``copies`` write no longer hold their old blocks (a
        failure is noted, never raised: module docstring)."""
        if self._closed:
            return
        entries = self.manifest.entries
        drops = [(c.layer_group, c.dst_slot) for c in copies
                 if c.dst_tier == _DISK and (c.layer_group, c.dst_slot) in entries]
        if drops:
            self._write(lambda: self.manifest.append_many(drops=drops))

    def after_copy(self, copies: Sequence[BlockCopy]) -> None:
        """Record the cached blocks ``copies`` wrote to the disk tier (then fsync when the
        sync interval has passed); a failure is noted, never raised (module docstring)."""
        if self._closed:
            return
        written: dict[int, list[SlotId]] = {}
        for c in copies:
            if c.dst_tier == _DISK:
                written.setdefault(c.layer_group, []).append(SlotId(c.dst_slot))
        puts: list[ManifestEntry] = []
        paths: dict[BlockKey, ManifestEntry] = {}
        pools = self._st.pools[_DISK]
        for g, slots in written.items():
            sums = self._storage.disk_checksums(g, slots)
            for slot, checksum in zip(slots, sums, strict=True):
                owner = pools[g].owner(slot)
                if owner is None:
                    continue  # not a cached block (a held copy, dropped in the same call, or
                    # its write failed and the manager dropped it)
                run, i = owner
                if run.tier[g][i] == _DISK and run.slot[g][i] == slot:
                    puts.append(self._entry(g, slot, run, i, checksum))
                    self._record_ancestors(run, i, paths)
        if puts or paths:
            self._write(lambda: self.manifest.append_many(puts=puts, paths=paths.values()))
        if self._interval is not None and time.monotonic() - self._last_sync >= self._interval:
            with contextlib.suppress(StorageError):  # noted (a data fsync: the manager refuses)
                self.sync()
        elif self.manifest.needs_compaction():  # the log stays within twice its live records
            self._write(self._compact)

    def _write(self, write: Callable[[], None]) -> bool:
        """Run one manifest write; a :class:`StorageError` is counted, kept and logged (the
        first of a run of failures), not raised. Whether it succeeded."""
        try:
            write()
        except StorageError as exc:
            self.manifest_failures += 1
            self.last_manifest_error = str(exc)
            if not self._failing:
                log.warning("kvpool: the persistent disk tier's manifest cannot be written; its "
                            "blocks stay served, but those not recorded are misses after a "
                            "restart: %s", exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def _record_ancestors(self, run: Run, i: int, paths: dict[BlockKey, ManifestEntry]) -> None:
        """Add to ``paths`` the ancestors of block i of ``run`` that no path record names yet,
        root first (the ancestors of a recorded path are recorded: the walk stops at one)."""
        recorded = self.manifest.paths
        found: list[ManifestEntry] = []
        j = i - 1
        while True:
            if j < 0:
                parent = run.parent
                if parent is None or parent.parent is None:
                    break
                run, j = parent, len(parent.keys) - 1
            key = run.keys[j]
            if key in recorded or key in paths:
                break
            found.append(self._entry(0, 0, run, j, 0))
            j -= 1
        for e in reversed(found):
            paths[e.key] = e

    def _entry(self, g: int, slot: int, run: Run, i: int, checksum: int) -> ManifestEntry:
        tokens = array("I")
        tokens.frombytes(run.block_tokens(i, self._st.layout.step))
        if i:
            return ManifestEntry(g, slot, run.keys[i], tuple(tokens), run.keys[i - 1], checksum)
        parent = run.parent
        assert parent is not None
        if parent.parent is not None:
            return ManifestEntry(g, slot, run.keys[i], tuple(tokens), parent.keys[-1], checksum)
        lora_id, cache_salt = self._scope_of(parent)
        return ManifestEntry(g, slot, run.keys[i], tuple(tokens), None, checksum,
                             lora_id, cache_salt)

    def _scope_of(self, root: Run) -> Scope:
        scope = self._scopes.get(id(root))
        if scope is None:
            self._scopes = {id(r): s for s, r in self._st.roots.items()}
            scope = self._scopes[id(root)]
        return scope

    def cleared(self) -> None:
        """The cache was cleared: the manifest forgets every block (if its snapshot cannot be
        written, the old records stay on disk: their blocks' bytes, when unchanged, are still
        theirs)."""
        if not self._closed:
            self._write(self.manifest.clear)

    def sync(self) -> None:
        """fsync the disk files, then the manifest (compacted when mostly dead records): what
        was recorded so far survives a machine crash. Takes the manager's lock (it waits for a
        call in progress, and calls wait for it). No-op once closed. Raises
        :class:`StorageError` when an fsync fails: of the manifest, noted as any manifest
        failure; of the disk files, :class:`CopiesLostError`, and the manager refuses every
        later call that may copy with it (the kernel may have dropped bytes it could not
        write)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._storage.sync_disk()
            except StorageError as exc:
                self._st.refuse_copies(f"an fsync of the disk tier failed: {exc}")
                raise CopiesLostError(
                    f"an fsync of the disk tier failed ({exc}): blocks on disk may have lost "
                    "their bytes, so this manager copies nothing more: build a new one"
                ) from exc
            self._last_sync = time.monotonic()
            if not self._write(self.manifest.sync):
                raise StorageError(f"cannot sync the manifest: {self.last_manifest_error}")
            if self.manifest.needs_compaction():
                self._write(self._compact)

    def _compact(self) -> None:
        """Rewrite the manifest as its live records (path records still needed only)."""
        self._prune_paths()
        self.manifest.compact()

    def _prune_paths(self) -> None:
        """Forget the path records no recorded block descends from."""
        paths = self.manifest.paths
        needed: set[BlockKey] = set()
        for e in self.manifest.entries.values():
            key = e.parent
            while key is not None and key not in needed:
                needed.add(key)
                path = paths.get(key)
                key = path.parent if path is not None else None
        for key in [k for k in paths if k not in needed]:
            del paths[key]

    def close(self) -> None:
        """Spill the hotter tiers' cached blocks to free disk slots (:meth:`spill`), sync and
        close the manifest; the manager then closes the storage. Idempotent."""
        if self._closed:
            return
        try:
            if not getattr(self._storage, "closed", False):
                if self._st.copy_failure is None:  # else some blocks may lack their bytes
                    with contextlib.suppress(StorageError):  # what was not written is a miss
                        self.spill()
                with contextlib.suppress(StorageError):  # unsynced bytes fail their hashes
                    self._storage.sync_disk()
        finally:
            self._closed = True
            self.manifest.close()

    def spill(self) -> int:
        """Write the cached blocks of the GPU and host tiers into free disk slots (slots no
        record names first), parents before children, and record them: a manager closed on
        purpose leaves the next one its whole cache, as far as the disk tier holds it. The
        manager's own state does not change. Returns the slots written. (:meth:`close` skips
        it after a failed copy: blocks may then lack their bytes.)"""
        m = self._st
        entries = self.manifest.entries
        # popped from the end: free slots no record names first, lowest numbers first
        free = {g: sorted(m.pools[_DISK][g].free, key=lambda s: (s in recorded, s), reverse=True)
                for g in m.layout.self_groups
                for recorded in [{slot for group, slot in entries if group == g}]}
        copies: list[BlockCopy] = []
        spilled: list[tuple[int, SlotId, Run, int]] = []
        for root in m.roots.values():
            stack = list(root.children.values())
            while stack:
                run = stack.pop()
                stack += run.children.values()
                for j in range(len(run.keys)):
                    for g in m.layout.self_groups:
                        t, slot = run.tier[g][j], run.slot[g][j]
                        if slot != NO_SLOT and t != _DISK and free[g]:
                            dst = free[g].pop()
                            copies.append(BlockCopy(t, slot, _DISK, dst, g))
                            spilled.append((g, dst, run, j))
        if not copies:
            return 0
        self.manifest.append_many(drops=[(g, d) for g, d, _, _ in spilled if (g, d) in entries])
        try:
            self._storage.copy_blocks(copies)
            failed: set[tuple[int, int]] = set()
        except CopyFailedError as exc:  # the slots not written hold no block: no record
            failed = {(c[4], c[3]) for c in exc.failed}
        paths: dict[BlockKey, ManifestEntry] = {}
        puts = []
        for g, dst, run, j in spilled:
            if (g, dst) not in failed:
                puts.append(self._entry(g, dst, run, j,
                                        self._storage.disk_checksums(g, [dst])[0]))
                self._record_ancestors(run, j, paths)
        self.manifest.append_many(puts=puts, paths=paths.values())
        return len(puts)

    # ---------------------------------------------------------------- warm restart

    def restore(self) -> RestoreStats:
        """Re-index the manifest's trusted blocks into the (empty) tree as disk-resident and
        rewrite the manifest to exactly them, parents before children (module docstring)."""
        blocks = self._trusted_blocks()
        kept = self._build(blocks)
        self._enqueue(kept, blocks)
        entries, paths = self.manifest.entries, self.manifest.paths
        placed: list[tuple[int, int]] = [
            (g, run.slot[g][j]) for run, _ in kept for j in range(len(run.keys))
            for g in range(len(run.slot)) if run.slot[g][j] != NO_SLOT]
        ordered = {key: entries[key] for key in placed}
        entries.clear()
        entries.update(ordered)
        paths.clear()
        for run, _ in kept:  # every block with a child in the tree is a path
            last = len(run.keys) - (0 if run.children else 1)
            paths.update((k, _path_entry(k, blocks[k])) for k in run.keys[:last])
        self.manifest.compact()
        self.restored.blocks = sum(run.has_slot(j) for run, _ in kept for j in range(len(run.keys)))
        self.restored.path_blocks = sum(len(run.keys) for run, _ in kept) - self.restored.blocks
        self.restored.slots = len(placed)
        self.restored.orphaned = sum(len(b.slots) for b in blocks.values()) - len(placed)
        return self.restored

    def _trusted_blocks(self) -> dict[BlockKey, _Block]:
        """The recorded blocks: their trusted slots (that exist, their bytes matching their
        hashes) and the path blocks above them."""
        m = self._st
        config = m.config
        disk_slots = config.slots[_DISK]
        by_group: dict[int, list[ManifestEntry]] = {}
        for e in self.manifest.entries.values():
            usable = (e.group in m.layout.self_groups and e.slot < disk_slots[e.group]
                      and 0 < len(e.tokens) <= config.tokens_per_block)
            if usable:
                by_group.setdefault(e.group, []).append(e)
            else:
                self.restored.invalid += 1
        blocks: dict[BlockKey, _Block] = {}
        bad: set[BlockKey] = set()

        def block(e: ManifestEntry) -> _Block:
            scope = (e.lora_id, e.cache_salt)
            b = blocks.get(e.key)
            if b is None:
                b = blocks[e.key] = _Block(e.tokens, e.parent, scope, len(blocks))
            elif (b.tokens, b.parent, b.scope) != (e.tokens, e.parent, scope):
                bad.add(e.key)
            return b

        for g, group_entries in by_group.items():
            sums = self._storage.read_disk_checksums(g, [e.slot for e in group_entries])
            for e, checksum in zip(group_entries, sums, strict=True):
                if checksum != e.data_checksum:
                    self.restored.stale += 1
                    continue
                b = block(e)
                if g in b.slots:
                    self.restored.invalid += 1  # the same block twice in one group: keep one
                    continue
                b.slots[g] = SlotId(e.slot)
        for e in self.manifest.paths.values():
            block(e)
        for key in bad:
            self.restored.invalid += len(blocks.pop(key).slots)
        return blocks

    def _build(self, blocks: dict[BlockKey, _Block]) -> list[tuple[Run, Scope]]:
        """Runs of the blocks reachable from a root that hold a slot or lead to one, hung into
        the manager's tree (parents before children in the returned list)."""
        tpb = self._st.layout.tpb
        children: dict[BlockKey, list[BlockKey]] = {}
        firsts: list[BlockKey] = []
        for key, b in blocks.items():
            if b.parent is None:
                firsts.append(key)
            elif b.parent in blocks and len(blocks[b.parent].tokens) == tpb:
                children.setdefault(b.parent, []).append(key)
        useful: set[BlockKey] = set()  # holds a slot, or a descendant does
        for key, b in blocks.items():
            up: BlockKey | None = key if b.slots else None
            while up is not None and up in blocks and up not in useful:
                useful.add(up)
                up = blocks[up].parent
        kept: list[tuple[Run, Scope]] = []
        stack = [(self._st.root(blocks[k].scope), k) for k in reversed(firsts) if k in useful]
        while stack:
            parent_run, key = stack.pop()
            chain = [key]
            kids: list[BlockKey] = []
            while len(blocks[chain[-1]].tokens) == tpb:
                kids = [k for k in children.get(chain[-1], []) if k in useful]
                if len(kids) != 1 or len(blocks[kids[0]].tokens) != tpb:
                    break
                chain.append(kids[0])
                kids = []
            run = self._new_run(parent_run, chain, blocks)
            if run is not None:
                kept.append((run, blocks[key].scope))
                stack += [(run, k) for k in reversed(kids)]
        return kept

    def _new_run(self, parent: Run, chain: list[BlockKey],
                 blocks: dict[BlockKey, _Block]) -> Run | None:
        """A run of the blocks ``chain`` under ``parent``, or None when ``parent`` already has
        a child with the same first block."""
        raw = [array("I", blocks[k].tokens).tobytes() for k in chain]
        if raw[0] in parent.children:
            return None
        slot = [[blocks[k].slots.get(g, NO_SLOT) for k in chain]
                for g in range(self._st.layout.num_groups)]
        tier = [[_DISK if s != NO_SLOT else 0 for s in row] for row in slot]
        run = Run(parent, b"".join(raw), raw[0], list(chain), slot, tier)
        parent.add_child(run)
        return run

    def _enqueue(self, kept: list[tuple[Run, Scope]], blocks: dict[BlockKey, _Block]) -> None:
        """Point the disk pools at the runs, queue their slots (manifest order), take them off
        the free lists and announce the blocks as stored on the disk tier."""
        m = self._st
        pools = m.pools[_DISK]
        queued: list[tuple[int, int, SlotId, BlockKey]] = []
        for run, scope in kept:
            for g, row in enumerate(run.slot):
                start = None
                for j, s in enumerate([*row, NO_SLOT]):
                    if s != NO_SLOT:
                        pools[g].place(s, run, j)
                        queued.append((blocks[run.keys[j]].order, g, s, run.keys[j]))
                        start = j if start is None else start
                    elif start is not None:
                        m.emit.stored(g, [(run, start, j)], scope[0])
                        start = None
        queued.sort(key=lambda item: item[0])
        used: dict[int, set[SlotId]] = {}
        for _, g, s, key in queued:
            pools[g].enqueue(s, DEFAULT_PRIORITY, key=key)
            used.setdefault(g, set()).add(s)
        for g, slots in used.items():
            pools[g].withdraw_free(slots)

    def stats(self) -> dict[str, Any]:
        """The restart's findings and the manifest's size, for monitoring."""
        r = self.restored
        return {"restored_blocks": r.blocks, "restored_slots": r.slots,
                "restored_path_blocks": r.path_blocks, "stale": r.stale,
                "orphaned": r.orphaned, "invalid": r.invalid,
                "recorded_slots": len(self.manifest.entries),
                "ignored_manifest_bytes": self.manifest.ignored_bytes,
                "manifest_failures": self.manifest_failures,
                "last_manifest_error": self.last_manifest_error}
