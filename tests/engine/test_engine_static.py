"""The engine's static-shape decode path (CUDA graphs on CUDA, eager on the CPU) and its step
metadata: bucketing and padding are plain Python, checked here; a padded, masked decode gives
the dense model's logits and greedy tokens; packed prefill attention equals per-chunk; and on
CUDA a step launches without a host sync."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_engine_logits import Pair, llama, tight_pool, tokens  # noqa: E402

from kvpool.engine import Engine, SamplingParams  # noqa: E402
from kvpool.engine import attention as attention_module  # noqa: E402
from kvpool.engine.step_meta import (  # noqa: E402
    GroupGeom,
    SeqWork,
    batch_buckets,
    bucket_for,
    build_step,
    first_key,
    pad_decodes,
    position_rows,
    span_bucket,
)

CUDA = torch.cuda.is_available()


@given(st.integers(1, 300))
def test_batch_buckets_cover_every_batch(max_batch: int) -> None:
    buckets = batch_buckets(max_batch)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_batch
    assert len(buckets) <= 3 + max_batch // 8 + 1
    for n in range(1, max_batch + 1):
        b = bucket_for(n, buckets)
        assert n <= b <= max_batch and b in buckets
        assert b < 2 * n or b - n < 8  # at most 2x or 7 extra decodes


@given(st.integers(1, 5000), st.sampled_from([1, 4, 16, 32]))
def test_span_bucket_bounds_padding(span: int, tpb: int) -> None:
    b = span_bucket(span, tpb)
    assert b >= span and b % tpb == 0
    whole = -(-span // tpb) * tpb
    assert b <= whole * 1.25 + tpb * 2  # ~25 % over whole blocks at most
    assert span_bucket(b, tpb) == b  # a bucket is its own bucket


def naive_rows(table: list[int], geom: GroupGeom, positions: range) -> list[int]:
    return [table[p // geom.tpb] * geom.stride + p % geom.tpb for p in positions]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.sampled_from([None, 5]),
       st.integers(0, 3), st.randoms(use_true_random=False))
def test_padded_decode_metadata(lengths: list[int], window: int | None, extra: int,
                                rng: Any) -> None:
    """Every real decode reads exactly its keys' rows (K then V), the rest repeat its first
    key; padded decodes copy the last real one and write its K/V."""
    geom = GroupGeom(tpb=4, num_layers=3, window=window)
    tables = [rng.sample(range(100), -(-n // 4)) for n in lengths]
    decodes = [SeqWork([position_rows(t, geom)], n - 1, n)
               for t, n in zip(tables, lengths, strict=True)]
    nd = len(decodes)
    longest = max(n - first_key(n - 1, window) for n in lengths)
    span = span_bucket(longest, 4)
    padded = pad_decodes(decodes, nd + extra)
    meta = build_step([geom], padded, [], [7] * (nd + extra), list(range(nd + extra)),
                      spans=[span], real_decodes=nd)
    rows = meta.get("drows0").reshape(nd + extra, 2, span)
    lens = meta.get("dlens0")
    writes = meta.get("write0")
    assert meta.get("write_src").tolist() == [min(i, nd - 1) for i in range(nd + extra)]
    for i in range(nd + extra):
        j = min(i, nd - 1)
        n, table = lengths[j], tables[j]
        first = first_key(n - 1, window)
        want = naive_rows(table, geom, range(first, n))
        assert lens[i] == len(want)
        assert rows[i, 0, :len(want)].tolist() == want
        assert (rows[i, 0, len(want):] == want[0]).all()
        assert (rows[i, 1] == rows[i, 0] + 4).all()
        assert writes[i] == want[-1]
    assert meta.get("pos").tolist() == [lengths[min(i, nd - 1)] - 1 for i in range(nd + extra)]


def test_prefill_metadata_packs_chunks() -> None:
    geom = GroupGeom(tpb=4, num_layers=2, window=None)
    a, b = [3, 9, 1], [5, 6]
    prefills = [SeqWork([position_rows(a, geom)], 4, 10), SeqWork([position_rows(b, geom)], 0, 7)]
    meta = build_step([geom], [], prefills, list(range(13)), [5, 12])
    krows = naive_rows(a, geom, range(10)) + naive_rows(b, geom, range(7))
    assert meta.get("prows0").tolist() == krows + [r + 4 for r in krows]
    assert meta.get("write0").tolist() == krows[4:10] + krows[10:]
    assert meta.get("kpos0").tolist() == list(range(10)) + list(range(7))
    assert meta.get("qseg").tolist() == [0] * 6 + [1] * 7
    assert meta.chunks == [[(0, 6, 0, 10), (6, 13, 10, 17)]]
    assert meta.get("pos").tolist() == list(range(4, 10)) + list(range(7))
    assert isinstance(meta.data, np.ndarray) and meta.data.dtype == np.int64


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_static_decode_equals_dense(name: str) -> None:
    """Padded, bucketed, masked decode steps (what CUDA graphs replay): the dense logits."""
    pair = Pair(name, {"gpu_blocks": 64}, static_decode=True, max_batch_size=6)
    runner = pair.engine._static
    assert runner is not None
    seen: list[int] = []
    run = runner.run

    def counting(meta: Any, real: int) -> Any:
        seen.append(meta.num_decodes - real)
        return run(meta, real)

    runner.run = counting  # type: ignore[method-assign]
    base = tokens(40, 9)
    pair.run([tokens(41, 5), tokens(42, 13), base, base[:6] + tokens(43, 4), tokens(44, 3)],
             max_tokens=12)
    assert seen and max(seen) > 0  # 5 decodes ran as a batch of 8 (3 padded)


def test_static_decode_through_preemption() -> None:
    gpu, prompts = tight_pool("llama")
    pair = Pair("llama", {"gpu_blocks": gpu, "host_blocks": 64}, max_batch_size=3,
                static_decode=True)
    pair.run(prompts, max_tokens=20)
    assert pair.engine.scheduler.preemptions > 0


@pytest.mark.parametrize("limit", [0.0, float("inf")])
def test_packed_prefill_equals_per_chunk(limit: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of one step in one attention call (block-diagonal mask) or one call each."""
    monkeypatch.setattr(attention_module, "PACK_LIMIT", limit)
    for name in ("llama", "gemma3"):
        pair = Pair(name, {"gpu_blocks": 64})
        base = tokens(50, 10)
        pair.run([base])
        pair.run([base[:8] + tokens(51, 6), tokens(52, 9), base[:5] + tokens(53, 2)])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_step_has_no_host_sync() -> None:
    """On CUDA a step's launch (metadata copy, model, graph replay) never waits for the GPU;
    only reading the sampled tokens back does. The first round captures the graphs (a
    capture synchronizes); the second, same shapes, runs under sync-debug "error"."""
    torch.manual_seed(1234)
    model = llama().float().eval().cuda()
    ref = copy.deepcopy(model)
    engine = Engine(model, cache={"tokens_per_block": 4, "gpu_blocks": 64}, max_batch_size=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.generate([tokens(60, 7), tokens(61, 12)], params)
    forward = engine._forward

    def strict(sched: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine._forward = strict  # type: ignore[method-assign]
    replays = engine._static.replays if engine._static is not None else 0
    outs = engine.generate([tokens(62, 7), tokens(63, 12)], params)
    for out in outs:
        with torch.no_grad():
            dense = ref(torch.tensor([out.prompt_token_ids + out.token_ids]).cuda()).logits[0]
        n = len(out.prompt_token_ids)
        assert dense[n - 1:-1].argmax(-1).tolist() == out.token_ids
    assert engine._static is not None and engine._static.replays > replays
