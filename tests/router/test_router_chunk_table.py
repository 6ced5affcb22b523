"""The compiled chunk table (:mod:`kvpool.router.chunk_table`, numba from the ``jit`` extra)
against the tokenizer and the Python word cache: the same ids for any ASCII text while the
table grows (its slots rehashed, its arena copied), starts again, refuses chunks too long to
keep, and is read and written from several threads; the kernels' refusals; and nothing of it
when the kernels are switched off."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytest.importorskip("numba")  # the jit extra: CI installs it, so this runs there

from test_router_openai import _bpe_tokenizer

from kvpool.hashing import jit
from kvpool.router import chunk_table
from kvpool.router.byte_words import ByteLevelWords
from kvpool.router.chunk_table import MAX_CHUNK_BYTES, ChunkTable

_BPE: dict[str, Any] = {}
_VOCAB = ["the", "router", "routes", "requests", "to", "worker", "cache", "prefix", "12", "!",
          ",", "'s", "x"]


def _backend() -> Any:
    if not _BPE:
        _BPE["tok"] = _bpe_tokenizer().backend_tokenizer
    return _BPE["tok"]


def _ids(text: str) -> list[int]:
    ids: list[int] = _backend().encode(text, add_special_tokens=False).ids
    return ids


def _words(rng: random.Random, n: int, distinct: int) -> str:
    """``n`` space-separated words, drawn from ``distinct`` different ones."""
    return " ".join(rng.choice(_VOCAB) + str(rng.randrange(distinct)) for _ in range(n))


def test_the_kernels_are_used_where_numba_is_installed() -> None:
    """CI installs the jit extra: the compiled path must be the one the router runs, not
    skipped quietly; switched off, the Python path remains."""
    words = ByteLevelWords(_backend().model)
    assert words.compiled
    jit.set_enabled(False)
    try:
        assert ChunkTable.create(_ids, max_chunks=8) is None
        assert not ByteLevelWords(_backend().model).compiled
    finally:
        jit.set_enabled(True)


_ASCII_RUNS = st.lists(st.one_of(
    st.text(alphabet=st.characters(max_codepoint=127), max_size=6),
    st.sampled_from([" the", " router", "routes", "  ", " \t ", "\n", "\r\n ", "\x0b", "'s",
                     "12", " 345", "!!", " .", " ", "x "]),
), max_size=24).map("".join)


@settings(max_examples=80, deadline=None)
@given(texts=st.lists(_ASCII_RUNS, min_size=1, max_size=5), max_words=st.integers(1, 40))
def test_compiled_chunks_encode_as_the_tokenizer(texts: list[str], max_words: int) -> None:
    """Any ASCII text, cold and warm, with tables so small that they start again on the way."""
    backend = _backend()
    compiled = ByteLevelWords(backend.model, max_words=max_words)
    python = ByteLevelWords(backend.model, max_words=max_words, compiled=False)
    assert compiled.compiled and not python.compiled
    for text in [*texts, *texts]:
        expected = _ids(text)
        assert compiled.encode(text) == expected
        assert python.encode(text) == expected
        assert len(compiled) <= max_words


def test_the_table_grows_and_rehashes_and_keeps_every_chunk() -> None:
    """Thousands of distinct chunks: the slots double (rehashed) and the arena is copied
    several times; every text still encodes as the tokenizer does, and the chunks seen are
    found again without being encoded again."""
    rng = random.Random(7)
    texts = [_words(rng, 200, 3000) for _ in range(120)]
    encoded: list[str] = []

    def encode_chunk(chunk: str) -> list[int]:
        encoded.append(chunk)
        return _ids(chunk)

    table = ChunkTable.create(encode_chunk, max_chunks=1 << 16)
    assert table is not None
    slots0, arena0 = len(table._arrays.slots), len(table._arrays.arena)
    for text in texts:
        assert np.frombuffer(table.encode_u32(text) or b"", np.uint32).tolist() == _ids(text)
    assert len(table._arrays.slots) > slots0 and len(table._arrays.arena) > arena0
    assert len(table) == len(set(encoded)) == len(encoded)  # each chunk encoded once
    assert 2 * len(table) <= len(table._arrays.slots)  # never more than half full
    before = len(encoded)
    for text in texts:  # all found now
        assert np.frombuffer(table.encode_u32(text) or b"", np.uint32).tolist() == _ids(text)
    assert len(encoded) == before


def test_a_full_table_starts_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """At its chunk limit, or when its arena would pass its limit, the table starts again
    empty and keeps answering right."""
    rng = random.Random(3)
    table = ChunkTable.create(_ids, max_chunks=50)
    assert table is not None
    for _ in range(20):
        text = _words(rng, 40, 1000)
        assert np.frombuffer(table.encode_u32(text) or b"", np.uint32).tolist() == _ids(text)
        assert len(table) <= 50
    monkeypatch.setattr(chunk_table, "ARENA_MAX_WORDS", 1 << 16)  # the first arena's size
    big = ChunkTable.create(_ids, max_chunks=1 << 20)
    assert big is not None
    for _ in range(30):  # ~6,000 chunks: more than 65,536 words of records
        text = _words(rng, 200, 100_000)
        assert np.frombuffer(big.encode_u32(text) or b"", np.uint32).tolist() == _ids(text)
        assert len(big._arrays.arena) == 1 << 16


def test_a_chunk_too_long_to_keep_is_left_to_python() -> None:
    long_run = "ab" * MAX_CHUNK_BYTES
    table = ChunkTable.create(_ids, max_chunks=64)
    assert table is not None
    assert table.encode_u32(f"the {long_run} router") is None
    assert len(table) <= 2  # what came before it may be kept; the long chunk is not
    words = ByteLevelWords(_backend().model)
    assert words.encode(f"the {long_run} router") == _ids(f"the {long_run} router")


def test_threads_read_and_write_one_small_table() -> None:
    """Four threads encode different texts through one table that keeps starting again and
    growing: every answer is the tokenizer's."""
    words = ByteLevelWords(_backend().model, max_words=300)
    assert words.compiled
    failures: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            text = _words(rng, rng.randrange(1, 80), 400)
            if words.encode(text) != _ids(text):
                failures.append(text)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures and not any(t.is_alive() for t in threads)


def test_the_kernels_refuse_what_they_cannot_hold() -> None:
    import kvpool.router.chunk_kernels as k

    slots = np.zeros(16, dtype=np.uint64)
    arena = np.zeros(8, dtype=np.uint32)
    seed = np.uint64(1)
    ids = np.ones(2, dtype=np.uint32)

    def insert(key: bytes, used: int) -> int:
        return int(k.insert(np.frombuffer(key, np.uint8), ids, slots, arena,
                            arena.view(np.uint8), seed, used))

    assert insert(b"a b", 0) == -2  # two chunks, not one
    assert insert(b"", 0) == -2
    assert insert(b"x" * 40, 0) == -1  # the arena has no room
    used = insert(b" cache", 0)
    assert used == 1 + 2 + 2  # header, six bytes in two words, two ids
    assert insert(b" cache", used) == used  # there already
    out = np.empty(12, dtype=np.uint32)
    misses = np.empty(24, dtype=np.int64)
    text = np.frombuffer(b"cache cache", np.uint8)
    assert k.lookup(text, slots, arena, arena.view(np.uint8), seed, out, misses) == -1
    assert misses[:2].tolist() == [0, 5]  # " cache" is there; "cache" at the start is not
    text = np.frombuffer(b" cache cache", np.uint8)
    assert k.lookup(text, slots, arena, arena.view(np.uint8), seed, out, misses) == 4
    assert out[:4].tolist() == [1, 1, 1, 1]
