"""One simulated worker's cache and the cluster's configuration (:mod:`kvpool.replay.cluster`).

:func:`planned_cache` sizes a worker's pools with the planner for a model and byte budgets,
:func:`block_cache` by block counts; :class:`ClusterConfig` is the whole cluster, including
the optional shared remote tier (:func:`shared_store`: one in-process
:class:`~kvpool.tiers.remote.MemoryStore` for every worker, with a server's LRU by bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final

from kvpool.config import CacheConfig
from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import HashAlgo
from kvpool.planner.capacity import ModelSpec, PoolPlan, plan_pools
from kvpool.replay.engine_sim import SchedulerConfig, TimeModel, reference_group
from kvpool.tiers.remote.memory import MemoryStore
from kvpool.validation import check_int, is_int

__all__ = [
    "HASH_ALGO",
    "TRANSPORTS",
    "ClusterConfig",
    "block_cache",
    "check_remote",
    "planned_cache",
    "shared_store",
]

TRANSPORTS: Final = ("inproc", "zmq")
"""How events reach the router: in process, or vLLM msgpack over ZeroMQ on 127.0.0.1."""

HASH_ALGO: Final = HashAlgo.V2_SHA256_64
"""The simulated engines' block hashes (TensorRT-LLM V2 keys, 64-bit event hashes)."""


def planned_cache(
    model: str | ModelSpec,
    *,
    gpu_bytes: int,
    host_bytes: int = 0,
    disk_bytes: int = 0,
    tokens_per_block: int = 32,
    scheduler: SchedulerConfig | None = None,
    max_seq_len: int | None = None,
    partial_reuse: bool = True,
) -> tuple[CacheConfig, PoolPlan]:
    """One worker's cache sized by the planner for a model preset (or spec) and budgets.

    ``max_seq_len`` defaults to the model's; pass the workload's longest request so that the
    planner's longest-sequence floor covers it. Raises what :func:`plan_pools` raises
    (:class:`~kvpool.errors.CapacityError` when the GPU budget is too small).
    """
    spec = ModelSpec.preset(model) if isinstance(model, str) else model
    sched = scheduler or SchedulerConfig()
    plan = plan_pools(
        spec,
        tokens_per_block,
        gpu_bytes,
        host_bytes,
        disk_bytes,
        max_batch_size=sched.max_batch_size,
        max_num_tokens=sched.max_num_tokens,
        max_seq_len=max_seq_len or spec.max_seq_len,
    )
    cfg = CacheConfig.from_plan(
        plan, hash_algo=HASH_ALGO, enable_partial_reuse=partial_reuse
    )
    return cfg, plan


def block_cache(
    gpu_blocks: int,
    *,
    host_blocks: int = 0,
    disk_blocks: int = 0,
    tokens_per_block: int = 32,
    partial_reuse: bool = True,
) -> CacheConfig:
    """One worker's cache given by block counts: one full-attention layer group."""
    return CacheConfig(
        tokens_per_block=tokens_per_block,
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
        disk_blocks=disk_blocks,
        hash_algo=HASH_ALGO,
        enable_partial_reuse=partial_reuse,
        max_seq_len=1 << 20,
    )


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A cluster: ``workers`` identical engines with ``cache`` each, and how they report.

    ``cache`` is one worker's cache (see :func:`planned_cache` and :func:`block_cache`); its
    clock is replaced by the simulated one. ``seed`` seeds the ``random`` policy and the
    generated tokens of requests that carry none. ``description`` says, for reports, how the
    cache was sized.
    """

    cache: CacheConfig
    workers: int = 4
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    time_model: TimeModel = field(default_factory=TimeModel)
    transport: str = "inproc"
    seed: int = 0
    description: dict[str, Any] = field(default_factory=dict)
    coalesce_steps: bool = True
    """Run identical decode-only steps as one (exact; off only to check that it is)."""
    router_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the :class:`~kvpool.router.Router` of the ``cost`` and
    ``approx`` policies (e.g. ``load_weight``), for sensitivity sweeps."""
    remote_bytes: int = 0
    """A shared remote tier of this many bytes for the whole cluster (0: none): one
    in-process :class:`~kvpool.tiers.remote.MemoryStore` with a server's LRU, every worker writing
    the blocks leaving its local tiers and prefetching before admission."""
    remote_block_bytes: tuple[int, ...] = ()
    """Bytes one block of each layer group takes in the shared tier (the planner's
    ``bytes_per_block``); empty: one byte per block (``remote_bytes`` counts blocks)."""

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise InvalidArgumentError(f"cache must be a CacheConfig, got {self.cache!r}")
        check_int("workers", self.workers, 1, 64)
        if self.transport not in TRANSPORTS:
            raise InvalidArgumentError(
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        check_int("seed", self.seed, 0)
        check_remote(self.cache, self.remote_bytes, self.remote_block_bytes)

    @property
    def capacity_blocks(self) -> int:
        """Slots of the reference layer group over every tier and worker (Belady's cache)."""
        g = reference_group(self.cache)
        return self.workers * sum(tier[g] for tier in self.cache.slots)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able summary."""
        c = self.cache
        return {
            "workers": self.workers,
            "transport": self.transport,
            "seed": self.seed,
            "tokens_per_block": c.tokens_per_block,
            "slots_per_worker": [list(t) for t in c.slots],
            "window_sizes": list(c.window_sizes),
            "partial_reuse": c.enable_partial_reuse,
            "capacity_blocks": self.capacity_blocks,
            "scheduler": dataclasses.asdict(self.scheduler),
            "time_model": dataclasses.asdict(self.time_model),
            **({"sizing": self.description} if self.description else {}),
            **({"router_options": dict(self.router_options)} if self.router_options else {}),
            **({"remote_bytes": self.remote_bytes} if self.remote_bytes else {}),
        }



def check_remote(cache: CacheConfig, remote_bytes: int, block_bytes: tuple[int, ...]) -> None:
    """A shared tier's size and per-group block bytes (InvalidArgumentError if bad)."""
    check_int("remote_bytes", remote_bytes, 0)
    if not isinstance(block_bytes, tuple) or (block_bytes and (
            len(block_bytes) != cache.num_groups
            or not all(is_int(b) and b > 0
                       for b in block_bytes))):
        raise InvalidArgumentError(
            f"remote_block_bytes must be () or one int > 0 per layer group "
            f"({cache.num_groups}), got {block_bytes!r}"
        )


def shared_store(cache: CacheConfig, remote_bytes: int,
                 block_bytes: tuple[int, ...]) -> MemoryStore | None:
    """The cluster's shared tier (None when ``remote_bytes`` is 0). The workers' managers
    hold no bytes, so every value is charged the block size it stands for (one byte per
    block without ``block_bytes``): the store holds ``remote_bytes`` of blocks, whatever its
    keys and headers take in this process."""
    if not remote_bytes:
        return None
    sizes = block_bytes or (1,) * cache.num_groups

    def charge(key: bytes, value_length: int) -> int:
        return sizes[int(key.rsplit(b":", 1)[1])]

    return MemoryStore(remote_bytes, charge=charge)
