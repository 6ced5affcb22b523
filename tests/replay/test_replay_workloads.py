"""Replay workloads: the Mooncake loader's sharing structure and errors, the synthetic workload."""

from __future__ import annotations

import gzip
import json
import random
from array import array
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import InvalidArgumentError, TraceFormatError
from kvpool.replay.workloads import (
    DEFAULT_VOCAB_SIZE,
    Request,
    SyntheticParams,
    Workload,
    builtin_trace,
    generate_synthetic,
    hash_id_block,
    load_mooncake,
    synthetic_workload,
)

CONVERSATION_TRACE = builtin_trace("conversation")


def write_trace(path: Path, records: list[dict[str, object] | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def rec(ts: float, hash_ids: list[int], input_length: int, output_length: int = 5) -> dict[
    str, object
]:
    return {
        "timestamp": ts,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


def toks(*ids: int) -> array[int]:
    return array("I", ids)


def blocks_of(tokens: array[int], tpi: int) -> list[list[int]]:
    return [tokens[i : i + tpi].tolist() for i in range(0, len(tokens), tpi)]


def leading_equal(a: list[object], b: list[object]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def check_sharing(requests: list[Request], tpi: int) -> int:
    """Pairwise: equal leading hash ids <=> equal leading token blocks. Returns shared pairs."""
    shared_pairs = 0
    blocks = [blocks_of(r.tokens, tpi) for r in requests]
    for i, a in enumerate(requests):
        for i2 in range(i + 1, len(requests)):
            b = requests[i2]
            assert a.hash_ids is not None and b.hash_ids is not None
            ba, bb = blocks[i], blocks[i2]
            for j in range(min(len(ba), len(bb))):
                common = min(len(ba[j]), len(bb[j]))
                if a.hash_ids[j] == b.hash_ids[j]:
                    # same id: the shorter (partial) block is a prefix of the longer one
                    assert ba[j][:common] == bb[j][:common]
                elif common >= 4:  # >= 4 random tokens: a chance collision is ~1e-18
                    assert ba[j][:common] != bb[j][:common]
            full_a = [blk for blk in ba if len(blk) == tpi]
            full_b = [blk for blk in bb if len(blk) == tpi]
            k_ids = leading_equal(list(a.hash_ids[: len(full_a)]), list(b.hash_ids[: len(full_b)]))
            k_blocks = leading_equal(list(full_a), list(full_b))
            assert k_ids == k_blocks
            shared_pairs += k_blocks > 0
    return shared_pairs


# --------------------------------------------------------------------------------------------
# Mooncake loader: structure


def test_hand_trace_shares_blocks_exactly_where_hash_ids_agree(tmp_path: Path) -> None:
    tpi = 4
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            rec(0, [0, 1, 2], 12),
            rec(10, [0, 1, 3], 11),
            rec(20, [0, 4], 5),
            rec(30, [5], 3),
            rec(40, [0, 1, 2, 6], 16),
            rec(50, [7, 1, 2], 12),  # same later ids behind a different first id
        ],
    )
    w = load_mooncake(path, tokens_per_hash_id=tpi)
    assert [len(r.tokens) for r in w] == [12, 11, 5, 3, 16, 12]
    assert check_sharing(list(w), tpi) == 6  # the pairs among the four requests led by id 0
    by_id = {r.request_id: r for r in w}
    # exact sharing lengths, read off the tokens
    assert by_id["t:1"].tokens[:8] == by_id["t:2"].tokens[:8]
    assert by_id["t:1"].tokens[8:11] != by_id["t:2"].tokens[8:11]
    assert by_id["t:5"].tokens[:12] == by_id["t:1"].tokens
    # id 1 at position 1 has the same tokens behind id 7 as behind id 0 (blocks are per id)
    assert by_id["t:6"].tokens[4:12] == by_id["t:1"].tokens[4:12]
    assert by_id["t:6"].tokens[:4] != by_id["t:1"].tokens[:4]


def test_partial_last_block_is_a_prefix_of_the_full_block(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "p.jsonl", [rec(0, [3, 9], 6), rec(1, [3, 9], 8)])
    short, full = load_mooncake(path, tokens_per_hash_id=4, seed=7)
    assert short.tokens == full.tokens[:6]
    expected = hash_id_block(3, seed=7, tokens_per_hash_id=4) + hash_id_block(
        9, seed=7, tokens_per_hash_id=4
    )
    assert full.tokens == expected
    assert short.tokens == expected[:6]


@st.composite
def prefix_traces(draw: st.DrawFn) -> tuple[int, list[tuple[list[int], int]]]:
    """Traces whose hash-id lists are paths in a random prefix tree (ids unique per node)."""
    tpi = draw(st.sampled_from([4, 8]))
    children: dict[tuple[int, ...], list[int]] = defaultdict(list)
    next_id = 0
    out: list[tuple[list[int], int]] = []
    for _ in range(draw(st.integers(1, 8))):
        path: list[int] = []
        for _depth in range(draw(st.integers(1, 5))):
            options = children[tuple(path)]
            reuse = draw(st.booleans())
            if options and reuse:
                node = draw(st.sampled_from(options))
            else:
                node = next_id
                next_id += 1
                options.append(node)
            path.append(node)
        n = len(path)
        out.append((path, draw(st.integers((n - 1) * tpi + 1, n * tpi))))
    return tpi, out


@given(prefix_traces(), st.integers(0, 2**64 - 1))
def test_random_prefix_traces_share_blocks_iff_ids_agree(
    tmp_path_factory: pytest.TempPathFactory,
    trace: tuple[int, list[tuple[list[int], int]]],
    seed: int,
) -> None:
    tpi, lines = trace
    path = write_trace(
        tmp_path_factory.mktemp("h") / "h.jsonl",
        [rec(i, ids, length) for i, (ids, length) in enumerate(lines)],
    )
    w = load_mooncake(path, tokens_per_hash_id=tpi, seed=seed)
    assert [r.hash_ids for r in w] == [tuple(ids) for ids, _ in lines]
    assert [len(r.tokens) for r in w] == [length for _, length in lines]
    check_sharing(list(w), tpi)


def test_conversation_trace_first_500_lines_follow_the_hash_ids() -> None:
    tpi = 512
    with gzip.open(CONVERSATION_TRACE, "rt") as f:
        raw = [json.loads(next(f)) for _ in range(500)]
    w = load_mooncake(CONVERSATION_TRACE, limit=500)
    assert len(w) == 500
    # the trace is sorted by timestamp, so file order is kept
    assert [r.request_id for r in w] == [f"conversation_trace:{i}" for i in range(1, 501)]
    for r, line in zip(w, raw, strict=True):
        assert r.hash_ids == tuple(line["hash_ids"])
        assert len(r.tokens) == line["input_length"]
        assert r.output_length == line["output_length"]
        assert r.arrival_s == pytest.approx(line["timestamp"] / 1000)
    # every occurrence of an id carries the same block (a prefix of it when partial) ...
    full: dict[int, list[int]] = {}
    partial: list[tuple[int, list[int]]] = []
    for r in w:
        assert r.hash_ids is not None
        for h, blk in zip(r.hash_ids, blocks_of(r.tokens, tpi), strict=True):
            if len(blk) == tpi:
                assert full.setdefault(h, blk) == blk
            else:
                partial.append((h, blk))
    for h, blk in partial:
        if h in full:
            assert full[h][: len(blk)] == blk
    # ... and different ids carry different blocks, so sharing is exactly id equality
    assert len({tuple(b) for b in full.values()}) == len(full)
    rng = random.Random(0)
    sample = rng.sample(list(w), 60)
    assert check_sharing(sample, tpi) > 100  # the trace shares a lot: the check is not vacuous


def test_seed_changes_tokens_but_not_structure(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "s.jsonl", [rec(0, [0, 1], 8), rec(1, [0, 2], 7)])
    a = load_mooncake(path, tokens_per_hash_id=4, seed=1)
    a2 = load_mooncake(path, tokens_per_hash_id=4, seed=1)
    b = load_mooncake(path, tokens_per_hash_id=4, seed=2)
    assert a == a2
    assert a.requests[0].tokens != b.requests[0].tokens
    for w in (a, b):
        assert w.requests[0].tokens[:4] == w.requests[1].tokens[:4]
        assert w.requests[0].tokens[4:7] != w.requests[1].tokens[4:7]


def test_token_ids_lie_in_the_vocabulary(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "v.jsonl", [rec(0, list(range(50)), 50 * 64)])
    small = load_mooncake(path, tokens_per_hash_id=64, vocab_size=100)
    assert max(small.requests[0].tokens) < 100
    assert len(set(small.requests[0].tokens)) == 100  # 3,200 draws cover 100 values
    default = load_mooncake(path, tokens_per_hash_id=64)
    assert max(default.requests[0].tokens) < DEFAULT_VOCAB_SIZE
    assert max(default.requests[0].tokens) > DEFAULT_VOCAB_SIZE // 2


def test_requests_are_sorted_by_arrival_and_ties_keep_file_order(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "o.jsonl",
        [rec(2000, [0], 3), rec(500, [1], 3), rec(2000, [2], 3), rec(1500.5, [3], 3)],
    )
    w = load_mooncake(path, tokens_per_hash_id=4)
    assert [r.request_id for r in w] == ["o:2", "o:4", "o:1", "o:3"]
    assert [r.arrival_s for r in w] == [0.5, 1.5005, 2.0, 2.0]
    assert w.metadata["source"] == "mooncake"
    assert w.metadata["tokens_per_hash_id"] == 4


def test_limit_keeps_the_first_requests_and_reads_no_further(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "l.jsonl", [rec(0, [0], 3), "", rec(1, [1], 2), "this is not json"]
    )
    w = load_mooncake(path, tokens_per_hash_id=4, limit=2)
    assert [r.request_id for r in w] == ["l:1", "l:3"]
    with pytest.raises(TraceFormatError, match="line 4"):
        load_mooncake(path, tokens_per_hash_id=4, limit=3)


# --------------------------------------------------------------------------------------------
# Mooncake loader: errors

GOOD = rec(0, [0, 1], 6)


@pytest.mark.parametrize(
    ("bad_line", "what"),
    [
        ('{"timestamp": 0, "input_length": 5,', "invalid JSON"),
        ("[1, 2, 3]", "object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 2}', "hash_ids"),
        (json.dumps({**GOOD, "input_length": "6"}), "input_length"),
        (json.dumps({**GOOD, "input_length": 6.0}), "input_length"),
        (json.dumps({**GOOD, "output_length": True}), "output_length"),
        (json.dumps({**GOOD, "output_length": -3}), "output_length"),
        (json.dumps({**GOOD, "timestamp": -1}), "timestamp"),
        (json.dumps({**GOOD, "timestamp": "noon"}), "timestamp"),
        (json.dumps({**GOOD, "hash_ids": []}), "hash_ids"),
        (json.dumps({**GOOD, "hash_ids": [0, -1]}), "hash_ids"),
        (json.dumps({**GOOD, "hash_ids": [0, "a"]}), "hash_ids"),
        (json.dumps({**GOOD, "input_length": 9}), "input_length 9"),  # > 2 ids x 4 tokens
        (json.dumps({**GOOD, "input_length": 4}), "input_length 4"),  # second id unused
        (json.dumps({**GOOD, "input_length": 0}), "input_length"),
    ],
)
def test_malformed_line_names_file_line_and_problem(
    tmp_path: Path, bad_line: str, what: str
) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(TraceFormatError) as info:
        load_mooncake(path, tokens_per_hash_id=4)
    msg = str(info.value)
    assert str(path) in msg
    assert "line 3" in msg
    assert what in msg


def test_empty_and_blank_files_are_clear_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    for path in (empty, blank):
        with pytest.raises(TraceFormatError, match="empty") as info:
            load_mooncake(path)
        assert str(path) in str(info.value)


def test_missing_file_and_directory_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="not found") as info:
        load_mooncake(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(info.value)
    with pytest.raises(TraceFormatError, match="not a regular file"):
        load_mooncake(tmp_path)


def test_a_gzipped_trace_loads_as_the_plain_one_and_a_corrupt_one_is_a_clear_error(
    tmp_path: Path,
) -> None:
    records = [rec(0, [0, 1], 600), rec(5, [0, 2], 1000), rec(9, [3], 7)]
    plain = write_trace(tmp_path / "t.jsonl", records)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_mooncake(plain), load_mooncake(packed)
    assert b.name == a.name == "t"
    assert [(r.request_id, r.tokens, r.output_length) for r in b] == [
        (r.request_id, r.tokens, r.output_length) for r in a
    ]
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(TraceFormatError, match="cannot read") as info:
        load_mooncake(bad)
    assert "bad.jsonl.gz" in str(info.value)


def test_builtin_trace_names_the_shipped_conversation_trace_and_only_it() -> None:
    with gzip.open(builtin_trace("conversation"), "rb") as f:
        assert sum(1 for line in f if line.strip()) == 12_031
    w = load_mooncake(builtin_trace("conversation"), limit=20)
    assert len(w) == 20 and w.name == "conversation_trace"
    with pytest.raises(InvalidArgumentError, match="conversation"):
        builtin_trace("chat")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tokens_per_hash_id": 0}, "tokens_per_hash_id"),
        ({"limit": 0}, "limit"),
        ({"seed": -1}, "seed"),
        ({"vocab_size": 2**31 + 1}, "vocab_size"),
    ],
)
def test_bad_loader_arguments_are_rejected(
    tmp_path: Path, kwargs: dict[str, int], name: str
) -> None:
    path = write_trace(tmp_path / "a.jsonl", [GOOD])
    with pytest.raises(InvalidArgumentError, match=name):
        load_mooncake(path, **kwargs)


# --------------------------------------------------------------------------------------------
# Request / Workload invariants


def test_request_converts_and_validates_tokens() -> None:
    r = Request("a", 1, [1, 2, 3], 2)  # type: ignore[arg-type]  # lists are converted
    assert isinstance(r.tokens, array) and r.tokens.typecode == "I"
    assert r.tokens.tolist() == [1, 2, 3]
    assert r.arrival_s == 1.0 and isinstance(r.arrival_s, float)
    with pytest.raises(InvalidArgumentError, match="output_length"):
        Request("a", 0.0, toks(1), 0)
    with pytest.raises(InvalidArgumentError, match="arrival_s"):
        Request("a", -1.0, toks(1), 1)
    with pytest.raises(InvalidArgumentError, match="empty"):
        Request("a", 0.0, toks(), 1)
    with pytest.raises(InvalidArgumentError, match="2\\*\\*31"):
        Request("a", 0.0, array("I", [2**31]), 1)
    with pytest.raises(InvalidArgumentError, match="output_token_ids"):
        Request("a", 0.0, toks(1), 2, output_token_ids=toks(5))


def test_workload_rejects_unsorted_requests_and_duplicate_ids() -> None:
    a = Request("a", 2.0, toks(1), 1)
    b = Request("b", 1.0, toks(1), 1)
    with pytest.raises(InvalidArgumentError, match="sorted"):
        Workload("w", (a, b))
    with pytest.raises(InvalidArgumentError, match="unique"):
        Workload("w", (b, Request("b", 3.0, toks(2), 1)))
    w = Workload("w", (b, a))
    assert len(w) == 2 and w.prompt_tokens == 2 and w.duration_s == 1.0


# --------------------------------------------------------------------------------------------
# synthetic workload


def turns_by_session(w: Workload) -> dict[str, list[Request]]:
    sessions: dict[str, list[Request]] = defaultdict(list)
    for r in w:
        assert r.session_id is not None
        sessions[r.session_id].append(r)
    for turns in sessions.values():
        turns.sort(key=lambda r: int(r.request_id.rsplit("-t", 1)[1]))
    return sessions


def check_synthetic_invariants(w: Workload, p: SyntheticParams) -> None:
    assert len(w) == p.num_requests
    arrivals = [r.arrival_s for r in w]
    assert arrivals == sorted(arrivals)
    for r in w:
        assert 1 <= len(r.tokens) <= p.max_prompt_tokens
        assert r.output_token_ids is not None and len(r.output_token_ids) == r.output_length
        assert max(r.tokens) < p.vocab_size
    for turns in turns_by_session(w).values():
        for t, (prev, cur) in enumerate(pairwise(turns)):
            assert cur.request_id.endswith(f"-t{t + 1}")
            assert prev.output_token_ids is not None
            history = prev.tokens + prev.output_token_ids
            assert cur.tokens[: len(history)] == history
            assert len(cur.tokens) > len(history)
            assert cur.arrival_s >= prev.arrival_s + p.min_think_time_s - 1e-9


def test_synthetic_is_deterministic_per_seed() -> None:
    a = synthetic_workload(seed=3, num_requests=150)
    b = synthetic_workload(seed=3, num_requests=150)
    c = synthetic_workload(seed=4, num_requests=150)
    assert a == b
    assert [r.request_id for r in a] == [r.request_id for r in b]
    assert a.requests[0].tokens != c.requests[0].tokens
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]


def test_synthetic_turns_extend_the_previous_prompt_and_answer() -> None:
    p = SyntheticParams(seed=5, num_requests=300)
    w = generate_synthetic(p)
    check_synthetic_invariants(w, p)
    sessions = turns_by_session(w)
    multi = [t for t in sessions.values() if len(t) >= 3]
    assert len(multi) >= 10  # the prefix checks above ran on real multi-turn conversations


def test_synthetic_conversations_share_system_prompts_and_agent_prefixes() -> None:
    p = SyntheticParams(seed=1, num_requests=400, num_system_prompts=3, num_agent_prefixes=2)
    w = generate_synthetic(p)
    firsts = [t[0] for t in turns_by_session(w).values()]
    chat_heads = {r.tokens[: p.system_prompt_tokens].tobytes() for r in firsts
                  if len(r.tokens) < p.agent_prefix_tokens}
    long_heads = {r.tokens[: p.agent_prefix_tokens].tobytes() for r in firsts
                  if len(r.tokens) > p.agent_prefix_tokens}
    assert len(chat_heads) == p.num_system_prompts
    assert len(long_heads) == p.num_agent_prefixes
    assert len(firsts) > 10 * (p.num_system_prompts + p.num_agent_prefixes)


def test_agent_fraction_selects_the_prefix_kind() -> None:
    base: dict[str, int] = {"seed": 2, "num_requests": 120, "system_prompt_tokens": 300,
            "agent_prefix_tokens": 2000, "user_tokens": 50}
    chat = synthetic_workload(agent_fraction=0.0, **base)
    agent = synthetic_workload(agent_fraction=1.0, **base)
    assert all(len(t[0].tokens) < 2000 for t in turns_by_session(chat).values())
    assert all(len(t[0].tokens) > 2000 for t in turns_by_session(agent).values())


def test_conversation_starts_follow_the_arrival_rate() -> None:
    w = synthetic_workload(seed=9, num_requests=2000, arrival_rate_per_s=10.0)
    starts = sorted(t[0].arrival_s for t in turns_by_session(w).values())
    mean_gap = (starts[-1] - starts[0]) / (len(starts) - 1)
    assert 0.08 < mean_gap < 0.125  # Poisson(10/s): 1/rate = 0.1 s, ~400 gaps


def test_default_synthetic_workload_has_the_documented_size() -> None:
    p = SyntheticParams()
    w = generate_synthetic(p)
    assert len(w) == 2000
    assert w.metadata["source"] == "synthetic"
    assert w.metadata["parameters"] == {f: getattr(p, f) for f in p.__dataclass_fields__}
    lengths = [len(r.tokens) for r in w]
    assert min(lengths) >= p.system_prompt_tokens
    assert max(lengths) <= p.max_prompt_tokens
    assert 2_000 < sum(lengths) / len(lengths) < 5_000


@given(
    seed=st.integers(0, 2**32),
    num_requests=st.integers(1, 40),
    turns=st.integers(1, 5),
    agent_fraction=st.floats(0.0, 1.0),
    max_prompt=st.integers(700, 3000),
)
def test_synthetic_invariants_hold_for_random_params(
    seed: int, num_requests: int, turns: int, agent_fraction: float, max_prompt: int
) -> None:
    p = SyntheticParams(
        seed=seed, num_requests=num_requests, turns_per_conversation=turns,
        agent_turns_per_conversation=turns, agent_fraction=agent_fraction,
        system_prompt_tokens=200, agent_prefix_tokens=500, user_tokens=64,
        output_tokens=32, tool_output_tokens=100, max_prompt_tokens=max_prompt,
    )
    check_synthetic_invariants(generate_synthetic(p), p)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_requests": 0}, "num_requests"),
        ({"agent_fraction": 1.5}, "agent_fraction"),
        ({"arrival_rate_per_s": 0.0}, "arrival_rate_per_s"),
        ({"think_time_s": float("nan")}, "think_time_s"),
        ({"user_tokens": True}, "user_tokens"),
        ({"max_prompt_tokens": 100}, "max_prompt_tokens"),
    ],
)
def test_bad_synthetic_params_are_rejected(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        SyntheticParams(**kwargs)  # type: ignore[arg-type]
