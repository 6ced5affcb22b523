"""KvpoolTier against vLLM 0.33's own code: its TieringOffloadingManager through store, cascade,
promotion and load, a differential test against vLLM's example tier, restart, and failures
that fail jobs without ever loading wrong bytes."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ConfigError, ManifestError, StorageError
from vllm_peer import vllm_module
from vllm_tier_helpers import (
    CHUNK,
    base,
    finish,
    key,
    load,
    loaded_ids,
    make_tier,
    payload,
    primary,
    store,
)

manager_mod = vllm_module("vllm.v1.kv_offload.tiering.manager")
region_mod = vllm_module("vllm.v1.kv_offload.cpu.shared_offload_region")
example_mod = vllm_module("vllm.v1.kv_offload.tiering.example.manager")


class Tiering:
    """vLLM's CPU primary tier + TieringOffloadingManager with one KvpoolTier, and the steps
    vLLM's scheduler and GPU worker take around it."""

    def __init__(self, num_chunks: int, **tier_config: Any) -> None:
        region = region_mod.SharedOffloadRegion(
            engine_id=f"kvpool-test-{uuid.uuid4().hex}", num_chunks=num_chunks, rank=None,
            kv_bytes_per_chunk=CHUNK, cpu_page_size=CHUNK)
        self.primary = manager_mod.CPUPrimaryTierOffloadingManager(
            num_chunks=num_chunks, mmap_region=region, enable_events=True)
        view = self.primary.get_kv_memoryview()
        self.pool = np.asarray(view)  # the bytes vLLM's worker reads and writes
        entry = {"type": "KvpoolTier", "module_path": "kvpool.integrations.vllm",
                 "model": "m", **tier_config}
        self.tier = vllm_module("vllm.v1.kv_offload.tiering.factory").SecondaryTierFactory \
            .create_secondary_tier(entry, view, None)
        self.manager = manager_mod.TieringOffloadingManager(self.primary, [self.tier],
                                                            tier_poll_interval_s=0)

    def request(self, name: str) -> Any:
        ctx = base.ReqContext(name)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        """Wait for the tier's I/O, then two scheduler steps end (vLLM polls the tiers once per
        step: the first poll may come before the jobs were submitted)."""
        for _ in range(2):
            self.tier.drain_jobs()
            with self.manager.lock:
                self.manager.on_schedule_end(base.ScheduleEndContext((), ()))

    def gpu_store(self, ctx: Any, ids: list[int]) -> list[bytes]:
        """prepare_store, the GPU->CPU copy, complete_store (which cascades to the tier)."""
        keys = [key(i) for i in ids]
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist(), strict=True):
            self.pool[c] = payload(int.from_bytes(k[:32], "big"))
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
        return list(out.evicted_keys)

    def lookup(self, ctx: Any, ids: list[int]) -> list[Any]:
        with self.manager.lock:
            return [self.manager.lookup(key(i), ctx) for i in ids]

    def gpu_load(self, ctx: Any, ids: list[int]) -> list[np.ndarray]:
        """prepare_load, the CPU->GPU copy (read here), complete_load."""
        keys = [key(i) for i in ids]
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
        chunks = [self.pool[c].copy() for c in spec.chunk_ids.tolist()]
        with self.manager.lock:
            self.manager.complete_load(keys, ctx)
        return chunks

    def finish(self, ctx: Any) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def shutdown(self) -> None:
        del self.pool
        self.manager.shutdown()


def test_store_cascade_promotion_load_through_vllms_tiering_manager(tmp_path: Path) -> None:
    t = Tiering(4, disk_path=str(tmp_path), disk_bytes=16 * CHUNK, enable_kv_events=True)
    try:
        first = t.request("first")
        t.gpu_store(first, [1, 2, 3, 4])
        t.step()  # the cascade to the KvpoolTier finished: its chunks are unpinned
        t.finish(first)
        assert all(key(i) in t.tier.disk for i in (1, 2, 3, 4))
        second = t.request("second")
        evicted = t.gpu_store(second, [5, 6, 7, 8])  # the CPU tier holds 4: 1..4 leave it
        assert sorted(evicted) == [key(i) for i in (1, 2, 3, 4)]
        t.step()
        t.finish(second)
        third = t.request("third")
        assert set(t.lookup(third, [1, 2, 3])) == {base.LookupResult.HIT_PENDING}  # promoting
        t.step()  # submit_load of the promotion, then its completion
        assert t.lookup(third, [1, 2, 3]) == [base.LookupResult.HIT] * 3
        for i, chunk in zip([1, 2, 3], t.gpu_load(third, [1, 2, 3]), strict=True):
            assert np.array_equal(chunk, payload(i))  # bit-exact in the primary pool
        t.finish(third)
        events = list(t.manager.take_events())
        stored = [k for e in events if e.medium is base.Medium.STORAGE and not e.removed
                  for k in e.keys]
        assert sorted(stored) == sorted(key(i) for i in range(1, 9))
        stats = t.manager.get_stats()
        assert stats.reduce()["kvpool:vllm_tier_stored_chunks:('disk',)"] == 8
        info = t.manager.config_info()
        assert info[1]["kvpool_eviction_policy"] == "s3fifo"
    finally:
        t.shutdown()


OPS = st.lists(st.tuples(st.sampled_from(["store", "load", "lookup"]),
                         st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True)),
               max_size=20)


@settings(max_examples=25)
@given(ops=OPS)
def test_lookups_and_job_outcomes_match_vllms_example_tier(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, list[int]]]) -> None:
    pool = primary(8)
    ours = make_tier(pool, disk_path=str(tmp_path_factory.mktemp("d")), disk_bytes=64 * CHUNK)
    theirs = example_mod.ExampleSecondaryTierManager(None, memoryview(pool), "example")
    ctx = base.ReqContext("r")
    try:
        for op, ids in ops:
            keys = [key(i) for i in ids]
            if op == "lookup":
                assert ([ours.lookup(k, ctx) for k in keys]
                        == [theirs.lookup(k, ctx) for k in keys])
                continue
            result = store(ours, pool, ids) if op == "store" else load(ours, pool, ids)
            j = {"store": theirs.submit_store, "load": theirs.submit_load}[op]
            j(vllm_module("vllm.v1.kv_offload.tiering.base").TransferJob(
                result.job_id, keys, np.arange(len(ids), dtype=np.int32), op == "load", ctx))
            (expected,) = theirs.get_finished_jobs()
            assert result.success == expected.success
            if op == "load":
                held = [i for i in ids if theirs.lookup(key(i), ctx) is base.LookupResult.HIT]
                assert loaded_ids(result, ids) == held  # partial success: exactly those held
                for n, i in enumerate(ids):
                    if i in held:
                        assert np.array_equal(pool[n], payload(i))
    finally:
        ours.shutdown()


def test_a_restarted_tier_finds_every_stored_block(tmp_path: Path) -> None:
    pool = primary(8)
    tier = make_tier(pool, disk_path=str(tmp_path), disk_bytes=32 * CHUNK)
    assert store(tier, pool, list(range(8))).success
    tier.shutdown()
    tier.shutdown()  # idempotent
    again = make_tier(pool, disk_path=str(tmp_path), disk_bytes=32 * CHUNK)
    try:
        ctx = base.ReqContext("r")
        assert [again.lookup(key(i), ctx) for i in range(8)] == [base.LookupResult.HIT] * 8
        assert load(again, pool, list(range(8))).success
        assert all(np.array_equal(pool[i], payload(i)) for i in range(8))
    finally:
        again.shutdown()


def _disk_file(tmp_path: Path) -> Path:
    (path,) = tmp_path.glob("kvpool-persistent-g0.kvp")
    return path


def test_damaged_disk_bytes_fail_their_key_and_the_tier_goes_on(tmp_path: Path) -> None:
    pool = primary(8)
    tier = make_tier(pool, disk_path=str(tmp_path), disk_bytes=32 * CHUNK)
    try:
        assert store(tier, pool, [1, 2, 3]).success
        slot = tier.disk.pin(key(2))[0]
        tier.disk.unpin(key(2))
        with open(_disk_file(tmp_path), "r+b") as f:
            f.seek(slot * CHUNK + 7)
            f.write(b"\x00\x01\x02")
        result = load(tier, pool, [1, 2, 3])
        assert not result.success and loaded_ids(result, [1, 2, 3]) == [1, 3]
        assert tier.counters.failures["checksum"] == 1
        ctx = base.ReqContext("r")
        assert tier.lookup(key(2), ctx) is base.LookupResult.MISS  # forgotten
        assert store(tier, pool, [2]).success  # stored again, and served again
        assert load(tier, pool, [2]).success and np.array_equal(pool[0], payload(2))
    finally:
        tier.shutdown()


def test_a_full_disk_fails_the_store_and_the_tier_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = primary(8)
    tier = make_tier(pool, disk_path=str(tmp_path), disk_bytes=32 * CHUNK)
    try:
        real = os.pwrite

        def no_space(fd: int, data: Any, offset: int) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", no_space)
        assert not store(tier, pool, [1, 2]).success
        monkeypatch.setattr(os, "pwrite", real)
        assert tier.counters.failures["disk_error"] == 2
        ctx = base.ReqContext("r")
        assert tier.lookup(key(1), ctx) is base.LookupResult.MISS
        assert not load(tier, pool, [1]).success
        assert store(tier, pool, [1, 2]).success
        assert load(tier, pool, [1, 2]).success
        assert np.array_equal(pool[1], payload(2))
    finally:
        tier.shutdown()


def test_bad_settings_stop_the_tier_before_it_opens_anything(tmp_path: Path) -> None:
    pool = primary(2)
    with pytest.raises(ConfigError, match="disk_bytes"):
        make_tier(pool, disk_path=str(tmp_path), disk_bytes="lots")
    with pytest.raises(ConfigError, match="holds no chunk"):
        make_tier(pool, disk_path=str(tmp_path), disk_bytes=CHUNK - 1)
    with pytest.raises(StorageError, match="bytes free"):
        make_tier(pool, disk_path=str(tmp_path), disk_bytes=1 << 62)
    with pytest.raises(ConfigError, match="needs 'model'"):
        vllm_module("vllm.v1.kv_offload.tiering.factory").SecondaryTierFactory \
            .create_secondary_tier({"type": "KvpoolTier", "module_path":
                                    "kvpool.integrations.vllm", "remote_url": "redis://h"},
                                   memoryview(pool), None)
    assert list(tmp_path.iterdir()) == []


def test_a_load_of_keys_it_never_held_fails_without_touching_the_pool(tmp_path: Path) -> None:
    pool = primary(4)
    tier = make_tier(pool, disk_path=str(tmp_path), disk_bytes=8 * CHUNK)
    try:
        pool[:] = 5
        j = vllm_module("vllm_tier_helpers").job([key(9)], [0], load=True)
        tier.submit_load(j)
        (result,) = finish(tier).values()
        assert not result.success and not result.successful_keys
        assert (pool == 5).all()
    finally:
        tier.shutdown()


def test_chunk_ids_outside_the_pool_fail_the_job_not_the_caller(tmp_path: Path) -> None:
    pool = primary(4)
    tier = make_tier(pool, disk_path=str(tmp_path), disk_bytes=8 * CHUNK)
    helpers = vllm_module("vllm_tier_helpers")
    try:
        for load_job in (False, True):
            j = helpers.job([key(1), key(2)], [0, 4], load=load_job)
            (tier.submit_load if load_job else tier.submit_store)(j)
            assert not finish(tier)[j.job_id].success
        assert tier.counters.failures["internal"] == 4
    finally:
        tier.shutdown()


def _spec(dtype: str, agnostic: bool = True, tp: int = 1) -> Any:
    vconfig = vllm_module("vllm.v1.kv_offload.config")

    class Spec(base.OffloadingSpec):  # type: ignore[misc]
        def get_manager(self) -> Any:
            raise NotImplementedError

        def get_worker(self, kv_caches: Any) -> Any:
            raise NotImplementedError

    parallel = vconfig.OffloadingParallelConfig(
        rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=agnostic)
    return Spec(vconfig.OffloadingConfig(
        groups=(vconfig.OffloadingGroupConfig(16, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=CHUNK // 4, enable_kv_cache_events=True, extra_config={},
        engine_id="e", model=vconfig.OffloadingModelConfig("org/model", dtype),
        cache=vconfig.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=parallel))


def test_the_namespace_follows_vllms_model_and_kv_layout(tmp_path: Path) -> None:
    factory = vllm_module("vllm.v1.kv_offload.tiering.factory").SecondaryTierFactory
    pool = primary(2)

    def tier(spec: Any, **extra: Any) -> Any:
        return factory.create_secondary_tier(
            {"type": "KvpoolTier", "module_path": "kvpool.integrations.vllm",
             "disk_path": str(tmp_path / "d"), "disk_bytes": 4 * CHUNK, **extra},
            memoryview(pool), spec)

    first = tier(_spec("bfloat16"))
    assert b'"model":"org/model"' in first.namespace.description
    digest = first.namespace.digest
    assert store(first, pool, [1]).success
    first.shutdown()
    same = tier(_spec("bfloat16", tp=2))  # parallelism-agnostic bytes: tp does not matter
    assert same.namespace.digest == digest and key(1) in same.disk
    same.shutdown()
    for other in (_spec("float16"), _spec("bfloat16", agnostic=False, tp=2)):
        with pytest.raises(ManifestError, match="another namespace"):
            tier(other)
    fresh = tier(_spec("bfloat16"), namespace="rev2", disk_manifest_damaged="discard")
    assert fresh.disk.restored.blocks == 0 and fresh.namespace.digest != digest
    fresh.shutdown()
