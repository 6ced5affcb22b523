"""Router: overlap per worker and tier, the TensorRT-LLM score, the cost mode, predictions."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.errors import (
    InvalidArgumentError,
    InvalidTokenError,
    NoWorkerAvailableError,
    UnknownWorkerError,
)
from kvpool.events.model import KVCacheEvent, Stored, StoredBlock
from kvpool.hashing.keys import request_block_hashes
from kvpool.router.decision import LATENCY_BUCKETS_S, RouterStats
from kvpool.router.index import KvIndex
from kvpool.router.scoring import RouteDecision, Router

TPB = 4
PROMPT = list(range(100, 115))  # 15 tokens: body of 14 = blocks of 4, 4, 4 and a partial 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hold(index: KvIndex, worker: str, tokens: list[int], blocks: dict[int, int], *,
         algo: str = "v1_block_key", tpb: int = TPB, salt: str | None = None) -> None:
    """Make ``worker`` hold block i of ``tokens`` (router hashing) on tier ``blocks[i]``."""
    hashes = request_block_hashes(tokens, tpb, algo, cache_salt=salt)
    for i, tier in blocks.items():
        chunk = tuple(tokens[i * tpb:(i + 1) * tpb])
        parent = hashes[i - 1] if i else None
        data = Stored(parent, (StoredBlock(hashes[i], chunk, tier),))
        index.apply(worker, KVCacheEvent(index.worker_info(worker).events_applied, data, 0,
                                         hash_algo=algo))


def by_worker(decision: RouteDecision) -> dict[str, tuple[float, tuple[int, ...]]]:
    return {c.worker_id: (c.score, c.matched_blocks) for c in decision.candidates}


def make(*workers: str, tpb: int = TPB, **router_args: object) -> tuple[KvIndex, Router]:
    index = KvIndex()
    for w in workers:
        index.add_worker(w, hash_algo="v1_block_key", tokens_per_block=tpb)
    return index, Router(index, **router_args)  # type: ignore[arg-type]


def load_up(router: Router, worker: str, n: int, tokens: int = 100, tag: str = "x") -> None:
    """Give ``worker`` n active requests of ``tokens`` unrelated tokens (others made unhealthy
    meanwhile, so the router has no choice)."""
    index = router.index
    others = [w for w in index.worker_ids if w != worker and index.is_healthy(w)]
    for w in others:
        index.set_healthy(w, False)
    for i in range(n):
        toks = [5000 + 7 * i + j for j in range(tokens)]
        assert router.route(toks, request_id=f"{tag}{worker}{i}").worker_id == worker
    for w in others:
        index.set_healthy(w, True)


# ------------------------------------------------------------------------- TensorRT-LLM mode


def test_trtllm_score_is_the_engines_formula_with_round_robin_ties() -> None:
    """score = matched_tokens / max(total_blocks * tpb, 1) - active / max_batch_size."""
    index, router = make("A", "B", "C", mode="trtllm", max_batch_size=4)
    hold(index, "A", PROMPT, {0: 0, 1: 0})  # 8 of 16 tokens
    hold(index, "B", PROMPT, {0: 0, 1: 0, 2: 0, 3: 0})  # all 4 blocks (partial one too)
    hold(index, "C", PROMPT, {0: 2, 1: 1, 3: 0})  # any tier counts; block 3 is past a miss
    load_up(router, "B", 2)  # two decisions: the round-robin counter is now 2

    first = router.route(PROMPT)
    assert by_worker(first) == {
        "A": (8 / 16, (2, 0, 0)),
        "B": (16 / 16 - 2 / 4, (4, 0, 0)),
        "C": (8 / 16, (0, 1, 1)),
    }
    assert first.worker_id == "C"  # three-way tie at 0.5, counter 2 -> the third
    assert first.total_blocks == 4 and first.matched_tokens == 8

    second = router.route(PROMPT)  # C: 0.5 - 1/4; A and B tie at 0.5, counter 3 -> the second
    assert by_worker(second)["C"][0] == 0.25
    assert second.worker_id == "B"

    third = router.route(PROMPT)  # B: 1 - 3/4
    assert by_worker(third)["B"][0] == 0.25
    assert third.worker_id == "A"


def test_trtllm_ties_alternate_when_nothing_is_cached() -> None:
    _, router = make("A", "B", mode="trtllm")
    picks = []
    for i in range(4):
        d = router.route(PROMPT, request_id=f"r{i}")
        assert [c.score for c in d.candidates] == [0.0, 0.0]
        picks.append(d.worker_id)
        router.request_finished(d.request_id)
    assert picks == ["A", "B", "A", "B"]


def test_trtllm_mode_predicts_nothing_by_default() -> None:
    _, router = make("A", "B", mode="trtllm")
    router.route(PROMPT)
    assert router.predicted_blocks() == 0


# --------------------------------------------------------------------------------- cost mode


def test_cost_mode_prefers_the_most_gpu_resident_prefix_at_equal_load() -> None:
    index, router = make("host", "gpu", "half", "both")
    prompt = list(range(65))  # body of 64 tokens: 16 blocks of 4
    everything = dict.fromkeys(range(16), 0)
    hold(index, "host", prompt, dict.fromkeys(range(16), 1))
    hold(index, "gpu", prompt, everything)
    hold(index, "half", prompt, dict.fromkeys(range(8), 0))
    hold(index, "both", prompt, dict.fromkeys(range(16), 2))
    hold(index, "both", prompt, dict.fromkeys(range(8), 0))  # a block counts at its hottest tier
    d = router.route(prompt)
    # cost = max(65 - sum(weight * matched tokens), 0), no load; weights 1, 0.95, 0.5
    assert by_worker(d) == {
        "host": (pytest.approx(-(65 - 0.95 * 64)), (0, 16, 0)),
        "gpu": (-(65 - 64), (16, 0, 0)),
        "half": (-(65 - 32), (8, 0, 0)),
        "both": (pytest.approx(-(65 - 32 - 0.5 * 32)), (8, 0, 8)),
    }
    assert d.worker_id == "gpu"
    assert d.prefill_tokens == 1


def test_cost_mode_sheds_load_exactly_when_it_outweighs_the_prefix() -> None:
    """A holds the whole prefix (saves 64 of 65 tokens); each active 100-token request there
    costs load_weight * 100 queued prefill = 20 tokens until its prefill is reported done,
    then nothing (equal costs then go to the worker holding less)."""
    prompt = list(range(65))
    for n_active, expected in [(3, "A"), (4, "B")]:
        index, router = make("A", "B", load_weight=0.2, prediction_ttl_s=0)
        hold(index, "A", prompt, dict.fromkeys(range(16), 0))
        load_up(router, "A", n_active)
        d = router.route(prompt, request_id="probe")
        assert by_worker(d)["A"][0] == pytest.approx(-(1 + 20 * n_active))
        assert by_worker(d)["B"][0] == -65
        assert d.worker_id == expected
        router.request_finished("probe")
        for i in range(n_active):
            assert router.prefill_finished(f"xA{i}") is True
            assert router.prefill_finished(f"xA{i}") is False  # once
        assert router.pending_prefill_tokens("A") == 100 * n_active  # still active
        d = router.route(prompt, request_id="after")
        assert by_worker(d)["A"][0] == -1
        assert d.worker_id == "A"


def test_saturated_workers_are_skipped_while_another_has_room() -> None:
    index, router = make("A", "B", max_batch_size=2, load_weight=0.0, prediction_ttl_s=0)
    hold(index, "A", PROMPT, dict.fromkeys(range(4), 0))
    load_up(router, "A", 2)
    d = router.route(PROMPT)
    assert d.worker_id == "B"
    assert [c.saturated for c in d.candidates] == [True, False]
    load_up(router, "B", 1)  # B is now saturated too: the best score wins again
    assert router.route(PROMPT).worker_id == "A"


def test_ties_go_to_the_less_busy_worker_then_registration_order() -> None:
    _, router = make("A", "B", "C", load_weight=0.0, prediction_ttl_s=0)
    load_up(router, "A", 1)
    assert router.route(PROMPT).worker_id == "B"
    assert router.route(PROMPT).worker_id == "C"


def test_ties_go_to_fewer_unfinished_requests_before_less_kv_held() -> None:
    """A worker with one long request is less busy than one with two short ones (the batch
    slots and the per-step token budget run out first); equal counts go by KV held."""
    _, router = make("A", "B", load_weight=0.0, prediction_ttl_s=0)
    load_up(router, "A", 1, tokens=1000, tag="long")
    load_up(router, "B", 2, tokens=10, tag="short")
    assert router.route(PROMPT).worker_id == "A"  # 1 request of 1,000 tokens against 2 of 10
    assert router.route(list(range(900, 915))).worker_id == "B"  # 2 and 2: B holds less KV


def test_predictions_pull_a_burst_together_until_they_expire() -> None:
    """Predicted blocks live while the request's prefill is pending, then prediction_ttl_s."""
    clock = Clock()
    _, router = make("A", "B", prediction_ttl_s=2.0, load_weight=0.2, clock=clock)
    prompt = list(range(65))
    assert router.route(prompt, request_id="r1").worker_id == "A"  # tie -> the first
    assert router.predicted_blocks() == 16
    # A: 65 - 64 predicted + 0.2 * 65 queued = 14, against B's 65
    d2 = router.route(prompt, request_id="r2")
    assert d2.worker_id == "A"
    assert by_worker(d2)["A"] == (pytest.approx(-14.0), (16, 0, 0))
    clock.now += 60  # a long queue: still predicted, the prefills are pending
    assert router.predicted_blocks() == 16
    router.prefill_finished("r1")
    router.prefill_finished("r2")
    clock.now += 1.5
    assert router.predicted_blocks() == 16
    clock.now += 1.0
    assert router.predicted_blocks() == 0
    # nothing predicted, no prefill queued: A and B both cost 65; B holds less KV
    d3 = router.route(prompt, request_id="r3")
    assert by_worker(d3) == {"A": (-65.0, (0, 0, 0)), "B": (-65.0, (0, 0, 0))}
    assert d3.worker_id == "B"


def test_without_predictions_a_burst_spreads() -> None:
    _, router = make("A", "B", prediction_ttl_s=0.0)
    prompt = list(range(65))
    assert [router.route(prompt).worker_id for _ in range(2)] == ["A", "B"]


def test_temperature_samples_reproducibly_and_zero_is_greedy() -> None:
    prompt = list(range(65))

    def picks(temperature: float, seed: int) -> list[str]:
        index, router = make("A", "B", temperature=temperature, seed=seed, prediction_ttl_s=0)
        hold(index, "A", prompt, dict.fromkeys(range(16), 0))
        out = []
        for _ in range(60):
            d = router.route(prompt)
            out.append(d.worker_id)
            router.request_finished(d.request_id)
        return out

    hot = picks(1.0, seed=7)
    assert hot == picks(1.0, seed=7)
    # p(B) = e^-1 / (1 + e^-1) ~ 0.27 per draw: both appear in 60 draws
    assert set(hot) == {"A", "B"}
    assert set(picks(0.0, seed=7)) == {"A"}


# ------------------------------------------------------------------------ hashing per group


def test_each_worker_is_matched_with_its_own_algorithm_and_block_size() -> None:
    index = KvIndex()
    index.add_worker("v1", hash_algo="v1_block_key", tokens_per_block=16)
    index.add_worker("v2", hash_algo="v2_sha256", tokens_per_block=32)
    index.add_worker("v2_64", hash_algo="v2_sha256_64", tokens_per_block=32)
    index.add_worker("vllm", hash_algo="vllm_sha256_cbor", tokens_per_block=16)
    index.add_worker("bytok", match_by_tokens=True, tokens_per_block=16)
    prompt = list(range(1, 101))  # body of 99 tokens
    hold(index, "v1", prompt, dict.fromkeys(range(7), 0), tpb=16)  # 6 full + partial
    hold(index, "v2", prompt, dict.fromkeys(range(4), 0), algo="v2_sha256", tpb=32)
    hold(index, "v2_64", prompt, dict.fromkeys(range(2), 1), algo="v2_sha256_64", tpb=32)
    hold(index, "vllm", prompt, dict.fromkeys(range(6), 0), algo="vllm_sha256_cbor", tpb=16)
    # A vLLM worker with hashes the router cannot reproduce, matched by the tokens it stored.
    blocks = tuple(StoredBlock(0xDEAD00 + i, tuple(prompt[16 * i:16 * i + 16])) for i in range(5))
    index.apply("bytok", KVCacheEvent(0, Stored(None, blocks), 0, hash_algo="vllm_sha256_cbor"))
    d = Router(index).route(prompt)
    assert {w: m for w, (_, m) in by_worker(d).items()} == {
        "v1": (7, 0, 0),
        "v2": (4, 0, 0),
        "v2_64": (0, 2, 0),
        "vllm": (6, 0, 0),
        "bytok": (5, 0, 0),
    }
    assert {c.worker_id: c.total_blocks for c in d.candidates} == {
        "v1": 7, "v2": 4, "v2_64": 4, "vllm": 6, "bytok": 7,
    }


def test_a_salted_prefix_only_matches_requests_with_the_same_salt() -> None:
    index, router = make("A", "B", prediction_ttl_s=0)
    hold(index, "A", PROMPT, dict.fromkeys(range(4), 0), salt="tenant-1")
    assert by_worker(router.route(PROMPT))["A"][1] == (0, 0, 0)
    assert by_worker(router.route(PROMPT, cache_salt="tenant-2"))["A"][1] == (0, 0, 0)
    assert by_worker(router.route(PROMPT, cache_salt="tenant-1"))["A"][1] == (4, 0, 0)


# ------------------------------------------------------------------ health, load, errors


def test_unhealthy_workers_are_never_chosen() -> None:
    index, router = make("A", "B")
    hold(index, "A", PROMPT, dict.fromkeys(range(4), 0))
    index.set_healthy("A", False)
    d = router.route(PROMPT)
    assert d.worker_id == "B"
    assert [c.worker_id for c in d.candidates] == ["B"]
    index.set_healthy("B", False)
    with pytest.raises(NoWorkerAvailableError):
        router.route(PROMPT, request_id="never")
    index.set_healthy("A", True)
    assert router.route(PROMPT).worker_id == "A"
    assert router.stats.routes_total == 2


def test_finishing_a_request_removes_its_load() -> None:
    _, router = make("A", "B", prediction_ttl_s=0)
    d = router.route(PROMPT, request_id="r1", prefill_tokens=9)
    assert router.active_requests(d.worker_id) == 1
    assert router.pending_prefill_tokens(d.worker_id) == 9
    assert router.request_finished("r1") is True
    assert router.request_finished("r1") is False
    assert router.active_requests(d.worker_id) == 0
    assert router.pending_prefill_tokens(d.worker_id) == 0


def test_requests_never_reported_expire() -> None:
    clock = Clock()
    _, router = make("A", request_timeout_s=10.0, clock=clock)
    router.route(PROMPT)
    clock.now += 11
    router.route(PROMPT)
    assert router.active_requests("A") == 1
    assert router.stats.expired_total == 1


def test_a_request_id_routed_again_expires_from_its_last_routing() -> None:
    clock = Clock()
    _, router = make("A", request_timeout_s=10.0, clock=clock)
    router.route(PROMPT, request_id="r")
    router.request_finished("r")
    for _ in range(3000):  # finished ones pile up behind it, and are dropped in bulk
        router.route(PROMPT)
        router.request_finished(f"auto-{router.stats.routes_total - 1}")
    clock.now += 6
    router.route(PROMPT, request_id="r")
    clock.now += 5  # 11 s after the first routing of "r", 5 s after the second
    router.route(PROMPT)
    assert router.active_requests("A") == 2 and router.stats.expired_total == 0
    clock.now += 6
    router.route(PROMPT)
    assert router.active_requests("A") == 2 and router.stats.expired_total == 1
    assert router.request_finished("r") is False


def test_removing_a_worker_drops_its_load_and_predictions() -> None:
    index, router = make("A", "B")
    router.route(PROMPT, request_id="r")
    index.remove_worker("A")
    assert router.predicted_blocks() == 0
    assert router.request_finished("r") is False
    index.add_worker("C", hash_algo="v1_block_key", tokens_per_block=TPB)  # takes A's slot
    d = router.route(PROMPT)
    assert by_worker(d)["C"] == (-15.0, (0, 0, 0))  # nothing of A's predictions survived


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"token_ids": [1, -1]}, InvalidTokenError),
        ({"token_ids": [1, 2**31]}, InvalidTokenError),
        ({"token_ids": [1, "2"]}, InvalidTokenError),
        ({"token_ids": []}, InvalidArgumentError),
        ({"token_ids": [1, 2], "cache_salt": 5}, InvalidArgumentError),
        ({"token_ids": [1, 2], "request_id": "busy"}, InvalidArgumentError),
        ({"token_ids": [1, 2], "prefill_tokens": -3}, InvalidArgumentError),
    ],
)
def test_bad_requests_raise_typed_errors_and_change_nothing(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    _, router = make("A", "B")
    router.route(PROMPT, request_id="busy")
    predicted = router.predicted_blocks()
    with pytest.raises(error):
        router.route(**kwargs)  # type: ignore[arg-type]
    assert router.stats.routes_total == 1
    assert router.active_requests("A") + router.active_requests("B") == 1
    assert router.predicted_blocks() == predicted


def test_unknown_workers_and_bad_options_raise() -> None:
    index, router = make("A")
    with pytest.raises(UnknownWorkerError, match="'nope'"):
        router.active_requests("nope")
    for bad in [{"mode": "random"}, {"tier_weights": (1.0, 0.5)}, {"temperature": -1},
                {"max_batch_size": 0}, {"load_weight": math.inf}]:
        with pytest.raises(InvalidArgumentError):
            Router(index, **bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ properties


TIER_SETS = st.sets(st.integers(0, 2)).map(sorted)


@given(
    n_workers=st.integers(1, 12),
    tpb=st.sampled_from([1, 2]),
    holdings=st.lists(st.lists(TIER_SETS, max_size=40), min_size=12, max_size=12),
    length=st.integers(1, 40),
)
def test_matched_blocks_equal_a_brute_force_walk(
    n_workers: int, tpb: int, holdings: list[list[list[int]]], length: int
) -> None:
    """Per worker: consecutive blocks held on some tier, each counted at its hottest tier."""
    index, router = make(*[f"w{i}" for i in range(n_workers)], tpb=tpb, prediction_ttl_s=0)
    prompt = list(range(7, 7 + length * tpb + 1))
    hashes = request_block_hashes(prompt, tpb, "v1_block_key")
    for i in range(n_workers):
        for tier in range(3):
            blocks = [b for b, ts in enumerate(holdings[i][: len(hashes)]) if tier in ts]
            hold(index, f"w{i}", prompt, dict.fromkeys(blocks, tier), tpb=tpb)
    d = router.route(prompt)
    for c in d.candidates:
        expected = [0, 0, 0]
        for h in hashes:
            tiers = index.tiers_of(c.worker_id, h)
            if not tiers:
                break
            expected[min(tiers)] += 1
        assert c.matched_blocks == tuple(expected), c.worker_id


def test_more_workers_than_one_mask_word_route_correctly() -> None:
    """Past 64 workers the masks widen (the walk takes its general path)."""
    index, router = make(*[f"w{i}" for i in range(70)], prediction_ttl_s=0)
    prompt = list(range(33))  # 8 blocks of 4
    hold(index, "w69", prompt, dict.fromkeys(range(8), 0))
    hold(index, "w64", prompt, {**dict.fromkeys(range(5), 1), 5: 2})
    hold(index, "w3", prompt, dict.fromkeys(range(3), 0))
    d = router.route(prompt)
    assert d.worker_id == "w69"
    got = {w: m for w, (_, m) in by_worker(d).items() if any(m)}
    assert got == {"w69": (8, 0, 0), "w64": (0, 5, 1), "w3": (3, 0, 0)}


class LoadMachine(RuleBasedStateMachine):
    """Routed minus finished requests, per worker, is what the router counts as active."""

    def __init__(self) -> None:
        super().__init__()
        self.index, self.router = make("A", "B", "C", max_batch_size=3)
        self.where: dict[str, str] = {}
        self.n = 0

    @rule(length=st.integers(1, 30), salt=st.sampled_from([None, "s"]))
    def route(self, length: int, salt: str | None) -> None:
        self.n += 1
        d = self.router.route(list(range(length)), cache_salt=salt, request_id=f"r{self.n}")
        self.where[d.request_id] = d.worker_id

    @precondition(lambda self: self.where)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.where)))
        assert self.router.request_finished(rid)
        del self.where[rid]

    @rule(worker=st.sampled_from(["A", "B", "C"]), healthy=st.booleans())
    def health(self, worker: str, healthy: bool) -> None:
        self.index.set_healthy(worker, healthy or worker == "A")

    @invariant()
    def loads_match(self) -> None:
        counts = Counter(self.where.values())
        for w in ("A", "B", "C"):
            assert self.router.active_requests(w) == counts[w]
            assert self.router.pending_prefill_tokens(w) >= 0


TestLoadMachine = LoadMachine.TestCase


@given(st.floats(0.0, 2 * LATENCY_BUCKETS_S[-1], allow_nan=False))
def test_a_decision_latency_counts_in_the_first_bucket_bounding_it(elapsed: float) -> None:
    """Prometheus ``le`` buckets: a latency equal to a bound counts in that bound's bucket,
    one past every bound in the last (overflow) one."""
    stats = RouterStats()
    stats.count_latency(elapsed)
    b = stats.latency_buckets.index(1)
    assert sum(stats.latency_buckets) == 1 and stats.latency_sum_s == elapsed
    assert b == len(LATENCY_BUCKETS_S) or elapsed <= LATENCY_BUCKETS_S[b]
    assert b == 0 or elapsed > LATENCY_BUCKETS_S[b - 1]
    for bound in LATENCY_BUCKETS_S[:2]:
        at = RouterStats()
        at.count_latency(bound)
        assert at.latency_buckets[LATENCY_BUCKETS_S.index(bound)] == 1


# ------------------------------------------------------------------------- agree_margin


def _probe(router: Router, toks: list[int]) -> str:
    d = router.route(toks, request_id="probe")
    router.request_finished("probe")
    return d.worker_id


@given(st.lists(st.integers(0, 3), min_size=4, max_size=4),
       st.lists(st.integers(0, 1), min_size=4, max_size=4), st.integers(0, 10_000))
def test_agree_margin_picks_by_the_request_not_by_small_load_differences(
        loads: list[int], lag: list[int], family: int) -> None:
    """Two replicas whose load views differ by one short request per worker (well inside the
    margin) pick the same worker for every request; the pick depends on the request (its
    first block key) and the near-best set only, not on the order of the views."""
    workers = ("w0", "w1", "w2", "w3")
    toks = [family * 100 + j for j in range(40)]
    picks = []
    for extra in ([0] * 4, lag):
        _, router = make(*workers, agree_margin=32.0)
        for w, n, e in zip(workers, loads, extra, strict=True):
            load_up(router, w, n + e, tokens=20, tag=f"{n}-{e}-")  # 0.4 cost tokens each
        picks.append(_probe(router, toks))
    assert picks[0] == picks[1]


def test_agree_margin_keeps_a_clear_prefix_win_and_off_is_the_plain_rule() -> None:
    index, router = make("a", "b", "c", agree_margin=32.0)
    toks = list(range(64))  # 16 blocks of 4
    hold(index, "b", toks, dict.fromkeys(range(15), 0))
    assert _probe(router, toks) == "b"  # 60 tokens better than the others: not near
    # near-best by rendezvous: the same worker whichever order the workers were added in
    picks = set()
    for order in (("a", "b", "c"), ("c", "a", "b"), ("b", "c", "a")):
        _, r = make(*order, agree_margin=32.0)
        picks.add(_probe(r, [9, 9, 9, 9, 9]))
    assert len(picks) == 1
    with pytest.raises(InvalidArgumentError):
        make("a", agree_margin=-1.0)
    _, plain = make("a", "b")
    assert plain.agree_margin == 0.0  # the single router's rule is unchanged by default
