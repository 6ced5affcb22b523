"""Property tests of hybrid models' state groups (docs/hybrid.md) on random workloads.

A tiny "engine" keeps each sequence's recurrent state as a fingerprint of the tokens it has
consumed, written into the running slot of a real TorchStorage pool. Random batches of
requests sharing prefixes are admitted, checkpointed where the policy says, decoded, suspended
and resumed, and removed, through small pools (evictions, host and disk tiers). After every
step: the manager's invariants hold (no slot leaked, references equal the tables, every
checkpoint's prefix has all its full-attention blocks cached, running slots never in the tree),
no two live beams share a running slot, every admission realised its plan (or raised with the
manager unchanged: two-phase admission), and every reused prefix's copied state is exactly
the state of that prefix (bit for bit through every tier).
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.config import (
    CHECKPOINT_POLICIES,
    CacheConfig,
    DiskConfig,
    EvictionConfig,
    SequenceRequest,
)
from kvpool.core.manager import KVCacheManager
from kvpool.errors import OutOfBlocksError
from kvpool.tiers.storage import GroupGeometry, StateGeometry

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 50, 51, 52, 53], [7] * 9]


def fingerprint(tokens: list[int]) -> float:
    """The state after ``tokens`` (exact in float32)."""
    v = 0
    for i, t in enumerate(tokens):
        v = (v * 31 + t * (i + 7)) % (1 << 20)
    return float(v + 1) if tokens else 0.0


@st.composite
def configs(draw: st.DrawFn, tmp: Path) -> CacheConfig:
    tiers = draw(st.integers(0, 2))
    windowed = draw(st.booleans())
    windows = [None, draw(st.integers(2, 8)), None] if windowed else [None, None]
    state = len(windows) - 1
    geo: list[GroupGeometry | StateGeometry] = [GroupGeometry(1, 1, 2, "float32")
                                                for _ in windows[:-1]]
    geo.append(StateGeometry(1, ((2,),), "float32"))
    return CacheConfig(
        tokens_per_block=draw(st.integers(1, 4)),
        gpu_blocks=[draw(st.integers(6, 24)) for _ in windows[:-1]] + [draw(st.integers(2, 6))],
        window_sizes=windows, state_groups=[state],
        checkpoint_policy=draw(st.sampled_from(
            [p for p in CHECKPOINT_POLICIES if p != "interval"])),
        host_blocks=draw(st.integers(1, 6)) if tiers else 0,
        disk_blocks=draw(st.integers(1, 6)) if tiers == 2 else 0,
        disk=DiskConfig(path=str(tmp) if tiers == 2 else None),
        max_beam_width=2,
        eviction=EvictionConfig(policy=draw(st.sampled_from(["lru", "2q", "s3fifo"]))),
        layer_geometry=geo,
    )


OPS = st.lists(st.tuples(st.sampled_from(["admit", "remove", "decode", "suspend"]),
                         st.integers(0, 50), st.integers(0, 8)), min_size=1, max_size=30)


class Engine:
    """What an engine does around the manager for state group ``g``."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.g = m.config.state_groups[0]
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.suspended: set[int] = set()
        self.next_id = 0

    def state(self, seq: int) -> float:
        slot = self.m.block_ids(seq, self.g)[0]
        return float(self.m.tensors(self.g)[0][slot, 0, 0])

    def write(self, seq: int, n: int) -> None:
        slot = self.m.block_ids(seq, self.g)[0]
        self.m.tensors(self.g)[0][slot] = fingerprint(self.tokens[seq][:n])
        self.computed[seq] = n

    def run_to(self, seq: int, end: int) -> None:
        """Compute up to ``end`` tokens, saving the checkpoints the policy asks for."""
        for p in self.m.checkpoint_positions(seq, self.computed[seq], end):
            self.write(seq, p)
            self.m.save_checkpoint(seq, p)
        self.write(seq, end)

    def admit(self, a: int, b: int) -> None:
        reqs = []
        for k in range(1 + a % 3):
            prefix = PREFIXES[(a + k) % 3][: 3 + (b + k) % 10]
            toks = prefix + [100 + (a * 7 + k) % 5] * ((b + k) % 3 + 1)
            reqs.append(SequenceRequest(self.next_id, toks, beam_width=1 + (a + k) % 2 // 1
                                        if k == 0 and a % 5 == 0 else 1))
            self.next_id += 1
        m = self.m
        plan = m.plan_batch(reqs)
        before = m.debug_state()
        try:
            res = m.add_sequence_batch(reqs)
        except OutOfBlocksError:
            assert m.debug_state() == before  # nothing claimed, nothing lost
            return
        assert [r.reused_tokens for r in res] == [p.reused_tokens for p in plan.requests]
        for r, req in zip(res, reqs, strict=True):
            seq = int(r.seq_id)
            self.tokens[seq] = list(req.tokens)
            for tb in r.block_ids[self.g]:  # every beam resumes the prefix's state
                got = float(m.tensors(self.g)[0][tb[0], 0, 0])
                assert got == fingerprint(self.tokens[seq][:r.reused_tokens])
            self.computed[seq] = r.reused_tokens
            self.run_to(seq, len(req.tokens))


def _check(m: KVCacheManager) -> None:
    m.check_invariants()
    g = m.config.state_groups[0]
    running = [s for seq in m.sequences.values() for tb in seq.tables[g] for s in tb if s != -1]
    assert len(running) == len(set(running)), "two beams share a running slot"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), ops=OPS)
def test_random_hybrid_workloads_keep_every_invariant(tmp_path: Path, data: st.DataObject,
                                                     ops: list[tuple[str, int, int]]) -> None:
    cfg = data.draw(configs(tmp_path))
    with KVCacheManager(cfg) as m:
        e = Engine(m)
        for op, a, b in ops:
            live = [s for s in e.tokens if s not in e.suspended]
            if op == "admit" or not e.tokens:
                e.admit(a, b)
            elif op == "remove":
                seq = sorted(e.tokens)[a % len(e.tokens)]
                m.remove_sequence(seq)
                e.suspended.discard(seq)
                del e.tokens[seq]
            elif op == "decode" and live:
                seq = live[a % len(live)]
                new = [200 + b] * (1 + b % 5)
                try:
                    m.add_tokens(seq, new)
                except OutOfBlocksError:
                    continue
                e.tokens[seq] += new
                e.run_to(seq, len(e.tokens[seq]) - 1)  # the last token is computed next step
            elif op == "suspend":
                seq = sorted(e.tokens)[a % len(e.tokens)]
                if seq in e.suspended:
                    try:
                        m.resume(seq)
                    except OutOfBlocksError:
                        continue
                    e.suspended.discard(seq)
                    assert e.state(seq) == fingerprint(e.tokens[seq][:e.computed[seq]])
                else:
                    m.suspend(seq)
                    e.suspended.add(seq)
            _check(m)
        for seq in list(e.tokens):
            m.remove_sequence(seq)
        _check(m)
        m.clear_cache()
        for t in range(m.config.num_tiers):
            for g in range(m.config.num_groups):
                assert m.slot_usage(t, g)["used"] == 0
