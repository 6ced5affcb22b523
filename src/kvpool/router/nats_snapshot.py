"""A router replica's index as one object in NATS's object store, and the index's digest.

A snapshot holds what the replica's index and ingest know (every worker's blocks, reference
counts, reorder ledger and token chain; the event numbering and learned block sizes; the
shared tiers' blocks; each worker's publisher epoch and batch number) and the stream
sequence it was taken at: a replica that loads it and replays the stream from the next
sequence holds what the others hold. It is written with :mod:`pickle` and read back with an
unpickler that builds only the index's own types and plain containers, so an object store
writable by others cannot make the replica run code; a snapshot of another configuration
(other worker ids) is refused and the replica replays the whole stream instead.

:func:`index_digest` is a digest of the index's presence masks (which worker holds which
block on which tier) and each worker's reference counts: replicas that applied the same
events have the same digest.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import xxhash

from kvpool.errors import EventFormatError
from kvpool.router.index import KvIndex
from kvpool.router.ingest import Ingest

__all__ = ["SNAPSHOT_VERSION", "BusState", "dump_snapshot", "index_digest", "load_snapshot"]

SNAPSHOT_VERSION: Final = 1

_ALLOWED: Final = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "dict"), ("builtins", "list"),
    ("builtins", "tuple"), ("builtins", "getattr"), ("collections", "OrderedDict"),
    ("collections", "deque"), ("copyreg", "_reconstructor"), ("builtins", "object"),
    ("kvpool.router.worker", "WorkerState"), ("kvpool.router.worker", "IndexCounters"),
    ("kvpool.router.ledger", "LedgerEntry"), ("kvpool.router.ledger", "EventStream"),
    ("kvpool.hashing.keys", "HashAlgo"), ("kvpool.router.nats_snapshot", "BusState"),
}


@dataclass(slots=True)
class BusState:
    """Where the replica is in the stream, per worker: (publisher epoch, last batch number)."""

    stream_seq: int = 0
    publishers: dict[str, tuple[str, int]] = field(default_factory=dict)


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"snapshot names {module}.{name}: not allowed")
        return super().find_class(module, name)


def dump_snapshot(index: KvIndex, ingest: Ingest, bus: BusState) -> bytes:
    """The replica's state as bytes (blocks the event loop for the pickling: call it there,
    between two batches)."""
    state = {
        "version": SNAPSHOT_VERSION,
        "workers": list(index._workers),
        "masks": index.masks,
        "stride": index._stride,
        "counters": index.counters,
        "states": index._workers,
        "slots": index._slots,
        "next_id": ingest.next_id,
        "block_size": ingest.block_size,
        "shared_masks": ingest.shared.masks,
        "shared_keys": ingest.shared._keys,
        "bus": bus,
    }
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def load_snapshot(data: bytes, index: KvIndex, ingest: Ingest) -> BusState:
    """Replace the index's and ingest's state by the snapshot's; returns where it was taken.

    Raises :class:`~kvpool.errors.EventFormatError` (nothing changed) when the bytes are not a
    snapshot of this configuration."""
    try:
        state = _Restricted(io.BytesIO(data)).load()
    except Exception as exc:
        raise EventFormatError(f"not a router snapshot: {exc}") from None
    if not isinstance(state, dict) or state.get("version") != SNAPSHOT_VERSION:
        raise EventFormatError("not a router snapshot of this version")
    if state["workers"] != list(index._workers):
        raise EventFormatError(
            f"snapshot of workers {state['workers']}, this router has {list(index._workers)}"
        )
    bus = state["bus"]
    if not isinstance(bus, BusState):
        raise EventFormatError("snapshot without its stream position")
    healthy = {wid: w.healthy for wid, w in index._workers.items()}
    index.masks = state["masks"]
    index._stride = state["stride"]
    index.counters = state["counters"]
    index._workers = state["states"]
    index._slots = state["slots"]
    index._groups_cache = None
    for wid, ok in healthy.items():  # health is this replica's view, not the snapshot's
        index._workers[wid].healthy = ok
    ingest.next_id.clear()
    ingest.next_id.update(state["next_id"])
    ingest.block_size.clear()
    ingest.block_size.update(state["block_size"])
    ingest.shared.masks = state["shared_masks"]
    ingest.shared._keys = state["shared_keys"]
    return bus


def index_digest(index: KvIndex) -> str:
    """A digest of which worker holds which block on which tier (hex)."""
    h = xxhash.xxh3_128()
    enc = msgspec.msgpack.encode
    h.update(enc(sorted(index.masks.items())))
    h.update(enc(list(index._workers)))
    return h.hexdigest()
