"""``POST /query`` over real HTTP on 127.0.0.1: each worker's matched prefix per tier in the
shape of Mooncake RFC #1403 as Dynamo's standalone indexer answers it, checked field by field
against docs/router.md; the cumulative tier walk against a brute-force model (hypothesis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_router_service import LOCAL, PROMPT, config, post, run

from kvpool.events.model import REMOTE_CACHE_LEVEL, KVCacheEvent, Stored, StoredBlock
from kvpool.hashing.keys import request_block_hashes
from kvpool.router.query import _runs
from kvpool.router.service import RouterService

TPB = 16
ALGO = "v1_block_key"
TOP_FIELDS = {"scores", "frequencies", "instances", "prompt_tokens"}
INSTANCE_FIELDS = {"longest_matched", "gpu", "dp", "cpu", "disk", "shared"}


def tiered(tokens: list[int], levels: list[int], first_id: int = 0) -> list[KVCacheEvent]:
    """One stored chain of ``tokens``' first blocks, block ``i`` at cache level ``levels[i]``."""
    hashes = request_block_hashes(tokens, TPB, ALGO)
    blocks = tuple(StoredBlock(hashes[i], tuple(tokens[i * TPB:(i + 1) * TPB]), level)
                   for i, level in enumerate(levels))
    return [KVCacheEvent(first_id, Stored(None, blocks), 4096, hash_algo=ALGO)]


def service(**extra: Any) -> RouterService:
    kvpool = {"kind": "kvpool", "tokens_per_block": TPB, "hash_algo": ALGO}
    return RouterService(config([
        {"id": "a", **kvpool}, {"id": "b", **kvpool}, {"id": "c", **kvpool},
        {"id": "d", **kvpool, "shared_tier": "pool"}, {"id": "e", **kvpool, "shared_tier": "pool"},
    ], **extra))


def feed(svc: RouterService, tokens: list[int]) -> None:
    svc.ingest.feed("a", tiered(tokens, [0, 0, 0, 0]))
    svc.ingest.feed("b", tiered(tokens, [0, 0, 1, 2]))
    svc.ingest.feed("c", tiered(tokens, [1, 0, 0]))
    svc.ingest.feed("e", tiered(tokens, [REMOTE_CACHE_LEVEL] * 2))


async def query(base: str, body: object) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        return await post(s, f"{base}/query", body)


def test_query_answers_every_field_per_worker_and_tier() -> None:
    async def main() -> None:
        svc = service()
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            feed(svc, PROMPT)
            status, got = await query(base, {"token_ids": PROMPT, "model_name": "any",
                                             "tenant_id": "default"})
            assert status == 200, got
            assert set(got) == TOP_FIELDS
            assert got["prompt_tokens"] == len(PROMPT)
            expected = {  # tokens: gpu, cpu (device or host), disk (any local), shared
                "a": (64, 64, 64, 64), "b": (32, 48, 64, 64), "c": (0, 48, 48, 48),
                "d": (0, 0, 0, 32), "e": (0, 0, 0, 32),
            }
            assert set(got["instances"]) == set(expected)
            for worker, (gpu, cpu, disk, shared) in expected.items():
                inst = got["instances"][worker]
                assert set(inst) == INSTANCE_FIELDS
                assert inst["gpu"] == gpu
                assert inst["cpu"] == cpu
                assert inst["disk"] == disk
                assert inst["shared"] == shared
                assert inst["dp"] == {"0": gpu}
                assert inst["longest_matched"] == max(gpu, cpu, disk, shared)
                assert got["scores"][worker] == {"0": gpu}
            # blocks 0..3 on the device: a and b hold 0 and 1, a alone 2 and 3
            assert got["frequencies"] == [2, 2, 1, 1]

            # a salted request matches none of the unsalted blocks
            status, salted = await query(base, {"token_ids": PROMPT, "cache_salt": "tenant-1"})
            assert status == 200
            assert all(i["longest_matched"] == 0 for i in salted["instances"].values())
            assert salted["frequencies"] == []

            # a query changes nothing: no request is active, nothing was routed
            assert svc.router.stats.routes_total == 0
            assert all(svc.router.active_requests(w) == 0 for w in "abcde")
        finally:
            await svc.stop()

    run(main())


def test_query_counts_cover_the_prompt_minus_its_last_token() -> None:
    async def main() -> None:
        svc = service()
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            feed(svc, PROMPT)
            # 40 tokens: two whole blocks and a partial one (v1 matches it) over 39 tokens
            status, got = await query(base, {"token_ids": PROMPT[:40]})
            assert status == 200
            assert got["instances"]["a"]["gpu"] == 32
            assert got["prompt_tokens"] == 40
        finally:
            await svc.stop()

    run(main())


def test_bad_queries_are_400s() -> None:
    async def main() -> None:
        svc = service()
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            for body, says in (({"token_ids": PROMPT, "lora_name": "x"}, "lora_name"),
                               ({"token_ids": PROMPT, "prompt": "hi"}, "exactly one"),
                               ({}, "exactly one"), ({"token_ids": []}, "empty"),
                               ({"token_ids": [1, -2]}, ""), ({"token_ids": "abc"}, ""),
                               ([], "")):
                status, err = await query(base, body)
                assert status == 400, body
                assert says in err["error"]
            # text without a tokenizer: none is configured and no kvpool worker serves one
            status, err = await query(base, {"prompt": "hello"})
            assert status == 503 and "tokenizer" in err["error"]
        finally:
            await svc.stop()

    run(main())


def test_text_and_messages_are_queried_by_their_token_ids(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from engine_serve_fixtures import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    text = "The router routes by token ids, " * 3
    chat = [{"role": "system", "content": text}, {"role": "user", "content": "and then?"}]
    text_ids = list(tok.encode(text))
    chat_ids = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])

    async def main() -> None:
        svc = service(tokenizer=str(tmp_path / "tok"))
        base = f"http://{LOCAL}:{await svc.start()}"
        try:
            for body, ids in (({"prompt": text}, text_ids), ({"messages": chat}, chat_ids)):
                n = (len(ids) - 1) // TPB
                svc.ingest.feed("a", tiered(ids, [0] * n, first_id=len(ids)))
                status, got = await query(base, body)
                assert status == 200, got
                assert got["prompt_tokens"] == len(ids)
                assert got["instances"]["a"]["gpu"] == n * TPB
        finally:
            await svc.stop()

    run(main())


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, list[list[set[int]]]]:
    """Slots and, per block, each slot's levels: 0 device, 1 host, 2 disk, 3 shared reader."""
    slots = draw(st.integers(1, 5))
    blocks = draw(st.integers(0, 12))
    layout = [[draw(st.sets(st.integers(0, 3), max_size=4)) for _ in range(slots)]
              for _ in range(blocks)]
    return slots, layout


@given(_layouts())
def test_cumulative_runs_match_a_brute_force_walk(case: tuple[int, list[list[set[int]]]]) -> None:
    slots, layout = case
    stride = 8
    masks: dict[int, int] = {}
    shared: dict[int, int] = {}
    keys = list(range(100, 100 + len(layout)))
    for key, per_slot in zip(keys, layout, strict=True):
        for slot, levels in enumerate(per_slot):
            for tier in levels - {3}:
                masks[key] = masks.get(key, 0) | 1 << (tier * stride + slot)
            if 3 in levels:
                shared[key] = shared.get(key, 0) | 1 << slot
    got = _runs(keys, (1 << slots) - 1, stride, masks, shared)
    for slot in range(slots):
        for level in range(4):  # leading blocks held at some level <= this one
            n = 0
            while n < len(layout) and any(t <= level for t in layout[n][slot]):
                n += 1
            assert got[slot][level] == n
        assert got[slot] == sorted(got[slot])
