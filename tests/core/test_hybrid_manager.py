"""The manager's recurrent-state layer groups (docs/hybrid.md): running slots, checkpoints,
the reuse rule, tiers bit for bit, suspend/resume, the policies and the config checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.config import CacheConfig, DiskConfig, SequenceRequest
from kvpool.core.manager import KVCacheManager
from kvpool.errors import InvalidArgumentError, OutOfBlocksError, SequenceStateError
from kvpool.tiers.storage import GroupGeometry, StateGeometry

TPB = 4
STATE = StateGeometry(2, ((3, 2), (2, 4, 4)), "float32")


def _config(tmp_path: Path | None = None, **kw: object) -> CacheConfig:
    args: dict[str, object] = dict(
        tokens_per_block=TPB, gpu_blocks=[32, 6], window_sizes=[None, None], state_groups=[1],
        layer_geometry=[GroupGeometry(2, 1, 4, "float32"), STATE])
    if tmp_path is not None:
        args.update(host_blocks=[16, 2], disk_blocks=[16, 4], disk=DiskConfig(path=str(tmp_path)))
    args.update(kw)
    return CacheConfig(**args)  # type: ignore[arg-type]


def _fill(m: KVCacheManager, seq: int | str, value: float) -> list[torch.Tensor]:
    """Write a distinct state into the sequence's running slot; returns its parts."""
    slot = m.block_ids(seq, 1)[0]
    parts = m.tensors(1)
    for k, part in enumerate(parts):
        part[slot] = torch.arange(part[slot].numel(), dtype=part.dtype).view_as(part[slot]) \
            + value + 100 * k
    return [p[slot].clone() for p in parts]


def test_state_geometry_parts_are_aligned_views() -> None:
    parts = STATE.parts()
    assert [p[0] % 16 for p in parts] == [0, 0]
    assert STATE.block_bytes() == 48 + 256
    m = KVCacheManager(_config())
    conv, ssm = m.tensors(1)
    assert conv.shape == (6, 2, 3, 2) and ssm.shape == (6, 2, 2, 4, 4)
    assert conv.dtype == ssm.dtype == torch.float32


def test_cold_sequence_gets_a_zeroed_running_slot_and_reuse_copies_the_checkpoint() -> None:
    m = KVCacheManager(_config())
    tokens = list(range(1, 20))
    r = m.add_sequence(SequenceRequest("a", tokens))
    assert r.reused_tokens == 0 and len(r.block_ids[1]) == 1 and len(r.block_ids[1][0]) == 1
    saved = _fill(m, "a", 5.0)
    assert m.checkpoint_positions("a", 0, 18) == [16]
    assert m.save_checkpoint("a", 16)
    m.check_invariants()
    m.remove_sequence("a")
    # the same prefix, diverging after 17 tokens: resumes at the checkpoint (16)
    r = m.add_sequence(SequenceRequest("b", [*tokens[:17], 99, 98]))
    assert r.reused_tokens == 16
    slot = r.block_ids[1][0][0]
    for part, want in zip(m.tensors(1), saved, strict=True):
        assert torch.equal(part[slot], want)
    assert m.count_reusable_tokens([*tokens[:13], 0, 0, 0]) == 0  # no checkpoint at 12
    # a cold one is zeroed even when its slot held a state before
    m.remove_sequence("b")
    r = m.add_sequence(SequenceRequest("c", [50, 51, 52, 53, 54]))
    assert r.reused_tokens == 0
    assert all(not p[r.block_ids[1][0][0]].any() for p in m.tensors(1))
    m.check_invariants()


def test_attention_reuse_is_cut_to_the_last_checkpoint() -> None:
    m = KVCacheManager(_config(checkpoint_policy="every_block"))
    tokens = list(range(1, 30))
    m.add_sequence(SequenceRequest("a", tokens))
    assert m.checkpoint_positions("a", 0, 28) == [4, 8, 12, 16, 20, 24, 28]
    assert m.save_checkpoint("a", 8)
    m.store_context_blocks("a", 28)
    m.remove_sequence("a")
    assert m.count_reusable_tokens(tokens) == 8
    plan = m.plan_batch([SequenceRequest("b", tokens)])
    assert plan.requests[0].reused_tokens == 8


def test_tier_round_trip_is_bit_exact(tmp_path: Path) -> None:
    m = KVCacheManager(_config(tmp_path))
    saved: dict[int, list[torch.Tensor]] = {}
    for n in range(6):  # six checkpoints through a 6-slot GPU state pool: offloads
        toks = [100 * n + i for i in range(1, 10)]
        m.add_sequence(SequenceRequest(n, toks))
        saved[n] = _fill(m, n, float(n))
        assert m.save_checkpoint(n, 8)
        m.remove_sequence(n)
        m.check_invariants()
    tiers = {t for _, _, t in m.cached_blocks()}
    assert {1, 2} & tiers  # some checkpoints left the GPU
    hits = 0
    for n in range(6):
        toks = [100 * n + i for i in range(1, 10)]
        r = m.add_sequence(SequenceRequest(f"r{n}", toks))
        if r.reused_tokens == 8:
            hits += 1
            slot = r.block_ids[1][0][0]
            for part, want in zip(m.tensors(1), saved[n], strict=True):
                assert torch.equal(part[slot], want)
        m.remove_sequence(f"r{n}")
        m.check_invariants()
    assert hits >= 4
    m.close()


def test_suspend_resume_carries_the_running_state(tmp_path: Path) -> None:
    m = KVCacheManager(_config(tmp_path))
    m.add_sequence(SequenceRequest("a", list(range(1, 8))))
    want = _fill(m, "a", 3.0)
    freed = m.suspend("a")
    assert freed[1] == 1 and m.block_ids("a", 1) == [-1]
    with pytest.raises(SequenceStateError):
        m.save_checkpoint("a", 4)
    m.resume("a")
    slot = m.block_ids("a", 1)[0]
    for part, w in zip(m.tensors(1), want, strict=True):
        assert torch.equal(part[slot], w)
    m.check_invariants()


def test_last_policy_keeps_only_the_latest_boundary() -> None:
    m = KVCacheManager(_config(checkpoint_policy="last"))
    tokens = list(range(1, 40))
    m.add_sequence(SequenceRequest("a", tokens))
    for n in (8, 16, 24):
        assert m.checkpoint_positions("a", n - 4, n) == [n]
        assert m.save_checkpoint("a", n)
    slots = [s[1] for _, s, _ in m.tree_blocks() if s[1] != -1]
    assert len(slots) == 1
    assert m.count_reusable_tokens(tokens) == 24


def test_branch_point_is_offered_to_the_second_request() -> None:
    m = KVCacheManager(_config(checkpoint_policy="marconi"))
    system = list(range(1, 14))  # 3 whole blocks
    m.add_sequence(SequenceRequest("q1", [*system, 70, 71, 72]))
    m.store_context_blocks("q1", 15)
    assert m.checkpoint_positions("q1", 0, 15) == [12]  # the last boundary only
    m.remove_sequence("q1")
    r = m.add_sequence(SequenceRequest("q2", [*system, 80, 81, 82]))
    assert r.reused_tokens == 0  # attention cached, no checkpoint yet
    assert 12 in m.checkpoint_positions("q2", 0, 15)
    assert m.save_checkpoint("q2", 12)
    m.remove_sequence("q2")
    assert m.count_reusable_tokens([*system, 90, 91, 92]) == 12


def test_two_phase_admission_keeps_a_claimed_checkpoint() -> None:
    # a 2-slot state pool: the checkpoint and one free slot
    m = KVCacheManager(_config(gpu_blocks=[64, 2], checkpoint_policy="every_block"))
    shared = list(range(1, 10))
    m.add_sequence(SequenceRequest("a", shared))
    want = _fill(m, "a", 1.0)
    assert m.save_checkpoint("a", 8)
    m.remove_sequence("a")
    batch = [SequenceRequest("x", [500, 501, 502]), SequenceRequest("y", [*shared[:8], 7, 7])]
    before = m.debug_state()
    # x's running slot may not evict the checkpoint y claims: the batch does not fit
    with pytest.raises(OutOfBlocksError):
        m.add_sequence_batch(batch)
    assert m.debug_state() == before
    (r,) = m.add_sequence_batch(batch[1:])
    assert r.reused_tokens == 8
    slot = r.block_ids[1][0][0]
    for part, w in zip(m.tensors(1), want, strict=True):
        assert torch.equal(part[slot], w)
    m.check_invariants()


def test_config_checks() -> None:
    with pytest.raises(InvalidArgumentError):
        CacheConfig(tokens_per_block=4, gpu_blocks=4, window_sizes=[None], state_groups=[0])
    with pytest.raises(InvalidArgumentError):
        CacheConfig(tokens_per_block=4, gpu_blocks=4, window_sizes=[None, 8], state_groups=[1])
    with pytest.raises(InvalidArgumentError):
        CacheConfig(tokens_per_block=4, gpu_blocks=4, window_sizes=[None, None],
                    state_groups=[1], checkpoint_policy="interval",
                    checkpoint_interval_tokens=6)
    with pytest.raises(InvalidArgumentError):  # a state group needs a StateGeometry
        CacheConfig(tokens_per_block=4, gpu_blocks=4, window_sizes=[None, None],
                    state_groups=[1], layer_geometry=[GroupGeometry(1, 1, 4)] * 2)
    m = KVCacheManager(CacheConfig(tokens_per_block=4, gpu_blocks=4))
    m.add_sequence(SequenceRequest("a", [1, 2, 3, 4, 5]))
    assert m.checkpoint_positions("a", 0, 4) == []
    with pytest.raises(InvalidArgumentError):
        m.save_checkpoint("a", 4)
    m2 = KVCacheManager(_config())
    m2.add_sequence(SequenceRequest("a", [1, 2, 3, 4, 5]))
    with pytest.raises(InvalidArgumentError):
        m2.save_checkpoint("a", 3)
