"""Property test: random hybrid workloads through a manager with a persistent disk tier and a
remote tier (an in-process store shared across restarts), with restarts (the persistent tier
recovered) and dropped local caches (the remote tier prefetched back). After every step the
invariants of :mod:`test_hybrid_properties` hold (no slot leaked or shared, every checkpoint's
prefix has its full-attention blocks cached) and every admission that resumes a prefix copies
exactly that prefix's state, bit for bit, wherever its checkpoint came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hybrid_properties import Engine, _check

from kvpool.config import CacheConfig, DiskConfig, EvictionConfig, RemoteConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.tiers.remote.memory import MemoryStore
from kvpool.tiers.storage import GroupGeometry, StateGeometry


@st.composite
def configs(draw: st.DrawFn, tmp: Path, store: MemoryStore) -> CacheConfig:
    return CacheConfig(
        tokens_per_block=draw(st.integers(1, 4)),
        gpu_blocks=[draw(st.integers(8, 24)), draw(st.integers(2, 6))],
        window_sizes=[None, None], state_groups=[1],
        checkpoint_policy=draw(st.sampled_from(["marconi", "every_block", "last", "branch"])),
        host_blocks=[draw(st.integers(1, 6)), draw(st.integers(1, 3))],
        disk_blocks=[draw(st.integers(2, 12)), draw(st.integers(1, 4))],
        disk=DiskConfig(path=str(tmp), persistent=True),
        remote=RemoteConfig(store=store, write=draw(st.sampled_from(["evict", "store"]))),
        eviction=EvictionConfig(policy=draw(st.sampled_from(["lru", "s3fifo"])),
                                offload_min_priority=0),
        layer_geometry=[GroupGeometry(1, 1, 2, "float32"), StateGeometry(1, ((2,),), "float32")],
        model_id="prop", device="cpu", max_beam_width=2,
    )


OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "remove", "restart", "drop"]),
                         st.integers(0, 50), st.integers(0, 8)), min_size=1, max_size=20)


class Prefetching:
    """A manager whose ``plan_batch`` (the first thing :class:`Engine` asks before admitting)
    first prefetches the requests from the remote tier; everything else is the manager's."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.m, name)

    def plan_batch(self, requests: list[SequenceRequest]) -> Any:
        self.m.prefetch(requests)
        _check(self.m)
        return self.m.plan_batch(requests)


def _engine(m: KVCacheManager) -> Engine:
    return Engine(Prefetching(m))  # type: ignore[arg-type]


def _restart(e: Engine, cfg: CacheConfig) -> Engine:
    for seq in list(e.tokens):
        e.m.remove_sequence(seq)
    e.m.close()
    m = KVCacheManager(cfg)
    _check(m)
    fresh = _engine(m)
    fresh.next_id = e.next_id
    return fresh


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), ops=OPS)
def test_random_workloads_through_remote_and_persistent_tiers(
        tmp_path_factory: object, data: st.DataObject, ops: list[tuple[str, int, int]]) -> None:
    tmp = tmp_path_factory.mktemp("disk")  # type: ignore[attr-defined]
    store = MemoryStore(1 << 22)
    cfg = data.draw(configs(tmp, store))
    e = _engine(KVCacheManager(cfg))
    try:
        for op, a, b in ops:
            if op == "admit" or (not e.tokens and op == "remove"):
                e.admit(a, b)
            elif op == "remove":
                seq = sorted(e.tokens)[a % len(e.tokens)]
                e.m.remove_sequence(seq)
                del e.tokens[seq]
            elif op == "restart":
                e = _restart(e, cfg)
            else:  # the local tiers lose everything: the remote tier keeps what it was given
                assert e.m.flush_remote(10)
                for seq in list(e.tokens):
                    e.m.remove_sequence(seq)
                e.tokens.clear()
                e.m.clear_cache()
            _check(e.m)
    finally:
        e.m.close()
