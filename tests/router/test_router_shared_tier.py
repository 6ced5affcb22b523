"""Shared remote tiers in the router: blocks announced on the remote cache level are credited
to every worker configured with the tier, at the shared weight, through the ingest and over
real HTTP (a TensorRT-LLM-style event endpoint polled by the service)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_router_service import FakeTrtllm, config, eventually, get_json, post, run

from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.events.keyed import REMOVED, STORED, KeyedEvent
from kvpool.events.model import (
    REMOTE_CACHE_LEVEL,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvpool.hashing.keys import request_block_hashes
from kvpool.router.config import parse_config
from kvpool.router.index import KvIndex
from kvpool.router.ingest import Ingest
from kvpool.router.scoring import Router
from kvpool.router.service import RouterService
from kvpool.router.shared_tier import SharedTiers

ALGO = "v1_block_key"
TPB = 16
PROMPT = list(range(1000, 1065))  # body of 64 tokens: 4 blocks of 16


def blocks(tokens: list[int], n: int, level: int) -> tuple[StoredBlock, ...]:
    hashes = request_block_hashes(tokens, TPB, ALGO)[:n]
    return tuple(StoredBlock(h, tuple(tokens[i * TPB:(i + 1) * TPB]), level)
                 for i, h in enumerate(hashes))


def stored(eid: int, tokens: list[int], n: int, level: int) -> KVCacheEvent:
    return KVCacheEvent(eid, Stored(None, blocks(tokens, n, level)), 4096, hash_algo=ALGO)


def cluster(*tiers: str | None, **options: Any) -> tuple[KvIndex, Router, Ingest]:
    """Workers w0, w1, ... with the given shared tiers (None: none)."""
    index = KvIndex()
    for i in range(len(tiers)):
        index.add_worker(f"w{i}", hash_algo=ALGO, tokens_per_block=TPB)
    router = Router(index, prediction_ttl_s=0, **options)
    for i, tier in enumerate(tiers):
        if tier is not None:
            router.share_tier(f"w{i}", tier)
    return index, router, Ingest(index, shared=router.shared)


def scores(router: Router, tokens: list[int] = PROMPT) -> dict[str, tuple[float, int, int]]:
    d = router.route(tokens)
    router.request_finished(d.request_id)
    return {c.worker_id: (c.score, c.shared_blocks, sum(c.matched_blocks)) for c in d.candidates}


def test_a_remote_block_counts_for_every_worker_of_its_tier_below_local_tiers() -> None:
    index, router, ingest = cluster("pool", "pool", None, "other")
    ingest.feed("w0", [stored(0, PROMPT, 4, REMOTE_CACHE_LEVEL)])
    assert index.counters.events_malformed == 0
    assert router.shared.blocks("pool") == 4
    s = scores(router)
    prompt = len(PROMPT)
    remote = -(prompt - 0.3 * 64)
    assert s["w0"] == (pytest.approx(remote), 4, 0)  # its own remote blocks: not local
    assert s["w1"] == (pytest.approx(remote), 4, 0)  # another reader of the same tier
    assert s["w2"] == (-prompt, 0, 0)  # no tier
    assert s["w3"] == (-prompt, 0, 0)  # another tier
    # a local copy (disk, 0.5) beats the remote one; the walk counts each block once
    ingest.feed("w1", [stored(0, PROMPT, 2, 2)])
    s = scores(router)
    assert s["w1"] == (pytest.approx(-(prompt - 0.5 * 32 - 0.3 * 32)), 2, 2)
    assert router.route(PROMPT).worker_id == "w1"


def test_trtllm_mode_and_a_zero_weight_give_no_credit() -> None:
    _, router, ingest = cluster("pool", "pool", mode="trtllm")
    ingest.feed("w0", [stored(0, PROMPT, 4, REMOTE_CACHE_LEVEL)])
    d = router.route(PROMPT)
    assert [c.shared_blocks for c in d.candidates] == [0, 0]
    assert [c.matched_tokens for c in d.candidates] == [0, 0]
    _, router, ingest = cluster("pool", "pool", shared_tier_weight=0.0)
    ingest.feed("w0", [stored(0, PROMPT, 4, REMOTE_CACHE_LEVEL)])
    assert {s for s, _, _ in scores(router).values()} == {-len(PROMPT)}


def test_removals_and_moves_of_remote_blocks() -> None:
    index, router, ingest = cluster("pool", "pool")
    keys = [b.block_hash for b in blocks(PROMPT, 4, 0)]
    ingest.feed("w0", [KeyedEvent(0, STORED, [keys[3]], 1, 0, ALGO),  # on w0's host tier
                       stored(1, PROMPT, 4, REMOTE_CACHE_LEVEL)])
    assert index.tiers_of("w0", keys[3]) == (1,)
    # a removal naming no tier is a local eviction: the store keeps the blocks
    ingest.feed("w0", [KVCacheEvent(2, Removed((keys[3],)), 4096, hash_algo=ALGO)])
    assert index.tiers_of("w0", keys[3]) == ()
    assert router.shared.blocks("pool") == 4
    # a removal naming the remote level takes the block out of the tier
    ingest.feed("w0", [KVCacheEvent(3, Removed((keys[3],), (REMOTE_CACHE_LEVEL,)), 4096,
                                    hash_algo=ALGO)])
    assert router.shared.blocks("pool") == 3
    assert scores(router)["w1"][1:] == (3, 0)
    # prefetched back to w0's host tier: local there, still remote for w1
    ingest.feed("w0", [KVCacheEvent(4, Updated(keys[0], EventDiff(REMOTE_CACHE_LEVEL, 1)),
                                    4096, hash_algo=ALGO)])
    assert index.tiers_of("w0", keys[0]) == (1,)
    assert scores(router)["w0"][1:] == (2, 1)
    assert scores(router)["w1"][1:] == (3, 0)
    # written out from the host tier: gone locally, in the tier
    ingest.feed("w0", [KVCacheEvent(5, Updated(keys[0], EventDiff(1, REMOTE_CACHE_LEVEL)),
                                    4096, hash_algo=ALGO)])
    assert index.tiers_of("w0", keys[0]) == ()
    # keyed records (the decoders' fast path) the same way; mixed batches split per block
    ingest.feed("w1", [KeyedEvent(0, STORED, [keys[3]], REMOTE_CACHE_LEVEL, 0, ALGO),
                       KeyedEvent(1, REMOVED, [keys[2]], REMOTE_CACHE_LEVEL, 0, ALGO)])
    assert scores(router)["w1"][1:] == (2, 0)
    mixed = Stored(None, (StoredBlock(keys[0], (), 0), StoredBlock(keys[1], (), 3)))
    ingest.feed("w1", [KVCacheEvent(2, mixed, 4096, hash_algo=ALGO)])
    assert index.tiers_of("w1", keys[0]) == (0,)
    assert index.tiers_of("w1", keys[1]) == ()
    assert index.counters.events_malformed == 0
    assert index.counters.anomalies == 0


def test_a_worker_without_a_tier_is_ignored_and_a_removed_worker_leaves_its_tier() -> None:
    index, router, ingest = cluster(None, "pool")
    ingest.feed("w0", [stored(0, PROMPT, 4, REMOTE_CACHE_LEVEL)])
    assert (router.shared.blocks("pool"), router.shared.ignored_blocks) == (0, 4)
    assert index.counters.events_malformed == 0
    ingest.feed("w1", [stored(0, PROMPT, 4, REMOTE_CACHE_LEVEL)])
    assert router.shared.masks and set(router.shared.masks.values()) == {0b10}
    index.remove_worker("w1")
    assert router.shared.tier_of("w1") is None
    assert router.shared.blocks("pool") == 4  # the store outlives the worker
    assert set(router.shared.masks.values()) == set()
    assert router.shared.masks == {}


def test_a_tier_keeps_its_most_recently_announced_blocks() -> None:
    _, router, ingest = cluster("pool", "pool", shared_tier_blocks=3)
    ingest.feed("w0", [stored(0, PROMPT, 4, REMOTE_CACHE_LEVEL)])
    assert router.shared.blocks("pool") == 3
    assert scores(router)["w1"][1] == 0  # the first block was dropped: no prefix


def test_bad_shared_tier_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="shared_tier_weight"):
        cluster("pool", shared_tier_weight=1.5)
    with pytest.raises(InvalidArgumentError, match="max_blocks"):
        SharedTiers(0)
    with pytest.raises(InvalidArgumentError, match="shared tier name"):
        cluster("")
    with pytest.raises(ConfigError, match=r"workers\[0\]\.shared_tier"):
        parse_config({"workers": [{"id": "a", "kind": "kvpool", "match_by_tokens": True,
                                   "shared_tier": "pool"}]})
    with pytest.raises(ConfigError, match="shared_tier_weight"):
        parse_config({"router": {"shared_tier_weight": 2},
                      "workers": [{"id": "a", "kind": "kvpool"}]})


_OPS = st.lists(
    st.tuples(st.sampled_from(["store", "remove", "join", "leave"]), st.integers(0, 3),
              st.integers(0, 7), st.sampled_from(["a", "b"])),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_masks_are_the_readers_of_the_tiers_holding_each_key(ops: list[Any]) -> None:
    """Property: after any sequence of level-3 stores and removals by any worker and any
    joins and leaves, masks[key] = the slots of the readers of every tier holding key (a
    model of sets), and no key without readers is left in masks."""
    shared = SharedTiers()
    tier_of: dict[int, str] = {}
    held: dict[str, set[int]] = {"a": set(), "b": set()}
    for op, worker, key, tier in ops:
        wid = f"w{worker}"
        if op == "join":
            shared.join(wid, worker, tier)
            tier_of[worker] = tier
        elif op == "leave":
            shared.leave(wid)
            tier_of.pop(worker, None)
        else:
            level = REMOTE_CACHE_LEVEL
            ev = KeyedEvent(0, STORED if op == "store" else REMOVED, [key], level, 0, ALGO)
            out = shared.split(wid, [ev])
            assert out[0].op == STORED and out[0].keys == []  # nothing for the index
            if worker in tier_of:
                (held[tier_of[worker]].add if op == "store"
                 else held[tier_of[worker]].discard)(key)
    expected: dict[int, int] = {}
    for tier, keys in held.items():
        readers = sum(1 << w for w, t in tier_of.items() if t == tier)
        for k in keys:
            if readers:
                expected[k] = expected.get(k, 0) | readers
    assert shared.masks == expected
    assert len(shared) == sum(len(k) for k in held.values())


def test_shared_tier_credit_over_http_through_the_service() -> None:
    """Two TensorRT-LLM-style engines share a tier, a third has none: the first announces a
    prefix on cache level 3 (polled over HTTP); /route credits it to the second."""

    async def main() -> None:
        engines = [FakeTrtllm(algo=ALGO) for _ in range(3)]
        for e in engines:
            await e.start()
        tiers = ["pool", "pool", None]
        svc = RouterService(config(
            [{"id": f"e{i}", "kind": "trtllm", "http_base_url": e.url, "tokens_per_block": TPB,
              **({"shared_tier": t} if t else {})}
             for i, (e, t) in enumerate(zip(engines, tiers, strict=True))],
            router={"prediction_ttl_s": 0, "shared_tier_weight": 0.4},
        ))
        port = await svc.start()
        base = f"http://127.0.0.1:{port}"
        try:
            engines[0].queue += [stored(0, PROMPT, 4, REMOTE_CACHE_LEVEL)]
            engines[1].queue += [stored(0, PROMPT, 1, 0)]  # the first block on its GPU
            async with aiohttp.ClientSession() as s:
                async def announced() -> bool:
                    return svc.router.shared.blocks("pool") == 4 and engines[1].polls > 1

                await eventually(announced)
                status, d = await post(s, f"{base}/route", {"token_ids": PROMPT})
                assert status == 200
                by = {c["worker_id"]: c for c in d["candidates"]}
                assert d["worker_id"] == "e1"
                assert (d["shared_blocks"], d["matched_blocks"]) == (3, [1, 0, 0])
                assert by["e1"]["score"] == pytest.approx(-(65 - 16 - 0.4 * 48))
                assert by["e0"]["score"] == pytest.approx(-(65 - 0.4 * 64))
                assert (by["e2"]["shared_blocks"], by["e2"]["score"]) == (0, -65)
                _, workers = await get_json(s, f"{base}/workers")
                assert all(w["events_malformed"] == 0 for w in workers["workers"])
                async with s.get(f"{base}/metrics") as resp:
                    text = await resp.text()
                assert "kvpool_router_shared_hit_blocks_total 3.0" in text
        finally:
            await svc.stop()
            for e in engines:
                await e.stop()

    run(main())
