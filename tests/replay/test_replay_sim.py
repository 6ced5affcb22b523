"""The replay simulator: its reuse against independent counts, the bounds, determinism, the
transports, step coalescing, preemption, and the engine as a state machine."""

from __future__ import annotations

import json
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpool.config import CacheConfig
from kvpool.errors import InvalidArgumentError
from kvpool.hashing.keys import HashAlgo
from kvpool.replay.bounds import belady_hit_rate
from kvpool.replay.cluster import (
    POLICIES,
    ClusterConfig,
    block_cache,
    bound_stream,
    replay,
    replay_policy,
    workload_bounds,
)
from kvpool.replay.engine_sim import SimWorker
from kvpool.replay.report import render, strip_wall, to_json, to_markdown
from kvpool.replay.simmodel import RequestRecord, SchedulerConfig, TimeModel
from kvpool.replay.workloads import Request, Workload, synthetic_workload

SMALL_SCHED = SchedulerConfig(max_batch_size=4, max_num_tokens=16)


def request(i: int, arrival: float, prompt: list[int], out: list[int]) -> Request:
    return Request(f"r{i}", arrival, array("I", prompt), len(out),
                   output_token_ids=array("I", out))


@st.composite
def shared_prefix_traces(
    draw: st.DrawFn, *, max_requests: int = 10, gaps: tuple[float, ...] = (0.0, 0.01, 1.0)
) -> Workload:
    """Requests whose prompts continue a prefix of an earlier prompt + answer (or start
    afresh), over a 4-token vocabulary so that blocks collide often."""
    n = draw(st.integers(1, max_requests))
    seqs: list[list[int]] = [[]]
    reqs = []
    t = 0.0
    for i in range(n):
        base = draw(st.sampled_from(seqs))
        keep = draw(st.integers(0, len(base)))
        prompt = base[:keep] + draw(st.lists(st.integers(0, 3), min_size=1, max_size=20))
        out = draw(st.lists(st.integers(0, 3), min_size=1, max_size=8))
        t += draw(st.sampled_from(gaps))
        reqs.append(request(i, t, prompt, out))
        seqs.append(prompt + out)
    return Workload("hyp", tuple(reqs))


def lcp(a: list[int], b: list[int]) -> int:
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


def committed(req: Request) -> list[int]:
    """What the simulator leaves committed after a request (engine_sim's documented rule):
    the prompt when one token is generated, else every appended token but the last, i.e.
    prompt + output[:m-2] (the final token is never appended)."""
    assert req.output_token_ids is not None
    n, m = len(req.tokens), req.output_length
    seq = list(req.tokens) + list(req.output_token_ids)
    return seq[: n if m == 1 else n + m - 2]


def sequential(workload: Workload) -> Workload:
    """The same requests, 1000 s apart: each finishes before the next arrives."""
    return Workload(workload.name, tuple(
        request(i, 1000.0 * i, list(r.tokens), list(r.output_token_ids or []))
        for i, r in enumerate(workload.requests)
    ))


# -------------------------------------------------------------------- reuse vs independent


@given(shared_prefix_traces(), st.integers(1, 4))
def test_reused_tokens_equal_an_independent_prefix_count(wl: Workload, tpb: int) -> None:
    """One worker, a cache that never evicts, requests one after the other, whole blocks only:
    a request reuses the longest prefix, in whole blocks of its prompt minus its last token,
    that it shares with anything an earlier request committed."""
    wl = sequential(wl)
    total = sum(len(r.tokens) + r.output_length for r in wl.requests)
    cfg = ClusterConfig(cache=block_cache(total // tpb + 8, tokens_per_block=tpb,
                                          partial_reuse=False), workers=1)
    res = replay_policy(wl, cfg, "round-robin")
    done: list[list[int]] = []
    for req, rec in zip(wl.requests, res.records, strict=True):
        body = list(req.tokens)[:-1]
        expected = max((lcp(body, c) // tpb * tpb for c in done), default=0)
        assert rec.reused_tokens == expected, (req.request_id, rec)
        assert rec.reused_partial_tokens == 0
        assert rec.computed_tokens == len(req.tokens) - expected
        done.append(committed(req))
    assert all(w.cache_stats["evicted_blocks"] == 0 for w in res.workers)


@given(shared_prefix_traces(), st.integers(2, 4))
def test_partial_reuse_adds_tokens_within_the_shared_prefix(wl: Workload, tpb: int) -> None:
    """With partial-block reuse a request still reuses no more than its longest shared token
    prefix, and at least the whole blocks of the prefix it shares with the latest request that
    committed it (a taken-over partial block can hide older ones, never the newest)."""
    wl = sequential(wl)
    total = sum(len(r.tokens) + r.output_length for r in wl.requests)
    cfg = ClusterConfig(cache=block_cache(total // tpb + 8, tokens_per_block=tpb), workers=1)
    res = replay_policy(wl, cfg, "cost")
    done: list[list[int]] = []
    for req, rec in zip(wl.requests, res.records, strict=True):
        body = list(req.tokens)[:-1]
        assert rec.reused_tokens <= max((lcp(body, c) for c in done), default=0)
        assert rec.reused_full_tokens % tpb == 0
        assert 0 <= rec.reused_partial_tokens < tpb
        assert rec.reused_tokens == rec.reused_full_tokens + rec.reused_partial_tokens
        if done:
            assert rec.reused_tokens >= lcp(body, done[-1]) // tpb * tpb
        done.append(committed(req))


def test_reuse_is_split_by_the_tier_it_was_found_on() -> None:
    """A prefix pushed to the host tier by another request is reused from there.

    r0 leaves 4 whole blocks in a 6-slot GPU pool; r1 needs 5 slots: the 2 free ones and 3
    evicted to the host, tail first (the manager's order), so r0's first block stays on the
    GPU and r2 finds 1 block there and 3 on the host."""
    a = list(range(17))
    wl = Workload("tiers", (
        request(0, 0.0, a, [1]),
        request(1, 10.0, list(range(100, 117)), [1]),  # evicts a's blocks to the host
        request(2, 20.0, [*a, 200], [1]),
    ))
    cfg = ClusterConfig(cache=block_cache(6, host_blocks=20, tokens_per_block=4,
                                          partial_reuse=False), workers=1)
    res = replay_policy(wl, cfg, "round-robin")
    assert [r.tier_tokens for r in res.records] == [[0, 0, 0], [0, 0, 0], [4, 12, 0]]
    assert res.records[2].reused_tokens == 16
    assert res.workers[0].cache_stats["onboard_blocks"] == 3


# ------------------------------------------------------------------------------- bounds


@given(
    shared_prefix_traces(max_requests=12, gaps=(0.0, 0.001, 0.01, 0.1, 1.0)),
    st.integers(1, 3),
    st.integers(2, 4),
    st.integers(1, 12),
)
def test_bounds_are_at_least_every_policys_hit_rate(
    wl: Workload, workers: int, tpb: int, spare: int
) -> None:
    """Small caches (eviction, preemption), concurrent arrivals, several workers: no policy
    reuses more whole blocks than the unlimited cache, nor than Belady for the same total
    capacity over its run's accesses."""
    longest = max(len(r.tokens) + r.output_length for r in wl.requests)
    gpu = -(-longest // tpb) + spare
    cfg = ClusterConfig(cache=block_cache(gpu, tokens_per_block=tpb), workers=workers,
                        scheduler=SMALL_SCHED)
    unlimited = workload_bounds(wl, tpb)["unlimited"]
    for policy in POLICIES:
        res = replay_policy(wl, cfg, policy)
        full = sum(r.reused_full_tokens for r in res.records)
        assert full <= res.belady.hit_tokens, policy
        assert full <= unlimited.hit_tokens, policy
        assert res.belady.capacity_blocks == workers * gpu
        served = sum(r.prompt_tokens for r in res.records if not r.rejected)
        assert res.belady.prompt_tokens == served
        assert all(r.finish_s is not None or r.rejected for r in res.records)


def test_bounds_see_answers_that_later_turns_reuse() -> None:
    """A second turn whose prompt is the first turn's prompt + answer: the bounds count the
    answer's blocks as reusable (the simulator commits them), a prompt-only stream would not."""
    a = request(0, 0.0, [1, 2, 3, 4], [5, 6, 7, 8, 9, 9])
    b = request(1, 100.0, [1, 2, 3, 4, 5, 6, 7, 8, 0], [1])
    wl = Workload("two", (a, b))
    # b's body [1..8] is 4 blocks; a commits prompt + answer[:4] = [1..8]: all 4 are hits
    assert workload_bounds(wl, 2)["unlimited"].hit_tokens == 8
    res = replay_policy(wl, ClusterConfig(cache=block_cache(32, tokens_per_block=2),
                                          workers=1), "cost")
    assert res.records[1].reused_full_tokens == 8
    assert res.belady.hit_tokens == 8


def test_a_busy_cluster_beats_belady_on_the_arrival_order() -> None:
    """Why the Belady bound is computed per run: r0's answer takes no cache while r1 and r2
    reuse theirs, so 11 blocks serve 14 hits, while Belady on the arrival-order stream (where
    r0's answer is stored at once) holds at most 11."""
    r0 = request(0, 0.0, [1, 2], list(range(10, 20)))
    r1 = request(1, 0.001, [30, 31, 32, 33, 34], [40])
    r2 = request(2, 0.012, [30, 31, 32, 33, 34], [50])
    r3 = request(3, 1.0, [1, 2, *range(10, 18), 60], [61])
    wl = Workload("busy", (r0, r1, r2, r3))
    cfg = ClusterConfig(cache=block_cache(11, tokens_per_block=1, partial_reuse=False),
                        workers=1, scheduler=SMALL_SCHED)
    res = replay_policy(wl, cfg, "cost")
    assert [r.reused_full_tokens for r in res.records] == [0, 0, 4, 10]
    serial = belady_hit_rate(bound_stream(wl, 1), 11)
    assert serial.hit_tokens < 14 <= res.belady.hit_tokens


# ------------------------------------------------------------------------- determinism


def small_synthetic(n: int = 30) -> Workload:
    return synthetic_workload(
        num_requests=n, system_prompt_tokens=96, agent_prefix_tokens=192, user_tokens=40,
        output_tokens=24, tool_output_tokens=40, max_prompt_tokens=600, arrival_rate_per_s=8.0,
        think_time_s=0.5, min_think_time_s=0.2, agent_think_time_s=0.2,
    )


def small_cluster(**kw: object) -> ClusterConfig:
    return ClusterConfig(cache=block_cache(48, tokens_per_block=8), workers=2,
                         scheduler=SchedulerConfig(max_batch_size=8, max_num_tokens=256),
                         **kw)  # type: ignore[arg-type]


def test_json_is_stable_for_a_fixed_seed() -> None:
    wl = small_synthetic()
    first = to_json(replay(wl, small_cluster(seed=3)))
    second = to_json(replay(wl, small_cluster(seed=3)))
    assert "wall" in first and "wall" in first["policies"][0]
    a, b = strip_wall(first), strip_wall(second)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert "wall" not in json.dumps(a)
    assert [p["policy"] for p in a["policies"]] == list(POLICIES)
    # the run is not trivial: something was reused and something evicted
    assert all(p["reused_tokens"] > 0 for p in a["policies"])
    assert any(p["cache"]["evicted_blocks"] > 0 for p in a["policies"])


def test_zmq_transport_gives_the_in_process_results() -> None:
    wl = small_synthetic(20)
    inproc = replay(wl, small_cluster(), ["cost", "trtllm"])
    zmq = replay(wl, small_cluster(transport="zmq"), ["cost", "trtllm"])
    for a, b in zip(inproc.policies, zmq.policies, strict=True):
        assert a.records == b.records
        assert b.events_applied > 0
        # the vLLM wire format has no "created" event and splits a tier move in two
        assert a.events_applied > 0


def test_parallel_jobs_give_the_serial_results() -> None:
    wl = small_synthetic(20)
    serial = replay(wl, small_cluster(), ["cost", "random"], jobs=1)
    parallel = replay(wl, small_cluster(), ["cost", "random"], jobs=2)
    assert [p.records for p in serial.policies] == [p.records for p in parallel.policies]


def _times_close(a: list[RequestRecord], b: list[RequestRecord]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.reused_tokens, x.computed_tokens, x.preemptions, x.worker, x.rejected) == (
            y.reused_tokens, y.computed_tokens, y.preemptions, y.worker, y.rejected
        ), x.request_id
        for t1, t2 in ((x.first_token_s, y.first_token_s), (x.finish_s, y.finish_s)):
            assert (t1 is None) == (t2 is None)
            if t1 is not None and t2 is not None:
                assert t1 == pytest.approx(t2, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("windowed", [False, True])
def test_coalesced_steps_equal_one_step_at_a_time(windowed: bool) -> None:
    """Lazy appends and macro steps change nothing: the same requests, reuse, preemptions and
    (up to rounding) times as appending every token in its own step."""
    if windowed:
        cache = CacheConfig(tokens_per_block=8, gpu_blocks=[64, 64], window_sizes=[None, 20],
                            hash_algo=HashAlgo.V2_SHA256_64, max_seq_len=4096)
    else:
        cache = block_cache(64, tokens_per_block=8)
    wl = synthetic_workload(  # bursty, long answers: many sequences grow at once
        num_requests=40, system_prompt_tokens=64, agent_prefix_tokens=128, user_tokens=32,
        output_tokens=64, tool_output_tokens=32, max_prompt_tokens=400, arrival_rate_per_s=20.0,
        think_time_s=0.2, min_think_time_s=0.05, agent_think_time_s=0.05,
    )
    sched = SchedulerConfig(max_batch_size=6, max_num_tokens=128)
    for policy in ("cost", "round-robin"):
        fast = replay_policy(wl, ClusterConfig(cache=cache, workers=2, scheduler=sched), policy)
        slow = replay_policy(
            wl, ClusterConfig(cache=cache, workers=2, scheduler=sched, coalesce_steps=False),
            policy,
        )
        _times_close(fast.records, slow.records)
        assert sum(r.preemptions for r in fast.records) > 0  # the tight pool preempts
        assert [w.steps for w in fast.workers] == [w.steps for w in slow.workers]


# ------------------------------------------------------------------------------ engine


def drain(worker: SimWorker, now: float = 0.0) -> float:
    """Run the worker's steps until it is idle; returns the time."""
    while True:
        end = worker.start_step(now)
        if end is None:
            return now
        worker.finish_step(end)
        now = end


def test_preemption_recomputes_and_leaks_nothing() -> None:
    """Eight sequences that cannot all grow in a 30-block pool: the newest are preempted and
    recomputed, every request finishes with all its tokens, and no slot stays held."""
    worker = SimWorker("w", block_cache(30, tokens_per_block=4, partial_reuse=False),
                       SchedulerConfig(max_batch_size=8, max_num_tokens=64), TimeModel())
    recs = []
    for i in range(8):
        req = request(i, 0.0, [i, 1, 2, 3, 4, 5, 6], [7] * 20)
        rec = RequestRecord(i, req.request_id, "w", 0.0, 7, 20)
        assert worker.submit(req, rec, array("I", [7] * 20))
        recs.append(rec)
    drain(worker)
    assert worker.preemptions > 0
    assert sum(r.preemptions for r in recs) == worker.preemptions
    assert all(r.finish_s is not None for r in recs)
    # recomputation: preempted requests computed more than their prompt
    assert any(r.computed_tokens > 7 for r in recs if r.preemptions)
    mgr = worker.manager
    mgr.check_invariants()
    assert not mgr.sequences
    assert mgr.slot_usage()["used"] == 0


def test_request_larger_than_the_pool_is_rejected() -> None:
    worker = SimWorker("w", block_cache(4, tokens_per_block=4), SchedulerConfig(),
                       TimeModel())
    big = request(0, 0.0, list(range(16)), [1])  # 4 blocks + 1 for a partial copy > 4
    rec = RequestRecord(0, "r0", "w", 0.0, 16, 1)
    assert not worker.submit(big, rec, array("I", [1]))
    assert rec.rejected
    small = request(1, 0.0, list(range(9)), [1, 2])  # 3 blocks (+1) fit
    assert worker.submit(small, RequestRecord(1, "r1", "w", 0.0, 9, 2), array("I", [1, 2]))


def test_time_model_macro_step_is_the_sum_of_its_steps() -> None:
    tm = TimeModel(weight_read_s=0.004, token_compute_s=1e-4, attention_pair_s=2e-9,
                   kv_read_s=3e-8)
    assert tm.step_s(10, 100, 1000) == pytest.approx(0.004 + 100 * 2e-9 + 1000 * 3e-8)
    assert tm.step_s(100, 0, 0) == pytest.approx(100 * 1e-4)  # compute bound
    batch, context = 7, 5000
    total = sum(tm.step_s(batch, 0, context + i * batch) for i in range(13))
    assert tm.decode_steps_s(13, batch, context) == pytest.approx(total)
    with pytest.raises(InvalidArgumentError, match="kv_read_s"):
        TimeModel(kv_read_s=-1.0)


def test_bad_arguments_are_rejected_before_replaying() -> None:
    wl = small_synthetic(5)
    with pytest.raises(InvalidArgumentError, match="unknown routing policy 'fastest'"):
        replay(wl, small_cluster(), ["cost", "fastest"])
    with pytest.raises(InvalidArgumentError, match="repeat"):
        replay(wl, small_cluster(), ["cost", "cost"])
    with pytest.raises(InvalidArgumentError, match="transport"):
        small_cluster(transport="carrier-pigeon")
    with pytest.raises(InvalidArgumentError, match="max_num_tokens"):
        SchedulerConfig(max_batch_size=64, max_num_tokens=32)


# ------------------------------------------------------------------ the engine, stateful


class EngineMachine(RuleBasedStateMachine):
    """Requests arrive at random moments, steps end (whole or cut short by an arrival); the
    manager stays consistent, the scheduler within its limits, and everything finishes."""

    @initialize(
        tpb=st.integers(2, 4),
        blocks=st.integers(12, 30),
        batch=st.integers(1, 4),
        partial=st.booleans(),
    )
    def setup(self, tpb: int, blocks: int, batch: int, partial: bool) -> None:
        self.worker = SimWorker(
            "w", block_cache(blocks, tokens_per_block=tpb, partial_reuse=partial),
            SchedulerConfig(max_batch_size=batch, max_num_tokens=max(batch, 8)), TimeModel(),
        )
        self.now = 0.0
        self.end: float | None = None
        self.records: list[RequestRecord] = []
        self.seqs: list[list[int]] = [[]]

    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        base = data.draw(st.sampled_from(self.seqs))
        prompt = base[: data.draw(st.integers(0, len(base)))]
        prompt += data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12))
        out = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=10))
        i = len(self.records)
        req = request(i, self.now, prompt, out)
        rec = RequestRecord(i, req.request_id, "w", self.now, len(prompt), len(out))
        self.records.append(rec)
        self.seqs.append(prompt + out)
        if self.worker.submit(req, rec, array("I", out)) and self.end is not None:
            cut = self.worker.interrupt(self.now)
            if cut is not None:
                assert self.now <= cut <= self.end
                self.end = cut

    @rule(frac=st.floats(0.0, 1.0))
    def time_passes(self, frac: float) -> None:
        """Time moves within the current step (arrivals then land mid-step)."""
        if self.end is not None:
            self.now += (self.end - self.now) * frac

    @rule()
    def step(self) -> None:
        if self.end is not None:
            self.now = self.end
            self.worker.finish_step(self.now)
        self.end = self.worker.start_step(self.now)

    @precondition(lambda self: hasattr(self, "worker"))
    @invariant()
    def consistent(self) -> None:
        w = self.worker
        w.manager.check_invariants()
        assert len(w._running) <= w.scheduler.max_batch_size
        assert (self.end is not None) == w.busy

    def teardown(self) -> None:
        if not hasattr(self, "worker"):
            return
        if self.end is not None:
            self.worker.finish_step(self.end)
            self.now = self.end
        drain(self.worker, self.now)
        for rec in self.records:
            assert rec.rejected or rec.finish_s is not None, rec
        mgr = self.worker.manager
        mgr.check_invariants()
        assert not mgr.sequences and mgr.slot_usage()["used"] == 0


EngineMachine.TestCase.settings = settings(stateful_step_count=30)
test_engine_state_machine = EngineMachine.TestCase


def test_approx_routes_on_no_event_and_the_markdown_marks_each_columns_best() -> None:
    wl = small_synthetic()
    res = replay(wl, small_cluster(), ["approx", "round-robin", "cost"])
    approx = res.policies[0]
    assert approx.events_emitted > 0 and approx.events_applied == 0
    assert sum(r.reused_tokens for r in approx.records) > 0
    table = [line for line in to_markdown(res).splitlines() if line.startswith("| `")]
    rates = [float(row.split("|")[2].strip(" *%")) for row in table]
    marked = [row.split("|")[2].strip().startswith("**") for row in table]
    assert marked == [r == max(rates) for r in rates]
    belady = [row.split("|")[4] for row in table]  # the bound is not a "best" column
    assert not any("**" in cell for cell in belady)


@pytest.mark.parametrize("width", [60, 80])
def test_the_terminal_table_never_cuts_a_cell(width: int) -> None:
    """Policies that do not fit side by side go on into further tables: every policy shows,
    every row keeps its label and values, and no cell is cut (rich would write '…')."""
    from rich.console import Console

    policies = ["cost", "trtllm", "approx", "round-robin", "least-loaded", "random"]
    res = replay(small_synthetic(), small_cluster(), policies)
    console = Console(width=width, record=True, color_system=None)
    render(res, console)
    text = console.export_text()
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines())
    headers = " ".join(line for line in text.splitlines() if line.startswith("┃"))
    for p in policies:
        assert all(part in headers for part in p.split("-")), p
    tables = text.count("kvpool replay")
    assert tables >= 2 if width == 60 else tables >= 1
    # every table repeats every row: one "prefill computed" line per table
    assert text.count("prefill computed") == tables
