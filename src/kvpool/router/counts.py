"""The index's block counts: the global presence masks and every worker's reference counts.

* One global dict maps a normalized block hash (an unsigned 64-bit int, see
  :func:`~kvpool.events.keyed.normalize_hash`) to a packed presence mask: bit
  ``tier * stride + slot`` is set when the worker in ``slot`` holds the hash on ``tier``
  (0 = GPU, 1 = host, 2 = disk) in any of its layer groups. Walking a 256-block request over
  32 workers is then 256 dict lookups and a few integer operations per block
  (:mod:`kvpool.router.scoring`).
* Reference counts per worker, layer group and tier: vLLM does not de-duplicate, so a hash
  stored twice is removed twice before it is gone. A worker with one layer group (the usual
  case) is *compact*: its presence bits in the global dict are its counts of one, and it keeps
  only the counts above one (per tier, usually empty). Applying a block event then touches one
  large dict instead of two, which halves its cost once the index outgrows the CPU caches.
  Dropping a compact worker's blocks (reset, all cleared, removal) scans the global dict
  instead of the worker's own. The first event of a second layer group expands the worker
  into per group, per tier dicts of counts.

Steps that would take a reference from a tier holding none, or that meet a pending one, go
through the worker's reorder ledger (:mod:`kvpool.router.ledger`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import and_
from typing import Final, cast

from kvpool.router.ledger import LATE_RELEASE, MAX_LEDGER, LedgerEntry, evaluate, settled
from kvpool.router.token_keys import forget, recent_get
from kvpool.router.worker import (
    TIERS,
    IndexCounters,
    WorkerState,
    held_elsewhere,
    none_left,
    tier_bits,
)

M64: Final = (1 << 64) - 1


def tier_runs(
    keys: list[int], level: int | None, levels: Sequence[int | None] | None
) -> list[tuple[int, list[int]]]:
    """``keys`` as runs of one tier each: all on ``level``, or when it is None on the tier
    ``levels`` gives each key (None for 0), or on tier 0 when both are None. An event names
    one tier for all its blocks, usually: one run."""
    if level is not None or levels is None:
        return [(level or 0, keys)]
    runs: list[tuple[int, list[int]]] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or (levels[i] or 0) != (levels[start] or 0):
            runs.append((levels[start] or 0, keys[start:i]))
            start = i
    return runs


class BlockCounts:
    """Presence masks over every worker's reference counts (compact or expanded), with the
    +1 / -1 steps events apply and the ledger that orders late ones.

    Invariant: for every hash ``h``, bit ``tier * stride + slot`` of ``masks[h]`` is set exactly
    when the worker in ``slot`` has a positive reference count for ``h`` on ``tier`` in some
    layer group; hashes with no bit set are absent from ``masks``.
    """

    __slots__ = ("_stride", "counters", "masks")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        """Normalized hash -> packed presence mask (read-only for callers)."""
        self.counters = IndexCounters()
        """Totals over every worker, past and present."""
        self._stride = 64

    def _store(
        self,
        w: WorkerState,
        group: int,
        eid: int,
        rank: int | None,
        keys: list[int],
        level: int | None,
        levels: list[int] | None,
    ) -> None:
        """+1 reference per key: on ``level``, or block by block on ``levels`` when None. A
        compact worker's first reference of a key is its presence bit, further ones its extras;
        a key with a pending ledger entry takes a step there instead."""
        if not (w.compact and w.group == group):
            self._adopt(w, group)
        masks = self.masks
        mget = masks.get
        stride = self._stride
        bit0 = 1 << w.slot
        present = w.present
        ledger = w.ledger
        if w.compact:
            for t, run in tier_runs(keys, level, levels):
                bit = bit0 << (t * stride)
                extra = w.extras[t]
                added = 0  # keys the tier did not hold
                for h in run:
                    if ledger and (group, t, h) in ledger:
                        self._step(w, (group, t, h), eid, rank, 1)
                    elif h not in masks:
                        masks[h] = bit
                        added += 1
                    elif (m := masks[h]) & bit:
                        extra[h] = extra.get(h, 0) + 1
                    else:
                        masks[h] = m | bit
                        added += 1
                present[t] += added
        else:
            tiers = w.groups[group]
            for h, t in zip(keys, [level or 0] * len(keys) if levels is None else levels,
                            strict=True):
                if ledger and (group, t, h) in ledger:
                    self._step(w, (group, t, h), eid, rank, 1)
                    continue
                d = tiers[t]
                c = d.get(h, 0)
                d[h] = c + 1
                if c == 0 and not held_elsewhere(w, group, t, h):
                    masks[h] = mget(h, 0) | (bit0 << (t * stride))
                    present[t] += 1
        w.counters.blocks_stored += len(keys)
        self.counters.blocks_stored += len(keys)

    def _release(
        self, w: WorkerState, group: int, eid: int, rank: int | None, h: int, t: int
    ) -> bool:
        """Take one reference of (group, t, h). False when the tier held none (an anomaly)."""
        key = (group, t, h)
        if w.ledger and key in w.ledger:
            return self._step(w, key, eid, rank, -1)
        c = self._count(w, group, t, h)
        if c > 0:
            self._set_count(w, key, c, c - 1)
            return True
        w.counters.anomalies += 1
        self.counters.anomalies += 1
        stream = w.streams.get(rank)
        late = w.arrived_late
        if late or (stream is not None and not stream.complete_below(eid)):
            # Either the store this refers to may still be on its way, or a later event that
            # arrived first took the reference this one refers to: keep the step, in order.
            entry = LedgerEntry(0)
            entry.steps.append((eid, rank, LATE_RELEASE if late else -1))
            w.ledger[key] = entry
            if len(w.ledger) > MAX_LEDGER:
                for old in list(w.ledger)[: len(w.ledger) // 2]:
                    self._settle_entry(w, old, force=True)
        return False

    def _count(self, w: WorkerState, group: int, t: int, h: int) -> int:
        """The worker's references of ``h`` on tier ``t`` in layer group ``group``."""
        if w.compact:
            if group != w.group or not (self.masks.get(h, 0) >> (t * self._stride + w.slot)) & 1:
                return 0
            return 1 + w.extras[t].get(h, 0)
        tiers = w.groups.get(group)
        return tiers[t].get(h, 0) if tiers is not None else 0

    def _adopt(self, w: WorkerState, group: int) -> None:
        """Make ``group`` one whose counts can be set: a compact worker takes it as its layer
        group, or expands when it has another one."""
        if w.compact:
            if w.group is None:
                w.group = group
            elif group != w.group:
                self._expand(w)
        if not w.compact and group not in w.groups:
            w.groups[group] = [{} for _ in range(TIERS)]

    def _expand(self, w: WorkerState) -> None:
        """A second layer group: the compact worker's counts move to per-group dicts."""
        assert w.compact and w.group is not None
        tiers: list[dict[int, int]] = [{} for _ in range(TIERS)]
        if any(w.present):
            stride = self._stride
            for h, m in self.masks.items():
                for t in range(TIERS):
                    if (m >> (t * stride + w.slot)) & 1:
                        tiers[t][h] = 1 + w.extras[t].get(h, 0)
        w.groups = {w.group: tiers}
        w.compact, w.group, w.extras = False, None, [{} for _ in range(TIERS)]

    def _set_count(self, w: WorkerState, key: tuple[int, int, int], old: int, new: int) -> None:
        """Set a count (old and new >= 0, old the current one) and keep the presence masks in
        step."""
        group, t, h = key
        self._adopt(w, group)
        if w.compact:
            if new > 1:
                w.extras[t][h] = new - 1
            elif old > 1:
                del w.extras[t][h]
            if (old > 0) == (new > 0):
                return
        else:
            tiers = w.groups[group]
            if new > 0:
                tiers[t][h] = new
            else:
                tiers[t].pop(h, None)
            if (old > 0) == (new > 0) or (len(w.groups) > 1 and held_elsewhere(w, group, t, h)):
                return
        bit = (1 << w.slot) << (t * self._stride)
        if new > 0:
            self.masks[h] = self.masks.get(h, 0) | bit
            w.present[t] += 1
        else:
            m = self.masks[h] & ~bit
            if m:
                self.masks[h] = m
            else:
                del self.masks[h]
            w.present[t] -= 1

    def _step(
        self, w: WorkerState, key: tuple[int, int, int], eid: int, rank: int | None, delta: int
    ) -> bool:
        """Add a step to a ledger entry; True when the count went down (for a release)."""
        group, t, h = key
        before = self._count(w, group, t, h)
        if delta < 0 and w.arrived_late:
            delta = LATE_RELEASE
        w.ledger[key].steps.append((eid, rank, delta))
        after = self._settle_entry(w, key)
        return after < before

    def _settle_entry(self, w: WorkerState, key: tuple[int, int, int], force: bool = False) -> int:
        entry = w.ledger[key]
        old = self._count(w, *key)
        count = evaluate(entry, w.streams)
        self._set_count(w, key, old, max(count, 0))
        if force or settled(entry, count, w.streams):
            del w.ledger[key]  # from now on a plain count
        return max(count, 0)

    def _settle(self, w: WorkerState) -> None:
        """Holes closed: re-evaluate every ledger entry."""
        for key in list(w.ledger):
            self._settle_entry(w, key)

    def _remove_mapped(
        self,
        w: WorkerState,
        group: int,
        eid: int,
        rank: int | None,
        engine: list[int],
        level: int | None,
        levels: Sequence[int] | None,
    ) -> None:
        """:meth:`_remove` for a token-matched worker: ``engine`` are the engine's (normalized)
        hashes. A hash the index never mapped is an anomaly, skipped; the mapping of a block
        held nowhere any more is kept a while (:meth:`_forget_chains`)."""
        keys: list[int | None] = list(map(w.chain.get, engine))
        mapped_all = all(keys)  # in C; False for a key of 0 too: then check for None
        if not mapped_all:
            keys = [
                k if k is not None else recent_get(w, h) for h, k in zip(engine, keys, strict=True)
            ]
            mapped_all = None not in keys
        if (mapped_all and len(set(keys)) == len(keys) and not w.ledger
                and len(keys) <= MAX_LEDGER):
            # The usual case, in bulk. Distinct keys: whether a block is still held after its
            # own release does not depend on the other releases; and the ledger cannot
            # overflow (settling other entries) within this event.
            mapped = cast(list[int], keys)
            nothing_left = none_left(w, group, level, levels)
            self._remove(w, group, eid, rank, mapped, level, levels)
            if nothing_left:  # no block to look up: every mapping goes
                forget(w, engine)
            else:
                self._forget_chains(w, engine, mapped)
            return
        removed = 0
        for i, key in enumerate(keys):
            if key is None:
                w.counters.anomalies += 1
                self.counters.anomalies += 1
                continue
            if level is not None:
                removed += self._release(w, group, eid, rank, key, level)
            elif levels is not None:
                removed += self._release(w, group, eid, rank, key, levels[i] or 0)
            else:
                removed += self._release_everywhere(w, group, eid, rank, key)
            self._forget_chains(w, engine[i:i + 1], [key])
        w.counters.blocks_removed += removed
        self.counters.blocks_removed += removed

    def _remove(
        self,
        w: WorkerState,
        group: int,
        eid: int,
        rank: int | None,
        keys: list[int],
        level: int | None,
        levels: Sequence[int] | None,
    ) -> None:
        """-1 reference per key: on ``level``; block by block on ``levels`` when ``level`` is
        None; on every tier that holds it when both are None. A compact worker's extras go
        first, then its presence bit; a key with a pending ledger entry takes a step there; a
        key the tier does not hold is an anomaly (kept in the ledger when it may be early)."""
        present = w.present
        everywhere = level is None and levels is None
        ledger = w.ledger
        if everywhere and (present[1] or present[2] or ledger
                           or not (w.compact and group == w.group)):
            removed = sum([self._release_everywhere(w, group, eid, rank, key) for key in keys])
        elif w.compact and group == w.group:
            # (A removal from every tier while only the GPU holds anything is a GPU removal.)
            masks = self.masks
            removed = anomalies = 0
            for t, run in tier_runs(keys, level, levels):
                extra = w.extras[t]
                bit = (1 << w.slot) << (t * self._stride)
                clear = ~bit
                dropped = 0  # keys the tier no longer holds
                for key in run:
                    if ledger and (group, t, key) in ledger:
                        removed += self._step(w, (group, t, key), eid, rank, -1)
                        continue
                    m = masks.get(key, 0)
                    if not m & bit:
                        if everywhere:  # held nowhere, and nothing is pending
                            anomalies += 1
                        else:
                            self._release(w, group, eid, rank, key, t)
                        continue
                    removed += 1
                    if extra and key in extra:
                        c = extra.pop(key)
                        if c > 1:
                            extra[key] = c - 1
                        continue
                    dropped += 1
                    if m := m & clear:
                        masks[key] = m
                    else:
                        del masks[key]
                present[t] -= dropped
            if anomalies:
                w.counters.anomalies += anomalies
                self.counters.anomalies += anomalies
        elif levels is None:
            removed = sum([self._release(w, group, eid, rank, key, level or 0) for key in keys])
        else:
            removed = sum([self._release(w, group, eid, rank, key, t or 0)
                           for key, t in zip(keys, levels, strict=True)])
        w.counters.blocks_removed += removed
        self.counters.blocks_removed += removed

    def _release_everywhere(
        self, w: WorkerState, group: int, eid: int, rank: int | None, key: int
    ) -> int:
        """A removal without tiers: one reference from every tier that holds ``key``."""
        held = [t for t in range(TIERS) if self._count(w, group, t, key)]
        if not held:
            w.counters.anomalies += 1
            self.counters.anomalies += 1
        return sum([self._release(w, group, eid, rank, key, t) for t in held])

    def _forget_chains(self, w: WorkerState, engine: Sequence[int], keys: Sequence[int]) -> None:
        """Engine hashes whose keys the worker no longer holds on any tier move to the recently
        removed mappings. Kept a while: a block removed from one tier is often announced on
        another right after (by hash only), and a late child may still name it as parent."""
        if w.compact:
            masks = self.masks
            held = tier_bits(w.slot, self._stride)
            gone = [h for h, k in zip(engine, keys, strict=True) if not masks.get(k, 0) & held]
        else:
            groups = w.groups.values()
            gone = [h for h, k in zip(engine, keys, strict=True)
                    if not any(k in d for tiers in groups for d in tiers)]
        forget(w, gone)

    def _drop_blocks(self, w: WorkerState) -> None:
        masks = self.masks
        stride = self._stride
        if w.compact:
            if any(w.present):
                # The worker keeps no list of its hashes: find them by its bits (in C loops).
                bits = tier_bits(w.slot, stride)
                clear = ~bits
                for h in list(compress(masks, map(and_, masks.values(), repeat(bits)))):
                    m = masks[h] & clear
                    if m:
                        masks[h] = m
                    else:
                        del masks[h]
        else:
            for t in range(TIERS):
                clear = ~((1 << w.slot) << (t * stride))
                for tiers in w.groups.values():
                    for h in tiers[t]:
                        m = masks.get(h, 0) & clear
                        if m:
                            masks[h] = m
                        else:
                            masks.pop(h, None)
        w.compact, w.group, w.extras = True, None, [{} for _ in range(TIERS)]
        w.groups.clear()
        w.ledger.clear()
        w.chain.clear()
        w.chain_recent.clear()
        w.chain_older.clear()
        w.present = [0] * TIERS

    def _grow(self) -> None:
        old, new = self._stride, self._stride * 2
        full = (1 << old) - 1
        masks = self.masks
        for h, m in masks.items():
            out = 0
            for t in range(TIERS):
                out |= ((m >> (t * old)) & full) << (t * new)
            masks[h] = out
        self._stride = new
