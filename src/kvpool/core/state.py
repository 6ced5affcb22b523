"""CacheState: what one manager's calls read and change, shared by the modules that change it.

The manager (:mod:`kvpool.core.manager`) orchestrates; the work is done by modules that each own
one concept and operate on this state:

- :mod:`kvpool.core.allocator`: taking GPU and colder-tier slots, eviction (offload or drop),
  onboarding, and releasing references (the pools' bulk operations plus the tree surgery an
  eviction needs);
- :mod:`kvpool.core.commit`: inserting a sequence's blocks into the prefix tree;
- :mod:`kvpool.core.execute`: executing an admission plan (claim, then allocate);
- :mod:`kvpool.core.lifecycle`: growth, rewind, suspend/resume and removal of a sequence;
- :mod:`kvpool.core.introspect`: read-only views for tests and debugging.

The slots themselves live in :class:`~kvpool.core.slots.SlotPool` objects, one per (tier, layer
group); the state holds those pools, the reuse trees (one root per scope), the sequences, the
call's pending copies and frees, the stats and the event emitter. A mutating call starts with
:meth:`CacheState.begin_call` and ends with :meth:`CacheState.finish_call`, which frees the
colder slots onboarded during the call and runs the call's copies, batched.

A call's failure path (one for every call): everything a call checks (arguments, room, the
storage: :meth:`CacheState.check_storage`; the disk slots it will read, read ahead:
:meth:`CacheState.read_ahead`) is checked before it changes anything, so a call that raises
has changed nothing. What no check can see coming fails later, in the copies, and is repaired
there without raising (:meth:`CacheState.finish_call`): a copy that could not write a colder
tier (a full disk) drops the block it was moving, so no slot is ever said to hold bytes it
does not; a persistent tier's manifest that cannot be written loses only records, which the
bytes' hashes make safe (:mod:`kvpool.core.persist`). Only a copy that was bringing a block a
sequence uses (onto the GPU, or held for a suspended sequence) cannot be repaired, nor the
call undone (its sequences' blocks lost their bytes): that call raises
:class:`~kvpool.errors.CopiesLostError` with its bookkeeping done (the one error that says the
call changed the manager), and the manager refuses every later call that may copy with the same
error (build a new manager). Every other error a call raises left it unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool.config import CacheConfig
from kvpool.core.emit import Emitter, EventSink
from kvpool.core.layout import Layout
from kvpool.core.radix import Run, SlotId
from kvpool.core.sequence import Sequence as Seq
from kvpool.core.slots import SlotPool
from kvpool.core.stats import CacheStats
from kvpool.core.views import PlanView, Scope
from kvpool.errors import (
    CopiesLostError,
    CopyFailedError,
    SequenceStateError,
    UnknownSequenceError,
)
from kvpool.eviction import EvictionPolicy, make_policies
from kvpool.hashing.keys import BlockHasher
from kvpool.tiers.copies import CallCopies
from kvpool.tiers.storage import BlockCopy, Storage

SeqId = int | str
"""A sequence id, as the engine chose it."""

Pool = SlotPool[Run, EvictionPolicy]
"""A pool whose cached slots point back to prefix-tree runs."""

log = logging.getLogger(__name__)


class CopyObserver(Protocol):
    """Told about each call's copies around running them (a persistent disk tier's manifest,
    :mod:`kvpool.core.persist`)."""

    def before_copy(self, copies: Sequence[BlockCopy]) -> None: ...

    def after_copy(self, copies: Sequence[BlockCopy]) -> None: ...


class RemoteObserver(Protocol):
    """Told which blocks leave the local tiers or are committed, and when the call's copies
    are about to run (the shared remote tier's write-behind, :mod:`kvpool.core.remote_hooks`)."""

    def dropped(self, t: int, g: int, slot: int, run: Run, i: int) -> None: ...

    def stored(self, seq: Seq, start: int, upto: int) -> None: ...

    def before_copies(self) -> None: ...


def _unrepaired(state: CacheState, failed: list[BlockCopy]) -> list[BlockCopy]:
    """Until the manager sets the allocator's repair: no failed copy is repaired."""
    return failed


class CacheState:
    """The state one manager's calls share (see the module docstring)."""

    __slots__ = (
        "_hashers", "clock", "config", "copies", "copy_failure", "emit", "failed_copies",
        "gpu", "layout", "new_count", "pending_free", "persist", "pools", "remote",
        "repair_copies", "retention_seen", "roots", "sequences", "stats", "storage", "view",
    )

    def __init__(self, config: CacheConfig, storage: Storage, events: EventSink | None) -> None:
        # what a failed copy's blocks become (kvpool.core.allocator.drop_unwritten, set by the
        # manager: the allocator works on this state, so this module cannot import it)
        self.repair_copies: Callable[[CacheState, list[BlockCopy]], list[BlockCopy]] = (
            _unrepaired)
        self.config = config
        self.layout = layout = Layout.of(config)  # the derived layout every module reads
        self.clock: Callable[[], float] = config.clock or time.monotonic
        queues: list[list[EvictionPolicy]] = make_policies(
            config.eviction.policy, config.slots, self.clock,
            offload_gate=config.eviction.offload_gate,
            history_multiple=config.eviction.history_multiple)
        self.pools: list[list[Pool]] = [
            [SlotPool(n, q) for n, q in zip(config.slots[t], queues[t], strict=True)]
            for t in range(layout.tiers)
        ]
        self.gpu = self.pools[0]
        # one tree per reuse scope (LoRA id, cache salt): scopes never share a root, whatever
        # the hash algorithm (v1 and vLLM mix the scope into the first block's key, so their
        # root keys are equal across scopes)
        self.roots: dict[Scope, Run] = {}
        self._hashers: dict[Scope, BlockHasher] = {}  # one unfed hasher per reuse scope
        self.sequences: dict[SeqId, Seq] = {}
        gpu = self.gpu
        self.view = PlanView(config, layout, self.roots, self.sequences, [pool.ref for pool in gpu],
                             [pool.free for pool in gpu], [pool.queue for pool in gpu])
        self.storage = storage
        self.emit = Emitter(config, events, layout.step)
        self.copies = CallCopies()  # the copies of the call in progress
        self.pending_free: list[tuple[int, int, SlotId]] = []  # (tier, group, slot) at call end
        self.new_count = [0] * layout.num_groups  # GPU slots taken per group during the call
        self.retention_seen = False  # has any block had a retention priority set?
        self.copy_failure: str | None = None  # what made a copy fail beyond repair
        self.failed_copies = 0  # copies that failed and whose blocks were dropped instead
        self.stats = CacheStats()
        self.persist: CopyObserver | None = None  # persist hook: set by the manager
        self.remote: RemoteObserver | None = None  # the shared remote tier (kvpool.tiers.remote)

    # ---------------------------------------------------------------- lookups

    def root(self, scope: Scope) -> Run:
        """The root of a reuse scope's tree (created on first use)."""
        root = self.roots.get(scope)
        if root is None:
            root = self.roots[scope] = Run.root(self.layout.num_groups)
        return root

    def hasher(self, seq: Seq) -> BlockHasher:
        """An unfed hasher of the sequence's reuse scope (resume it after some keys)."""
        scope = (seq.lora_id, seq.cache_salt)
        proto = self._hashers.get(scope)
        if proto is None:
            proto = self._hashers[scope] = BlockHasher(
                self.config.hash_algo, self.layout.tpb, lora_id=seq.lora_id,
                cache_salt=seq.cache_salt, root=seq.root_key)
        return proto

    def seq(self, seq_id: SeqId) -> Seq:
        """The sequence ``seq_id``; :class:`UnknownSequenceError` if there is none."""
        try:
            return self.sequences[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def active(self, seq_id: SeqId) -> Seq:
        """The sequence ``seq_id``, which must not be suspended."""
        seq = self.seq(seq_id)
        if seq.suspended:
            raise SequenceStateError(f"sequence {seq_id!r} is suspended; resume it first")
        return seq

    def add_sequence(self, seq: Seq) -> None:
        """An admitted sequence joins the manager."""
        self.sequences[seq.seq_id] = seq

    def drop_sequence(self, seq_id: SeqId) -> None:
        """Sequence ``seq_id`` leaves the manager."""
        del self.sequences[seq_id]

    def free_at_call_end(self, t: int, g: int, slot: SlotId) -> None:
        """Colder slot ``slot`` of (tier t, group g) was onboarded: it becomes free when the
        call ends, once its copy has read it."""
        self.pending_free.append((t, g, slot))

    # ---------------------------------------------------------------- calls and copies

    def begin_call(self) -> None:
        """A mutating call starts: no GPU slot taken yet."""
        self.new_count = [0] * self.layout.num_groups

    def check_storage(self) -> None:
        """Before changing anything in a call that may copy: raise StorageError if the copies
        could not run (the storage closed, a disk file removed or truncated)."""
        if self.copy_failure is not None:
            raise CopiesLostError(
                f"an earlier copy failed ({self.copy_failure}); the blocks it was moving lost "
                "their bytes, so this manager copies nothing more: build a new one"
            )
        check = getattr(self.storage, "check", None)  # a storage written before check() existed
        if check is not None:
            check()

    def read_ahead(self, reads: dict[int, list[SlotId]]) -> None:
        """Before changing anything in a call that will read the disk slots ``reads`` (layer
        group -> slots): read them now, so that a read error refuses the call
        (:class:`StorageError`) instead of failing its copies (a storage without
        ``read_ahead`` reads them with the copies)."""
        stage = getattr(self.storage, "read_ahead", None)
        if stage is not None and reads:
            stage(reads)

    def refuse_copies(self, reason: str) -> None:
        """Bytes were lost beyond repair (``reason``): every later call that may copy raises
        (:meth:`check_storage`)."""
        self.copy_failure = reason

    def finish_call(self) -> None:
        """End of a mutating call: free onboarded colder slots, flush the removed events, and
        move the data of every copy the call made, batched per tier pair (a failed copy:
        :meth:`copy`)."""
        if self.pending_free:
            pools = self.pools
            for t, g, s in self.pending_free:
                pools[t][g].give_one(s)
            self.pending_free.clear()
        if self.emit.pending:  # most calls remove no block (docs/architecture.md §3.10)
            self.emit.flush_removed()
        if self.remote is not None:  # remote tier: snapshot what leaves, before the copies
            self.remote.before_copies()
        copies = self.copies.take()
        if copies:
            disk = self.persist  # persist hook: the manifest follows the disk tier's writes
            if disk is not None:
                disk.before_copy(copies)
            self.copy(copies)
            if disk is not None:
                disk.after_copy(copies)

    def copy(self, copies: list[BlockCopy]) -> None:
        """Run a call's copies. The call checked the storage (and read its disk reads ahead)
        before changing anything, so a failure here is one no check could see coming (a full
        disk, an I/O error, a file truncated during the call). The blocks the failed copies
        were moving to a colder tier leave the cache (:func:`kvpool.core.allocator.drop_unwritten`)
        and the call completes. A failed copy that was bringing a block a sequence uses cannot
        be repaired: the call raises :class:`CopiesLostError` with its bookkeeping done, and every
        later call that may copy raises it too (no block whose bytes were lost is ever served;
        the engine builds a new manager)."""
        try:
            self.storage.copy_blocks(copies)
        except Exception as exc:
            failed = exc.failed if isinstance(exc, CopyFailedError) else copies
            unrepaired = self.repair_copies(self, [BlockCopy(*c) for c in failed])
            if self.emit.pending:
                self.emit.flush_removed()
            if unrepaired:
                self.copy_failure = repr(exc)
                raise CopiesLostError(
                    f"copying {len(unrepaired)} blocks that sequences use failed ({exc!r}) after "
                    "the call's bookkeeping, which stays (those sequences' blocks lost their "
                    "bytes); this manager copies nothing more: build a new one") from exc
            before, self.failed_copies = self.failed_copies, self.failed_copies + len(failed)
            if before.bit_length() < self.failed_copies.bit_length():  # 1, 2, 4, ... times
                log.warning("kvpool: %d block copies failed, their blocks left the cache "
                            "(%d so far): %s", len(failed), self.failed_copies, exc)
