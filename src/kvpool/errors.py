"""Typed exceptions. Every error kvpool raises on purpose derives from :class:`KVPoolError`.

Errors are raised before any state changes: a call that raises leaves the object as it was.
"""

from __future__ import annotations

from collections.abc import Mapping


class KVPoolError(Exception):
    """Base class of every kvpool error."""


class InvalidArgumentError(KVPoolError, ValueError):
    """A caller passed a value kvpool cannot accept (the message names it)."""


class InvalidTokenError(InvalidArgumentError):
    """A token id is not an int in [0, 2**31)."""


class UnknownHashAlgorithmError(InvalidArgumentError):
    """A hash algorithm name is not one of :class:`kvpool.hashing.keys.HashAlgo`."""


class UnknownSequenceError(KVPoolError, KeyError):
    """A sequence id is not known to the manager."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown sequence"


class DuplicateSequenceError(InvalidArgumentError):
    """A sequence id is already in use."""


class OutOfBlocksError(KVPoolError):
    """A pool cannot provide the blocks a call needs.

    ``deficit`` maps (tier, layer group) to the number of missing slots.
    """

    def __init__(self, message: str, deficit: Mapping[tuple[int, int], int] | None = None) -> None:
        super().__init__(message)
        self.deficit: dict[tuple[int, int], int] = dict(deficit or {})


class RewindError(InvalidArgumentError):
    """A rewind would drop tokens that were already committed (or more than exist)."""


class SequenceStateError(KVPoolError):
    """A call does not fit the sequence's state (e.g. growing a suspended sequence)."""


class StorageError(KVPoolError):
    """The data plane could not be set up or used (path not writable, too small, bad geometry)."""


class CapacityError(KVPoolError):
    """A memory budget cannot hold the pools a model needs.

    ``deficit`` maps layer group to missing slots; ``min_budget_bytes`` is the smallest budget
    that works, when it can be computed.
    """

    def __init__(
        self,
        message: str,
        deficit: Mapping[int, int] | None = None,
        min_budget_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.deficit: dict[int, int] = dict(deficit or {})
        self.min_budget_bytes = min_budget_bytes


class EventFormatError(KVPoolError):
    """A serialized KV event cannot be decoded."""


class TraceFormatError(KVPoolError):
    """A workload trace line is malformed (the message names the file and line)."""


class ConfigError(InvalidArgumentError):
    """A configuration file or object is invalid."""


class TransportError(KVPoolError):
    """An event transport could not be set up or used (bad endpoint, address in use, closed)."""


class EventStreamError(KVPoolError):
    """An event stream is inconsistent: an event refers to a block its consumer does not hold,
    or stores one it already holds (raised by strict consumers only)."""


class UnknownWorkerError(InvalidArgumentError, KeyError):
    """A worker id is not registered with the router's index."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown worker"


class DuplicateWorkerError(InvalidArgumentError):
    """A worker id is already registered with the router's index."""


class NoWorkerAvailableError(KVPoolError):
    """The router has no healthy worker to send a request to."""


class GeometryError(StorageError, InvalidArgumentError):
    """A storage layout is invalid: a non-positive size, an unknown dtype, a slot table whose
    shape does not match the layer groups."""


class BlockCopyError(StorageError, InvalidArgumentError):
    """A block copy names a tier, layer group or slot that does not exist, or writes one slot
    twice in one batch."""


class ModelLoadError(KVPoolError):
    """A model cannot be loaded: an unknown name, a path that is not a model, a checkpoint
    transformers refuses, or a failed install of the built-in model's package."""


class RemoteTierError(StorageError):
    """The shared remote tier (a Redis- or Valkey-compatible server) cannot be reached, is too
    slow, or refused a command. It is a data-plane failure like any :class:`StorageError`, and
    its own class so that a caller can keep going on its local tiers when only the remote one
    fails; ``retry_in_s`` says how long calls fail fast before the next connection attempt."""

    def __init__(self, message: str, retry_in_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_in_s = retry_in_s


class RemoteWriteRefusedError(RemoteTierError):
    """The remote tier's server is up but refuses writes: out of memory under a
    ``noeviction`` policy (``OOM``), a read-only replica (``READONLY``), an ACL without write
    permission (``NOPERM``), failing snapshots (``MISCONF``) or too few replicas
    (``NOREPLICAS``). Reads go on; ``retry_in_s`` says how long writes are skipped."""


class ManifestError(StorageError):
    """A persistent disk tier's manifest cannot be used: written for another namespace
    (model, geometry, block size or hash algorithm), or damaged. The message says which, and
    that the manifest can be discarded instead."""


class CopiesLostError(StorageError):
    """Copies that brought blocks live sequences use (onto the GPU, or held for a suspended
    sequence) failed after the call's bookkeeping, which cannot be undone: those sequences'
    blocks lost their bytes. The one error a call raises *having changed* the manager (what it
    registered, suspended or resumed stays); the manager then refuses every later call that
    may copy with this error too (build a new manager, re-admit the sequences)."""


class CopyFailedError(StorageError):
    """Some copies of one ``copy_blocks`` call failed while running (a disk full or past its
    file size limit, an I/O error); every other copy of the call completed. ``failed`` holds
    the copies that did not (their destination slots hold unknown bytes), as
    ``(src_tier, src_slot, dst_tier, dst_slot, layer_group)`` tuples."""

    def __init__(self, message: str, failed: tuple[tuple[int, int, int, int, int], ...]) -> None:
        super().__init__(message)
        self.failed = failed


class UnsafePathError(StorageError):
    """A file or directory of a disk tier is not safe to use: a symbolic link or another kind
    of file where kvpool keeps its own, a file of another user, or a ``disk_path`` other users
    can write (the message names the path and the fix)."""


class HttpRequestError(InvalidArgumentError):
    """An HTTP request ``kvpool serve`` or ``kvpool router`` refuses before handling it: a body
    over the size limit (413), one that did not arrive in time (408), or one that is not JSON,
    not valid UTF-8 or nested too deeply (400). ``status`` is the HTTP status it answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
