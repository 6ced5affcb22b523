"""A hybrid model's recurrent-state checkpoints through the remote tier (a real redis-server)
and the persistent disk tier (restart recovery): real bytes, bit for bit; keys that never
collide with attention blocks; another state geometry never read as valid; damaged values
and records never served; two-phase admission holding a checkpoint onboarded from these tiers;
events naming the state group (docs/hybrid.md, docs/tiers.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvpool import CacheConfig, EventsConfig, KVCacheManager, RemoteConfig, SequenceRequest
from kvpool.config import DiskConfig, EvictionConfig
from kvpool.core.persist import MANIFEST_NAME
from kvpool.events import REMOTE_CACHE_LEVEL, Stored, Updated
from kvpool.tiers.diskfile import persistent_name
from kvpool.tiers.remote.memory import MemoryStore
from kvpool.tiers.remote.namespace import RemoteNamespace
from kvpool.tiers.storage import GroupGeometry, StateGeometry
from redis_server import RedisServer

TPB = 4
ATTN = GroupGeometry(2, 1, 4, "float32")
STATE = StateGeometry(2, ((3, 2), (2, 4, 4)), "float32")
TOKENS = list(range(1, 20))  # 18 tokens before the last: a checkpoint at 16 (block 3)
QUERY = [*TOKENS[:17], 99]  # shares 17 tokens: resumes at the checkpoint (16)


def _cfg(**kw: Any) -> CacheConfig:
    args: dict[str, Any] = dict(
        tokens_per_block=TPB, gpu_blocks=[32, 6], window_sizes=[None, None], state_groups=[1],
        layer_geometry=[ATTN, STATE], host_blocks=[16, 2], model_id="tiny", device="cpu",
        eviction=EvictionConfig(offload_min_priority=0))
    args.update(kw)
    return CacheConfig(**args)


def _persistent(path: Path, **kw: Any) -> CacheConfig:
    return _cfg(disk_blocks=[32, 4], disk=DiskConfig(path=str(path), persistent=True), **kw)


def _state(m: KVCacheManager, seq: str, value: float) -> list[torch.Tensor]:
    """Write a distinct state into the sequence's running slot; returns its parts."""
    slot = m.block_ids(seq, 1)[0]
    out = []
    for k, part in enumerate(m.tensors(1)):
        part[slot] = torch.arange(part[slot].numel(), dtype=part.dtype).view_as(part[slot]) \
            + value + 100 * k
        out.append(part[slot].clone())
    return out


def _attention(m: KVCacheManager, seq: str, value: float) -> torch.Tensor:
    """Write distinct attention bytes into the sequence's first 4 blocks; returns them."""
    table = m.block_ids(seq, 0)[:4]
    pool = m.tensors(0)
    for b, s in enumerate(table):
        pool[s] = value + b
    return pool[table].clone()


def _save(m: KVCacheManager, seq: str = "a", value: float = 7.0,
          tokens: list[int] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A sequence whose state after 16 tokens is saved as a checkpoint; then removed."""
    m.add_sequence(SequenceRequest(seq, TOKENS if tokens is None else tokens))
    state, attn = _state(m, seq, value), _attention(m, seq, value)
    assert m.save_checkpoint(seq, 16)
    m.remove_sequence(seq)
    return state, attn


def _resumes(m: KVCacheManager, seq: str, state: list[torch.Tensor],
             attn: torch.Tensor | None = None) -> None:
    """The query resumes at 16 tokens from exactly ``state`` (and ``attn``)."""
    r = m.add_sequence(SequenceRequest(seq, QUERY))
    assert r.reused_tokens == 16
    slot = r.block_ids[1][0][0]
    for part, want in zip(m.tensors(1), state, strict=True):
        assert torch.equal(part[slot], want)
    if attn is not None:
        assert torch.equal(m.tensors(0)[r.block_ids[0][0][:4]], attn)
    m.check_invariants()


def _push_out(m: KVCacheManager, rounds: int = 12) -> None:
    """Other prefixes with checkpoints, until the first one left the local tiers."""
    for x in range(rounds):
        seq = f"f{x}"
        m.add_sequence(SequenceRequest(seq, [1000 + 50 * x + i for i in range(30)]))
        m.save_checkpoint(seq, 28)
        m.remove_sequence(seq)


# ----------------------------------------------------------------------------- remote tier


def test_keys_and_namespaces_of_checkpoints() -> None:
    ns = RemoteNamespace.from_config(_cfg(), model="tiny")
    scope = ns.scope()
    key = bytes(range(32))
    assert scope.remote_key(key, 0) != scope.remote_key(key, 1)  # attention and state
    for other in (StateGeometry(2, ((3, 2), (2, 4, 4)), "bfloat16"),
                  StateGeometry(2, ((3, 2), (2, 4, 8)), "float32"),
                  StateGeometry(3, ((3, 2), (2, 4, 4)), "float32")):
        assert RemoteNamespace.from_config(_cfg(layer_geometry=[ATTN, other]),
                                           model="tiny").digest != ns.digest
    # a state group is not an attention group of the same kind
    assert b'"kind":"state"' in ns.description


@pytest.mark.parametrize("mode", ["evict", "store"])
def test_checkpoint_round_trip_through_a_real_server(redis_server: RedisServer,
                                                     mode: str) -> None:
    a = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url, write=mode),
                            events=EventsConfig(buffer_max_size=10_000)))
    state, attn = _save(a)
    if mode == "evict":
        _push_out(a)
        assert a.count_reusable_tokens(QUERY) == 0
    assert a.flush_remote(10)
    a.flush_iteration_events()
    ckpt_remote = [e for e in a.get_latest_events() if isinstance(e.data, Stored)
                   and e.layer_group_id == 1
                   and any(b.cache_level == REMOTE_CACHE_LEVEL for b in e.data.blocks)]
    assert bool(ckpt_remote) == (mode == "evict")  # announced with its state group
    a.close()
    b = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url),
                            events=EventsConfig(buffer_max_size=10_000)))
    assert b.count_reusable_tokens(QUERY) == 0
    assert b.prefetch([SequenceRequest("q", QUERY)]) == [16]
    st = b.remote_stats()
    assert st is not None and st.prefetched_checkpoints == 1 and st.prefetched_blocks == 4
    b.flush_iteration_events()
    host_ckpt = [e for e in b.get_latest_events() if isinstance(e.data, Stored)
                 and e.layer_group_id == 1 and e.data.blocks[0].cache_level == 1]
    assert len(host_ckpt) == 1  # the prefetched checkpoint, on the host tier, group 1
    assert b.plan_batch([SequenceRequest("q", QUERY)]).requests[0].reused_tokens == 16
    _resumes(b, "q", state, attn)
    # already local: nothing more to fetch
    assert b.prefetch([SequenceRequest("r", QUERY)]) == [0]
    b.close()


def test_another_state_geometry_never_reads_the_store(redis_server: RedisServer) -> None:
    a = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url, write="store")))
    _save(a)
    assert a.flush_remote(10)
    a.close()
    other = StateGeometry(2, ((3, 2), (2, 4, 4)), "bfloat16")
    b = KVCacheManager(_cfg(layer_geometry=[ATTN, other],
                            remote=RemoteConfig(url=redis_server.url)))
    assert b.prefetch([SequenceRequest("q", QUERY)]) == [0]
    st = b.remote_stats()
    assert st is not None and st.prefetched_checkpoints == 0 and st.prefetched_blocks == 0
    b.close()


@pytest.mark.parametrize("damage", ["short", "flipped", "foreign"])
def test_a_damaged_remote_checkpoint_is_never_served(redis_server: RedisServer,
                                                      damage: str) -> None:
    a = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url, write="store")))
    _save(a)
    assert a.flush_remote(10)
    a.close()
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(k for k in client.keys("kvp:*") if k.endswith(b":1"))
    assert len(keys) == 1  # the checkpoint: its state group's key
    value = client.get(keys[0])
    assert value is not None
    if damage == "short":
        value = value[:-1]
    elif damage == "flipped":
        value = value[:-1] + bytes([value[-1] ^ 1])
    else:  # an attention block's value moved under the checkpoint's key
        value = client.get(keys[0][:-1] + b"0")
        assert value is not None
    client.set(keys[0], value)
    client.close()
    b = KVCacheManager(_cfg(remote=RemoteConfig(url=redis_server.url)))
    assert b.prefetch([SequenceRequest("q", QUERY)]) == [0]  # attention only: no resume
    st = b.remote_stats()
    assert st is not None and st.prefetched_checkpoints == 0 and st.rejected_values >= 1
    r = b.add_sequence(SequenceRequest("q", QUERY))
    assert r.reused_tokens == 0
    b.check_invariants()
    b.close()


def test_a_prefetched_checkpoint_is_claimed_against_the_same_steps_evictions() -> None:
    """Two-phase admission: request A resumes from a checkpoint prefetched to the host tier
    (its only state slot); request B's running slot in the same batch evicts the GPU's last
    checkpoint, whose offload would take that host slot: A's claim keeps it."""
    store = MemoryStore(1 << 24)
    a = KVCacheManager(_cfg(remote=RemoteConfig(store=store, write="store")))
    state, _ = _save(a)
    assert a.flush_remote(10)
    a.close()
    b = KVCacheManager(_cfg(gpu_blocks=[32, 2], host_blocks=[16, 1],
                            remote=RemoteConfig(store=store)))
    assert b.prefetch([SequenceRequest("q", QUERY)]) == [16]
    other = [500 + i for i in range(10)]
    b.add_sequence(SequenceRequest("o", other))
    _state(b, "o", 3.0)
    assert b.save_checkpoint("o", 8)  # the GPU's second state slot: a queued checkpoint
    b.remove_sequence("o")
    assert b.slot_usage(1, 1)["evictable"] == 1 and b.slot_usage(0, 1)["evictable"] == 1
    res = b.add_sequence_batch([SequenceRequest("q", QUERY),
                                SequenceRequest("c", [900 + i for i in range(9)])])
    assert [r.reused_tokens for r in res] == [16, 0]
    assert b.count_reusable_tokens([*other[:9], 0]) == 0  # "o" was evicted in that step
    slot = res[0].block_ids[1][0][0]
    for part, want in zip(b.tensors(1), state, strict=True):
        assert torch.equal(part[slot], want)
    b.check_invariants()
    b.close()


# ----------------------------------------------------------------------------- persistent disk


def test_close_spills_a_checkpoint_and_a_restart_serves_it(tmp_path: Path) -> None:
    m = KVCacheManager(_persistent(tmp_path))
    state, attn = _save(m)  # on the GPU: close spills it
    m.close()
    m = KVCacheManager(_persistent(tmp_path, events=EventsConfig(buffer_max_size=1000)))
    disk = m.persistent_disk
    assert disk is not None and disk.restored.slots == 5 and disk.restored.blocks == 4
    m.flush_iteration_events()
    stored = [e for e in m.get_latest_events() if isinstance(e.data, Stored)]
    assert {e.layer_group_id for e in stored} == {0, 1}
    assert all(b.cache_level == 2 for e in stored for b in e.data.blocks)
    plan = m.plan_batch([SequenceRequest("q", QUERY)])
    assert plan.requests[0].reused_tokens == 16
    _resumes(m, "q", state, attn)
    m.close()


def test_a_checkpoint_offloaded_to_disk_survives_a_restart(tmp_path: Path) -> None:
    m = KVCacheManager(_persistent(tmp_path, events=EventsConfig(buffer_max_size=10_000)))
    state, attn = _save(m)
    _push_out(m, 8)  # down to the disk tier through the host
    assert m.plan_batch([SequenceRequest("q", QUERY)]).requests[0].claim_tiers[1] == [2]
    m.flush_iteration_events()
    moved = [e for e in m.get_latest_events() if e.layer_group_id == 1
             and isinstance(e.data, Updated) and e.data.cache_level is not None]
    assert moved  # a checkpoint's tier changes name its state group
    m.close()
    m = KVCacheManager(_persistent(tmp_path))
    assert m.plan_batch([SequenceRequest("q", QUERY)]).requests[0].claim_tiers[1] == [2]
    _resumes(m, "q", state, attn)
    m.close()


def test_stale_checkpoint_bytes_are_not_served_after_a_restart(tmp_path: Path) -> None:
    m = KVCacheManager(_persistent(tmp_path))
    _save(m)
    m.close()
    path = tmp_path / persistent_name(1)
    with open(path, "r+b") as f:  # every checkpoint slot of the state group's file
        data = bytearray(f.read())
        for i in range(len(data)):
            data[i] ^= 0x5A
        f.seek(0)
        f.write(data)
    m = KVCacheManager(_persistent(tmp_path))
    disk = m.persistent_disk
    assert disk is not None and disk.restored.stale == 1 and disk.restored.slots == 4
    assert m.add_sequence(SequenceRequest("q", QUERY)).reused_tokens == 0
    m.check_invariants()
    m.close()


def test_a_checkpoint_whose_attention_did_not_come_back_is_dropped(tmp_path: Path) -> None:
    m = KVCacheManager(_persistent(tmp_path))
    _save(m)
    m.close()
    with open(tmp_path / persistent_name(0), "r+b") as f:  # every attention slot stale
        size = os.fstat(f.fileno()).st_size
        f.write(b"\xee" * size)
    m = KVCacheManager(_persistent(tmp_path))
    disk = m.persistent_disk
    assert disk is not None and disk.restored.stale == 4
    assert disk.restored.slots == 0 and disk.restored.orphaned == 1
    assert m.count_reusable_tokens(QUERY) == 0
    assert m.slot_usage(2, 1)["evictable"] == 0  # its slot is free again
    m.check_invariants()
    m.close()


def test_a_short_manifest_never_serves_a_wrong_checkpoint(tmp_path: Path) -> None:
    """The manifest cut at every length (a torn tail): a restart with keep_prefix serves the
    checkpoint bit for bit or not at all."""
    m = KVCacheManager(_persistent(tmp_path))
    state, attn = _save(m)
    m.close()
    manifest = (tmp_path / MANIFEST_NAME).read_bytes()
    files = {n: (tmp_path / n).read_bytes() for n in (persistent_name(0), persistent_name(1))}
    header = 4 + 2 + 4 + len(RemoteNamespace.from_config(_cfg(), model="tiny").description) + 8
    served = cuts = 0
    for cut in [len(manifest), *range(len(manifest) - 1, header - 1, -9)]:
        cuts += 1
        (tmp_path / MANIFEST_NAME).write_bytes(manifest[:cut])
        for n, data in files.items():
            (tmp_path / n).write_bytes(data)
        cfg = _cfg(disk_blocks=[32, 4], disk=DiskConfig(path=str(tmp_path), persistent=True,
                                                         manifest_damaged="keep_prefix"))
        m = KVCacheManager(cfg)
        r = m.add_sequence(SequenceRequest("q", QUERY))
        if r.reused_tokens:
            served += 1
            slot = r.block_ids[1][0][0]
            for part, want in zip(m.tensors(1), state, strict=True):
                assert torch.equal(part[slot], want)
            assert torch.equal(m.tensors(0)[r.block_ids[0][0][:4]], attn)
        m.check_invariants()
        m.close()
    assert 0 < served < cuts  # the whole manifest serves it, a cut one loses it at last


def test_a_restored_disk_checkpoint_is_claimed_against_the_same_steps_evictions(
        tmp_path: Path) -> None:
    """Two-phase admission after a restart: request q resumes from the restored checkpoint
    (the disk tier's only state slot) while the running slots of the step evict the GPU's
    checkpoint to the host, and the host's towards the disk: q's claim keeps its slot."""
    cfg = _cfg(gpu_blocks=[32, 2], host_blocks=[16, 1], disk_blocks=[32, 1],
               disk=DiskConfig(path=str(tmp_path), persistent=True))
    m = KVCacheManager(cfg)
    state, attn = _save(m)
    m.close()
    m = KVCacheManager(cfg)
    assert m.slot_usage(2, 1)["evictable"] == 1
    for x, seq in enumerate(("h", "o")):  # a checkpoint on the host, one on the GPU
        _save(m, seq, 30.0 + x, [600 + 40 * x + i for i in range(20)])
    assert [m.slot_usage(t, 1)["evictable"] for t in range(3)] == [1, 1, 1]
    res = m.add_sequence_batch([SequenceRequest("q", QUERY),
                                SequenceRequest("c", [900 + i for i in range(9)])])
    assert [r.reused_tokens for r in res] == [16, 0]
    slot = res[0].block_ids[1][0][0]
    for part, want in zip(m.tensors(1), state, strict=True):
        assert torch.equal(part[slot], want)
    assert torch.equal(m.tensors(0)[res[0].block_ids[0][0][:4]], attn)
    # o's checkpoint went to the host, pushing h's towards the disk: dropped there
    assert m.count_reusable_tokens([*range(600, 617), 0]) == 0
    assert m.count_reusable_tokens([*range(640, 657), 0]) == 16
    m.check_invariants()
    m.close()
