"""Host/disk tiers through the manager with real torch storage (ARCHITECTURE §3.4, §3.5, §7.8).

The data-plane machine plays an engine: whenever KV for a position is computed it writes, into
the sequence's block, a row that is a function of the token prefix ending there (as real KV
is). After any interleaving of admissions (full and partial reuse, onboarding), growth,
suspension, resumption and releases over tiny tiered pools, every cached block on every tier
and every block a live sequence holds must read back exactly those bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

torch = pytest.importorskip("torch")

from kvpool.config import CacheConfig, DiskConfig, EvictionConfig, SequenceRequest  # noqa: E402
from kvpool.core.manager import KVCacheManager  # noqa: E402
from kvpool.core.radix import NO_SLOT  # noqa: E402
from kvpool.errors import OutOfBlocksError, StorageError  # noqa: E402
from kvpool.tiers.storage import GroupGeometry  # noqa: E402

GEOM = GroupGeometry(num_layers=1, kv_heads=1, head_dim=2, dtype="float32")


def row_value(prefix: tuple[int, ...]) -> list[int]:
    """The 4 int32 words of the KV row of the last token of ``prefix`` (K and V, 2 dims)."""
    d = hashlib.blake2b(repr(prefix).encode(), digest_size=16).digest()
    return [int.from_bytes(d[i:i + 4], "little", signed=True) for i in range(0, 16, 4)]


def read_row(m: KVCacheManager, g: int, tier: int, slot: int, row: int) -> list[int]:
    pool = m.tensors(g, tier)
    return [int(x) for x in pool[slot].view(torch.int32)[0, :, row].flatten().tolist()]


def write_row(m: KVCacheManager, g: int, slot: int, row: int, value: list[int]) -> None:
    pool = m.tensors(g, 0)
    pool[slot].view(torch.int32)[0, :, row] = torch.tensor(value, dtype=torch.int32).reshape(
        2, 1, 2
    )


class DataPlaneMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.live: set[int] = set()
        self.suspended: set[int] = set()
        self.next_id = 0

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        groups = data.draw(st.integers(1, 2))
        self.tmp = Path(f"/tmp/kvpool-test-{id(self)}")
        self.tmp.mkdir(exist_ok=True)
        self.m = KVCacheManager(CacheConfig(tokens_per_block=data.draw(st.integers(1, 3)),
                                            gpu_blocks=data.draw(st.integers(3, 8)),
                                            window_sizes=[None] * groups,
                                            host_blocks=data.draw(st.integers(1, 5)),
                                            disk_blocks=data.draw(st.integers(0, 4)),
                                            enable_partial_reuse=data.draw(st.booleans()),
                                            layer_geometry=[GEOM] * groups, device="cpu",
                                            disk=DiskConfig(path=str(self.tmp)),
                                            eviction=EvictionConfig(offload_min_priority=0)))

    @property
    def mgr(self) -> KVCacheManager:
        assert self.m is not None
        return self.m

    def compute(self, sid: int, start: int, stop: int) -> None:
        """The engine writes KV rows for positions [start, stop) of a sequence."""
        seq = self.mgr.sequences[sid]
        toks = tuple(seq.tokens)
        tpb = self.mgr.tpb
        for g in range(self.mgr.config.num_groups):
            table = self.mgr.block_ids(sid, g)
            for p in range(start, stop):
                write_row(self.mgr, g, table[p // tpb], p % tpb, row_value(toks[: p + 1]))

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        base = data.draw(st.sampled_from([[5, 6, 7, 8, 9, 10], [5, 6, 7, 1, 1], [2, 2, 2, 2]]))
        toks = base[: data.draw(st.integers(1, len(base)))] + data.draw(
            st.lists(st.integers(0, 2), max_size=4))
        sid = self.next_id
        self.next_id += 1
        try:
            r = self.mgr.add_sequence(SequenceRequest(sid, toks))
        except OutOfBlocksError:
            return
        self.compute(sid, r.reused_tokens, len(toks))
        self.live.add(sid)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), k=st.integers(1, 3))
    def grow(self, data: st.DataObject, k: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        n = self.mgr.sequences[sid].num_tokens
        try:
            self.mgr.add_tokens(sid, data.draw(st.lists(st.integers(0, 2), min_size=k,
                                                        max_size=k)))
        except OutOfBlocksError:
            return
        self.compute(sid, n, n + k)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def suspend(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.mgr.suspend(sid)
        self.live.discard(sid)
        self.suspended.add(sid)

    @precondition(lambda self: bool(self.suspended))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.suspended)))
        try:
            self.mgr.resume(sid)
        except OutOfBlocksError:
            return
        self.suspended.discard(sid)
        self.live.add(sid)

    @precondition(lambda self: bool(self.live | self.suspended))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live | self.suspended)))
        self.mgr.remove_sequence(sid)
        self.live.discard(sid)
        self.suspended.discard(sid)

    @invariant()
    def bytes_survive(self) -> None:
        if self.m is None:
            return
        m = self.m
        m.check_invariants()
        tpb = m.tpb
        for sid in self.live:
            seq = m.sequences[sid]
            toks = tuple(seq.tokens)
            for g in range(m.config.num_groups):
                for i, slot in enumerate(m.block_ids(sid, g)):
                    if slot == NO_SLOT:
                        continue
                    for p in range(i * tpb, min((i + 1) * tpb, len(toks))):
                        assert read_row(m, g, 0, slot, p % tpb) == row_value(toks[: p + 1])
        for prefix, slots, tiers in m.tree_blocks():
            start = (len(prefix) - 1) // tpb * tpb  # the block's first token
            for g, slot in enumerate(slots):
                if slot == NO_SLOT:
                    continue
                for j in range(len(prefix) - start):
                    got = read_row(m, g, tiers[g], slot, j)
                    assert got == row_value(tuple(prefix[: start + j + 1])), (
                        f"block of tier {tiers[g]} slot {slot} row {j} corrupted"
                    )

    def teardown(self) -> None:
        if self.m is not None:
            self.m.close()
            assert not any(self.tmp.iterdir()), "the disk tier's file was not removed"


TestDataPlane = DataPlaneMachine.TestCase


# ---------------------------------------------------------------------------------- seed 002

P1 = [11, 12, 13, 14, 15, 16, 17, 18]
P2 = [21, 22, 23, 24, 25, 26, 27, 28]


def host_setup() -> KVCacheManager:
    """P2 then P1 offloaded to a full host tier; the GPU full of newer cached blocks."""
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=6, host_blocks=4,
                                   enable_partial_reuse=False))
    for sid, toks in enumerate([[*P2, 99], [*P1, 98], list(range(100, 124))]):
        m.add_sequence(SequenceRequest(sid, toks))
        m.remove_sequence(sid)
    assert m.slot_usage(0)["evictable"] == 6
    assert m.slot_usage(1)["evictable"] == 4  # P1 and P2 sit on the host
    return m


def test_seed002_sequential_onboarding_evicts_promised_host_blocks() -> None:
    m = host_setup()
    x = SequenceRequest("x", [*P1, 1, 2, 3])
    y = SequenceRequest("y", [*P2, 4, 5, 6])
    promised = (m.count_reusable_tokens(x.tokens), m.count_reusable_tokens(y.tokens))
    assert promised == (8, 8)
    assert m.add_sequence(x).reused_tokens == 8
    # onboarding x's blocks offloaded GPU victims to the host, which dropped y's prefix
    assert m.add_sequence(y).reused_tokens < promised[1]


def test_seed002_batch_keeps_exactly_the_planned_reuse_across_tiers() -> None:
    m = host_setup()
    reqs = [SequenceRequest("x", [*P1, 1, 2, 3]), SequenceRequest("y", [*P2, 4, 5, 6])]
    plan = m.plan_batch(reqs)
    results = m.add_sequence_batch(reqs)
    assert [r.reused_tokens for r in results] == [8, 8]
    assert [p.reused_tokens for p in plan.requests] == [8, 8]
    assert [r.new_blocks for r in results] == [p.new_blocks for p in plan.requests]
    assert [r.stats.onboarded for r in results] == [2, 2]
    st_ = m.stats()
    assert st_.tier_hits[1] == 4 and st_.onboard_blocks == 4
    m.check_invariants()


def test_tensors_need_real_storage_and_disk_path() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=4))
    with pytest.raises(StorageError, match="metadata-only"):
        m.tensors(0)
    with pytest.raises(ValueError, match=r"CacheConfig\.disk\.path"):
        CacheConfig(tokens_per_block=4, gpu_blocks=4, host_blocks=2, disk_blocks=2,
                    layer_geometry=[GEOM])
    with KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=4, layer_geometry=[GEOM],
                                    device="cpu")) as real:
        assert tuple(real.tensors(0).shape) == (4, 1, 2, 4, 1, 2)


def test_resume_fails_cleanly_when_the_gpu_is_full() -> None:
    m = KVCacheManager(CacheConfig(tokens_per_block=2, gpu_blocks=4, host_blocks=4))
    m.add_sequence(SequenceRequest("a", [1, 2, 3, 4, 5]))  # 3 blocks
    assert m.suspend("a") == {0: 3}
    m.add_sequence(SequenceRequest("b", [7, 8, 9]))  # 2 of the 4 GPU slots
    before = m.debug_state()
    with pytest.raises(OutOfBlocksError) as info:
        m.resume("a")
    assert info.value.deficit == {(0, 0): 1}
    assert m.debug_state() == before
    m.remove_sequence("b")
    m.resume("a")
    assert len(m.block_ids("a")) == 3
    m.check_invariants()
