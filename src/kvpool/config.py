"""Configuration objects: the cache geometry and policies, requests and their retention.

Everything is validated at construction; a bad value raises :class:`InvalidArgumentError`
naming the field and the value.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from kvpool.errors import InvalidArgumentError

# re-exported: the values a configuration names, defined once beside the policies that use them
from kvpool.eviction.policies import EVICTION_POLICIES as EVICTION_POLICIES
from kvpool.eviction.priority import DEFAULT_PRIORITY as DEFAULT_PRIORITY
from kvpool.eviction.priority import MAX_PRIORITY as MAX_PRIORITY
from kvpool.eviction.priority import MIN_PRIORITY as MIN_PRIORITY
from kvpool.eviction.priority import OFFLOAD_GATES as OFFLOAD_GATES
from kvpool.hashing.keys import HashAlgo, hash_algo, tokens_to_u32
from kvpool.validation import check_bool, check_int, check_number, is_int

if TYPE_CHECKING:
    from kvpool.planner.capacity import PoolPlan
    from kvpool.tiers.remote.store import BlockStore
    from kvpool.tiers.storage import LayerGeometry

DEFAULT_MAX_SEQ_LEN = 131_072
DISK_MANIFEST_DAMAGED: tuple[str, ...] = ("refuse", "keep_prefix", "discard")
"""``CacheConfig.disk.manifest_damaged`` values: what a persistent disk tier does with a damaged
or foreign manifest (``kvpool.core.persist``)."""
CHECKPOINT_POLICIES: tuple[str, ...] = ("marconi", "every_block", "interval", "last", "branch")
"""``CacheConfig.checkpoint_policy`` values: which block boundaries of a hybrid model's sequences
get a recurrent-state checkpoint (``kvpool.core.checkpoints``, docs/hybrid.md)."""


def _as_tuple(name: str, value: object) -> tuple[Any, ...]:
    """A sequence field as a tuple (a str, a mapping or a non-iterable is refused)."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a sequence, got {value!r}")
    return tuple(value)


def _check_priority(name: str, value: object) -> int:
    return check_int(name, value, MIN_PRIORITY, MAX_PRIORITY)


def _check_duration(name: str, value: object) -> float | None:
    """None, or a positive finite number of seconds."""
    return None if value is None else check_number(name, value, 0, above=True)


@dataclass(frozen=True, slots=True)
class TokenRangeRetention:
    """Blocks whose first token lies in [start, end) get ``priority``; ``end=None`` = to the end.

    After ``duration_s`` seconds (from when the block became evictable) the priority falls
    back to the default (35).
    """

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        check_int("TokenRangeRetention.start", self.start, 0)
        if self.end is not None:
            check_int("TokenRangeRetention.end", self.end, self.start + 1)
        _check_priority("TokenRangeRetention.priority", self.priority)
        _check_duration("TokenRangeRetention.duration_s", self.duration_s)


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Per-request retention: token ranges for context blocks, a priority for generated ones."""

    ranges: Sequence[TokenRangeRetention] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", _as_tuple("RetentionConfig.ranges", self.ranges))
        for r in self.ranges:
            if not isinstance(r, TokenRangeRetention):
                raise InvalidArgumentError(f"RetentionConfig.ranges holds {r!r}")
        ordered = sorted(self.ranges, key=lambda r: r.start)
        for a, b in itertools.pairwise(ordered):
            if a.end is None or a.end > b.start:
                raise InvalidArgumentError(f"retention ranges overlap: {a} and {b}")
        _check_priority("RetentionConfig.decode_priority", self.decode_priority)
        _check_duration("RetentionConfig.decode_duration_s", self.decode_duration_s)

    def block_priority(self, first_token: int) -> tuple[int, float | None]:
        """(priority, duration) of a context block starting at ``first_token``."""
        for r in self.ranges:
            if r.start <= first_token and (r.end is None or first_token < r.end):
                return r.priority, r.duration_s
        return DEFAULT_PRIORITY, None


@dataclass(slots=True)
class SequenceRequest:
    """One request to admit: its id, prompt tokens and reuse scope.

    ``encoder_tokens`` are required when the cache has cross-attention layer groups.
    """

    seq_id: int | str
    tokens: Sequence[int]
    beam_width: int = 1
    lora_id: int | None = None
    cache_salt: str | None = None
    retention: RetentionConfig | None = None
    encoder_tokens: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if not (is_int(self.seq_id) or isinstance(self.seq_id, str)):
            raise InvalidArgumentError(f"seq_id must be an int or str, got {self.seq_id!r}")
        # validated once, kept as a compact u32 array (a Sequence[int]); slices are memcpys
        self.tokens = tokens_to_u32(self.tokens)
        if not self.tokens:
            raise InvalidArgumentError(f"request {self.seq_id!r} has no tokens")
        check_int("beam_width", self.beam_width, 1)
        if self.lora_id is not None:
            check_int("lora_id", self.lora_id, 0)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidArgumentError(f"cache_salt must be a str, got {self.cache_salt!r}")
        if self.retention is not None and not isinstance(self.retention, RetentionConfig):
            raise InvalidArgumentError(
                f"retention must be a RetentionConfig, got {self.retention!r}"
            )
        if self.encoder_tokens is not None:
            self.encoder_tokens = tokens_to_u32(self.encoder_tokens)
            if not self.encoder_tokens:
                raise InvalidArgumentError(f"request {self.seq_id!r} has empty encoder_tokens")


def _per_group(name: str, value: int | Mapping[int, int] | Sequence[int], groups: int,
               minimum: int) -> tuple[int, ...]:
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(range(groups)))
        if unknown:
            raise InvalidArgumentError(f"{name} names unknown layer groups {unknown}")
        missing = sorted(set(range(groups)) - set(value))
        if missing and minimum > 0:
            raise InvalidArgumentError(f"{name} lacks layer groups {missing}")
        return tuple(check_int(f"{name}[{g}]", value.get(g, 0), minimum) for g in range(groups))
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != groups:
            raise InvalidArgumentError(f"{name} has {len(value)} entries for {groups} layer groups")
        return tuple(check_int(f"{name}[{g}]", v, minimum) for g, v in enumerate(value))
    v = check_int(name, value, minimum)
    return (v,) * groups


_STORE_METHODS = ("get_many", "put_many", "exists_many", "delete_many", "close")


def _one_of(name: str, value: object, choices: Iterable[str]) -> None:
    options = list(choices)
    if not isinstance(value, str) or value not in options:
        raise InvalidArgumentError(f"{name} must be one of {options}, got {value!r}")


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """The disk tier's files (its slots are ``CacheConfig.disk_blocks``).

    ``path`` is the directory of the files when the manager holds real KV (``layer_geometry``).
    ``persistent=True`` keeps the files and a manifest of their blocks in ``path`` when the
    manager ends (killed or closed); a manager started later on the same ``path`` with the
    same namespace (``model_id``, geometry, block size, hash algorithm) finds those blocks
    again (:mod:`kvpool.core.persist`). A damaged or foreign manifest is refused
    (``manifest_damaged="refuse"``: :class:`ManifestError`), cut to its intact records
    (``"keep_prefix"``; a foreign namespace is still refused) or discarded (``"discard"``: an
    empty disk tier). The manifest and the files are fsynced every ``sync_interval_s`` seconds
    of calls (None: only on ``close`` and ``persistent_disk.sync()``); what was written
    survives SIGKILL either way.
    """

    path: str | None = None
    persistent: bool = False
    manifest_damaged: str = "refuse"
    sync_interval_s: float | None = 10.0

    def __post_init__(self) -> None:
        if self.path is not None and not isinstance(self.path, str | os.PathLike):
            raise InvalidArgumentError(f"CacheConfig.disk.path must be a path, got {self.path!r}")
        check_bool("CacheConfig.disk.persistent", self.persistent)
        _one_of("CacheConfig.disk.manifest_damaged", self.manifest_damaged,
                DISK_MANIFEST_DAMAGED)
        _check_duration("CacheConfig.disk.sync_interval_s", self.sync_interval_s)


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The shared remote tier below the local ones (:mod:`kvpool.tiers.remote`,
    ``KVCacheManager.prefetch``): a server's ``url`` (``redis://host:port/db``, ``rediss://``,
    ``unix://``, ``valkey://``, or ``redis+cluster://`` for a cluster) or an in-process
    ``store`` shared by several managers (a :class:`~kvpool.tiers.remote.MemoryStore`), not
    both; neither: no remote tier.

    ``write="evict"``: blocks leaving the last local tier are written; ``"store"``: every
    stored block. ``timeout_s`` bounds each server call; at most ``max_pending_bytes`` wait to
    be written (more are dropped, never blocking the caller).
    """

    url: str | None = None
    store: BlockStore | None = field(default=None, compare=False)
    write: str = "evict"
    timeout_s: float = 2.0
    max_pending_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        from kvpool.tiers.remote.store import split_url
        from kvpool.tiers.remote.writer import REMOTE_WRITE_MODES

        if self.url is not None and self.store is not None:
            raise InvalidArgumentError(
                "give CacheConfig.remote.url or CacheConfig.remote.store, not both"
            )
        if self.url is not None:
            split_url(self.url, "CacheConfig.remote.url")
        if self.store is not None:
            missing = [m for m in _STORE_METHODS if not callable(getattr(self.store, m, None))]
            if missing:
                raise InvalidArgumentError(
                    f"CacheConfig.remote.store {self.store!r:.60} is not a block store "
                    f"(lacks {', '.join(missing)})"
                )
        _one_of("CacheConfig.remote.write", self.write, REMOTE_WRITE_MODES)
        check_number("CacheConfig.remote.timeout_s", self.timeout_s, 0, above=True)
        check_int("CacheConfig.remote.max_pending_bytes", self.max_pending_bytes, 1)


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV cache events: ``buffer_max_size > 0`` turns them on (that many events are kept until
    read); their block hashes are in ``hash_algo`` (None: the cache's ``hash_algo``; it must
    be a projection of the cache's keys)."""

    buffer_max_size: int = 0
    hash_algo: HashAlgo | str | None = None

    def __post_init__(self) -> None:
        check_int("CacheConfig.events.buffer_max_size", self.buffer_max_size, 0)
        if self.hash_algo is not None:
            object.__setattr__(self, "hash_algo", hash_algo(self.hash_algo))


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    """Which block leaves a full tier, and which may go down a tier instead of being dropped.

    ``policy``: ``"2q"`` (default), ``"lru"``, ``"s3fifo"`` or ``"arc"`` (:mod:`kvpool.eviction`;
    README: which to pick). History-keeping policies remember evicted keys up to
    ``history_multiple`` times a layer group's slots (all tiers). ``offload_gate="reused"``:
    only victims the policy saw released more than once may go down a tier (``"all"``: any).
    Blocks whose retention priority is below ``offload_min_priority`` are dropped, never
    offloaded (nor written to the remote tier).
    """

    policy: str = "2q"
    offload_gate: str = "all"
    offload_min_priority: int = DEFAULT_PRIORITY
    history_multiple: float = 4.0

    def __post_init__(self) -> None:
        _one_of("CacheConfig.eviction.policy", self.policy, sorted(EVICTION_POLICIES))
        _one_of("CacheConfig.eviction.offload_gate", self.offload_gate, OFFLOAD_GATES)
        _check_priority("CacheConfig.eviction.offload_min_priority", self.offload_min_priority)
        check_number("CacheConfig.eviction.history_multiple", self.history_multiple, 0, 1024)


_GROUPS: dict[str, type[DiskConfig | RemoteConfig | EventsConfig | EvictionConfig]] = {
    "disk": DiskConfig, "remote": RemoteConfig, "events": EventsConfig, "eviction": EvictionConfig,
}


def _group(name: str, value: object) -> Any:
    """A group field given as a mapping of its fields, as its object (unknown keys refused)."""
    kind = _GROUPS[name]
    if not isinstance(value, Mapping):
        return value
    known = [f.name for f in fields(kind)]
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise InvalidArgumentError(
            f"CacheConfig.{name} has no field {', '.join(map(repr, unknown))} "
            f"(its fields: {', '.join(known)})"
        )
    return kind(**value)


def _windows(window_sizes: Sequence[int | None]) -> tuple[int | None, ...]:
    """``window_sizes`` checked: one entry per layer group, None or a window of >= 1 token."""
    windows = _as_tuple("window_sizes (one entry per layer group: None or a window)",
                        window_sizes)
    if not windows:
        raise InvalidArgumentError("window_sizes needs at least one layer group")
    for g, w in enumerate(windows):
        if w is not None:
            check_int(f"window_sizes[{g}]", w, 1)
    return windows


@dataclass(frozen=True)
class CacheConfig:
    """Geometry and policies of one manager.

    ``window_sizes`` has one entry per layer group: None = full attention, an int = sliding
    window of that many tokens. ``cross_attention_groups`` lists groups keyed by the request's
    encoder tokens. ``state_groups`` lists groups holding a hybrid model's recurrent state (one
    running slot per sequence, checkpoints at the block boundaries ``checkpoint_policy``
    picks; docs/hybrid.md). Slot counts (``gpu_blocks``, ``host_blocks``, ``disk_blocks``) are
    an int (same for every group), a sequence or a mapping layer group -> slots.
    ``layer_geometry`` (one ``GroupGeometry`` or ``StateGeometry`` per layer group) makes the
    manager hold real KV in torch tensors (``disk.path`` for a disk tier).

    The settings of one part are grouped in a frozen object each: ``disk``
    (:class:`DiskConfig`: the disk tier's files, persistence), ``remote``
    (:class:`RemoteConfig`: the shared remote tier), ``events`` (:class:`EventsConfig`: KV
    cache events) and ``eviction`` (:class:`EvictionConfig`: the eviction policy and what may
    be offloaded). Errors name the path of the bad field (``CacheConfig.disk.sync_interval_s
    must be ...``). :meth:`from_mapping` builds a config from plain data (YAML, JSON, options)
    whose groups are mappings.
    """

    tokens_per_block: int
    gpu_blocks: int | Mapping[int, int] | Sequence[int]
    window_sizes: Sequence[int | None] = (None,)
    sink_tokens: int | Sequence[int] = 0
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    max_beam_width: int = 1
    hash_algo: HashAlgo | str = HashAlgo.V2_SHA256
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    cross_attention_groups: Sequence[int] = ()
    # hybrid models: layer groups holding recurrent state (one slot per sequence), and which
    # block boundaries get a checkpoint of it (docs/hybrid.md)
    state_groups: Sequence[int] = ()
    checkpoint_policy: str = "marconi"
    checkpoint_interval_tokens: int = 0
    host_blocks: int | Mapping[int, int] | Sequence[int] = 0
    disk_blocks: int | Mapping[int, int] | Sequence[int] = 0
    # names the model whose KV the pools hold: bytes kept on a persistent disk tier or in the
    # shared remote tier are reused only under the same name (and the same geometry)
    model_id: str = ""
    layer_geometry: Sequence[LayerGeometry] | None = None
    device: str | None = None
    clock: Callable[[], float] | None = field(default=None, compare=False)
    disk: DiskConfig = field(default_factory=DiskConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    # normalised views, filled in __post_init__
    num_groups: int = field(init=False)
    slots: tuple[tuple[int, ...], ...] = field(init=False)
    sinks: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        check_int("tokens_per_block", self.tokens_per_block, 1)
        windows = _windows(self.window_sizes)
        object.__setattr__(self, "window_sizes", windows)
        groups = len(windows)
        object.__setattr__(self, "num_groups", groups)
        gpu = _per_group("gpu_blocks", self.gpu_blocks, groups, 1)
        host = _per_group("host_blocks", self.host_blocks, groups, 0)
        disk = _per_group("disk_blocks", self.disk_blocks, groups, 0)
        slots: list[tuple[int, ...]] = [gpu]
        if any(host) or any(disk):
            slots.append(host)
        if any(disk):
            slots.append(disk)
        object.__setattr__(self, "slots", tuple(slots))
        sinks = _per_group("sink_tokens", self.sink_tokens, groups, 0)
        for g, s in enumerate(sinks):
            if s and windows[g] is None:
                raise InvalidArgumentError(
                    f"sink_tokens[{g}]={s} but layer group {g} is full attention"
                )
        object.__setattr__(self, "sinks", sinks)
        cross = _as_tuple("cross_attention_groups", self.cross_attention_groups)
        for g in cross:
            if not is_int(g) or not 0 <= g < groups:
                raise InvalidArgumentError(f"cross_attention_groups names unknown group {g!r}")
            if windows[g] is not None:
                raise InvalidArgumentError(f"cross-attention group {g} cannot have a window")
        object.__setattr__(self, "cross_attention_groups", cross)
        self._check_state_groups(windows)
        if len(set(cross) | set(self.state_groups)) == groups:
            raise InvalidArgumentError("at least one layer group must be self attention")
        check_int("max_beam_width", self.max_beam_width, 1)
        check_int("max_seq_len", self.max_seq_len, 1)
        for name, kind in _GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise InvalidArgumentError(
                    f"CacheConfig.{name} must be a {kind.__name__}, got {value!r:.80} "
                    "(CacheConfig.from_mapping takes plain mappings)"
                )
        self._normalise_hash_algos()
        if self.layer_geometry is not None:
            from kvpool.tiers.storage import GroupGeometry, StateGeometry

            geoms = _as_tuple("layer_geometry", self.layer_geometry)
            if len(geoms) != groups or not all(
                    isinstance(x, StateGeometry if g in self.state_groups else GroupGeometry)
                    for g, x in enumerate(geoms)):
                raise InvalidArgumentError(
                    f"layer_geometry needs one GroupGeometry per layer group ({groups}), "
                    f"a StateGeometry for each state group, got {self.layer_geometry!r}"
                )
            object.__setattr__(self, "layer_geometry", geoms)
        if self.clock is not None and not callable(self.clock):
            raise InvalidArgumentError(f"clock must be a callable returning seconds, "
                                       f"got {self.clock!r}")
        if any(disk) and self.layer_geometry is not None and self.disk.path is None:
            raise InvalidArgumentError("a disk tier with real storage needs CacheConfig.disk.path")
        if any(disk) and not any(host):
            raise InvalidArgumentError("a disk tier needs a host tier (host_blocks > 0)")
        if not isinstance(self.model_id, str):
            raise InvalidArgumentError(f"model_id must be a str, got {self.model_id!r}")
        if self.disk.persistent and not (any(disk) and self.layer_geometry is not None):
            raise InvalidArgumentError(
                "CacheConfig.disk.persistent needs a disk tier holding real KV "
                "(disk_blocks > 0, layer_geometry and disk.path)"
            )
        for name in ("enable_block_reuse", "enable_partial_reuse"):
            check_bool(name, getattr(self, name))

    def _check_state_groups(self, windows: tuple[int | None, ...]) -> None:
        """``state_groups`` and the checkpoint policy (docs/hybrid.md)."""
        state = _as_tuple("state_groups", self.state_groups)
        for g in state:
            if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(windows):
                raise InvalidArgumentError(f"state_groups names unknown group {g!r}")
            if windows[g] is not None or g in self.cross_attention_groups:
                raise InvalidArgumentError(
                    f"state group {g} cannot have a window or be cross attention")
        if len(set(state)) != len(state):
            raise InvalidArgumentError(f"state_groups names a group twice: {list(state)}")
        object.__setattr__(self, "state_groups", state)
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise InvalidArgumentError(
                f"checkpoint_policy must be one of {list(CHECKPOINT_POLICIES)}, "
                f"got {self.checkpoint_policy!r}")
        n = check_int("checkpoint_interval_tokens", self.checkpoint_interval_tokens, 0)
        if self.checkpoint_policy == "interval" and (n == 0 or n % self.tokens_per_block):
            raise InvalidArgumentError(
                f"checkpoint_policy 'interval' needs checkpoint_interval_tokens, a positive "
                f"multiple of tokens_per_block ({self.tokens_per_block}), got {n}")

    def _normalise_hash_algos(self) -> None:
        tree_algo = hash_algo(self.hash_algo)
        object.__setattr__(self, "hash_algo", tree_algo)
        given = self.events.hash_algo
        ev = hash_algo(given) if given is not None else tree_algo
        sha_v2 = {HashAlgo.V2_SHA256, HashAlgo.V2_SHA256_64}
        if ev is not tree_algo and not {ev, tree_algo} <= sha_v2:
            raise InvalidArgumentError(
                f"CacheConfig.events.hash_algo {ev.value!r} is not a projection of hash_algo "
                f"{tree_algo.value!r}; events carry the tree's keys (v2_sha256 and "
                "v2_sha256_64 share them)"
            )
        if given is not ev:
            object.__setattr__(self, "events", replace(self.events, hash_algo=ev))

    @property
    def num_tiers(self) -> int:
        return len(self.slots)

    def window_size(self, group: int) -> int:
        """The window a group reports in events: its window, or max_seq_len for full attention."""
        w = self.window_sizes[group]
        return self.max_seq_len if w is None else w

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CacheConfig:
        """A config from plain data (a YAML or JSON document, command-line options): the
        fields by name, each group (``disk``, ``remote``, ``events``, ``eviction``) a mapping
        of its own fields (or its object). An unknown name is refused, naming its path."""
        known = [f.name for f in fields(cls) if f.init]
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise InvalidArgumentError(
                f"CacheConfig has no field {', '.join(map(repr, unknown))}"
            )
        missing = [name for name in ("tokens_per_block", "gpu_blocks") if name not in values]
        if missing:
            raise InvalidArgumentError(f"CacheConfig needs {' and '.join(missing)}")
        kwargs = {k: _group(k, v) if k in _GROUPS else v for k, v in values.items()}
        return cls(**kwargs)

    @classmethod
    def from_plan(cls, plan: PoolPlan, **overrides: Any) -> CacheConfig:
        """A config whose pools are the planner's (``kvpool.planner.capacity.plan_pools``)."""
        kwargs: dict[str, Any] = dict(plan.cache_config_kwargs())
        kwargs.update(overrides)
        return cls(**kwargs)
