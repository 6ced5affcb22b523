"""``KVCacheManager.prefetch``: pull requests' remote continuations into local slots.

For each request, in order:

1. under the manager's lock, its local match: the longest path of its full blocks (the
   prompt minus its last token, as admission counts them) in the tree whose every block holds
   a slot in every self-attention layer group, on any local tier;
2. without the lock, the longest remote-resident continuation of that match
   (:meth:`~kvpool.tiers.remote.tier.RemoteTier.fetch_continuation`: verified values only);
3. under the lock again, the install: slots of the prefetch tier (host if the manager has one,
   else GPU) are claimed, free ones first, else the tier's eviction victims (evicted as any
   eviction is, their copies run before anything is written); the path is matched again (the
   evictions, or another thread, may have changed it: a request whose local match shrank
   meanwhile installs nothing), the bytes are copied into the claimed slots, the blocks enter
   the tree (filling path blocks that lack a slot, or as a new run after the path's end) as
   cached, unreferenced blocks in the tier's eviction queue, announced by stored events on
   that tier; unused claimed slots go back to the free list.

Admission then sees the prefetched blocks like any cached block: ``plan_batch`` and
``add_sequence_batch`` agree exactly, as ever. A :class:`~kvpool.errors.RemoteTierError`
(server down or slow) is counted and that request gets 0; nothing local is lost.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.config import SequenceRequest
from kvpool.core.allocator import lower_slot
from kvpool.core.commit import reindex
from kvpool.core.radix import NO_SLOT, Run, Segment, SlotId, match_full
from kvpool.core.remote_hooks import write_block
from kvpool.errors import InvalidArgumentError, RemoteTierError
from kvpool.hashing.keys import BlockHasher, BlockKey

if TYPE_CHECKING:
    from kvpool.core.remote_hooks import ManagerRemote
    from kvpool.core.state import CacheState

__all__ = ["local_blocks", "prefetch"]


def _raw(r: SequenceRequest) -> bytes:
    """The request's tokens as the tree stores them (a validated request holds a u32 array)."""
    tokens = r.tokens
    assert isinstance(tokens, array)
    return tokens.tobytes()


@dataclass(slots=True)
class _Plan:
    raw: bytes
    keys: list[BlockKey]
    local: int


def _requests(requests: Iterable[SequenceRequest]) -> list[SequenceRequest]:
    if isinstance(requests, SequenceRequest | str | bytes) or not isinstance(requests, Iterable):
        raise InvalidArgumentError(
            f"requests must be a sequence of SequenceRequest, got {requests!r:.80}"
        )
    out = list(requests)
    for r in out:
        if not isinstance(r, SequenceRequest):
            raise InvalidArgumentError(f"requests holds {r!r:.80}, not a SequenceRequest")
    return out


def local_blocks(state: CacheState, r: SequenceRequest, nblocks: int) -> tuple[list[Segment], int]:
    """(path, n): the tree path of the request's first ``nblocks`` blocks and how many of its
    leading blocks hold a slot in every self-attention group (manager locked)."""
    root = state.roots.get((r.lora_id, r.cache_salt))
    if root is None or not nblocks:
        return [], 0
    path = match_full(root, _raw(r), nblocks, state.layout.step)
    n = 0
    groups = state.layout.self_groups
    for run, a, b in path:
        for j in range(a, b):
            if any(run.slot[g][j] == NO_SLOT for g in groups):
                return path, n
            n += 1
    return path, n


def _plan(state: CacheState, r: SequenceRequest) -> _Plan | None:
    nblocks = (len(r.tokens) - 1) // state.layout.tpb
    _, local = local_blocks(state, r, nblocks)
    if local >= nblocks:
        return None
    hasher = BlockHasher(state.config.hash_algo, state.layout.tpb, lora_id=r.lora_id,
                         cache_salt=r.cache_salt, root=state.view.root_key(r.lora_id, r.cache_salt))
    keys = hasher.extend(r.tokens[:nblocks * state.layout.tpb])
    return _Plan(_raw(r), keys, local)


def prefetch(state: CacheState, remote: ManagerRemote | None, lock: AbstractContextManager[Any],
             requests: Iterable[SequenceRequest]) -> list[int]:
    """Tokens made local per request (module docstring); ``remote`` is the manager's remote
    tier (``state.remote``), ``lock`` the manager's. All 0 without a remote tier."""
    reqs = _requests(requests)
    if remote is None:
        return [0] * len(reqs)
    out: list[int] = []
    groups = list(state.layout.self_groups)
    remote.stats.prefetch_calls += 1
    for r in reqs:
        with lock:
            plan = _plan(state, r) if state.config.enable_block_reuse else None
        if plan is None:
            out.append(0)
            continue
        scope = remote.tier.scope(r.lora_id, r.cache_salt)
        try:
            blocks = remote.tier.fetch_continuation(scope, plan.keys[plan.local:], groups)
        except RemoteTierError as e:
            remote.failed(e)
            out.append(0)
            continue
        blocks = _valid(state, blocks, groups)
        if not blocks:
            out.append(0)
            continue
        with lock:
            made = _install(state, remote, r, plan, blocks)
        out.append(made * state.layout.tpb)
        remote.stats.prefetched_tokens += made * state.layout.tpb
    return out


def _valid(state: CacheState, blocks: list[list[memoryview]],
           groups: list[int]) -> list[list[memoryview]]:
    """The leading blocks whose payloads have this manager's block size in every group (a
    value of another geometry cannot come from this namespace; refused all the same)."""
    if getattr(state.storage, "tensors", None) is None:
        return blocks
    sizes = [state.storage.block_bytes(g) for g in groups]
    for b, payloads in enumerate(blocks):
        if any(len(payload) != n for payload, n in zip(payloads, sizes, strict=True)):
            return blocks[:b]
    return blocks


def _claim(state: CacheState, t: int, groups: list[int], n: int) -> dict[int, list[SlotId]]:
    """Up to ``n`` slots of tier t per group (free first, else evicted victims); the
    evictions' copies run before this returns."""
    claimed: dict[int, list[SlotId]] = {}
    for g in groups:
        got = claimed[g] = []
        for _ in range(n):
            s = lower_slot(state, t, g)
            if s is None:
                break
            got.append(s)
    state.finish_call()
    return claimed


def _install(state: CacheState, remote: ManagerRemote, r: SequenceRequest, plan: _Plan,
             blocks: list[list[memoryview]]) -> int:
    """Install the fetched blocks; return how many leading blocks became local."""
    state.check_storage()
    t = 1 if state.layout.tiers > 1 else 0
    groups = list(state.layout.self_groups)
    n = len(blocks)
    claimed = _claim(state, t, groups, n)
    n = min(n, *(len(c) for c in claimed.values()))
    end = plan.local + n
    path, local = local_blocks(state, r, end)
    placed: dict[int, list[tuple[Run, int]]] = {g: [] for g in groups}
    if n and local >= plan.local:
        pos = 0  # index in the request of the path's next block
        for run, a, b in path:  # fill path blocks that lack slots
            for j in range(a, b):
                index = pos - plan.local
                pos += 1
                if index < 0:
                    continue
                for gi, g in enumerate(groups):
                    if run.slot[g][j] == NO_SLOT:
                        _put(state, t, g, claimed[g].pop(), run, j, blocks[index][gi])
                        placed[g].append((run, j))
        if pos < end:
            parent = state.root((r.lora_id, r.cache_salt))
            if path:
                parent, _, at = path[-1]
                if at < len(parent.keys):
                    reindex(state, parent.split(at, state.layout.step))
            _new_run(state, t, groups, claimed, parent, plan, pos, end, blocks, placed)
    for g in groups:
        state.pools[t][g].give(claimed[g])
    for g in groups:
        chain = _segments(placed[g])
        for seg in chain:
            state.emit.stored(g, [seg], r.lora_id)
        stats = remote.stats
        stats.prefetched_blocks += len(placed[g])
        stats.prefetched_bytes += len(placed[g]) * state.storage.block_bytes(g)
        state.stats.remote(prefetched=len(placed[g]))
    state.emit.flush_removed()
    _, after = local_blocks(state, r, end)
    return max(0, after - plan.local)


def _put(state: CacheState, t: int, g: int, s: SlotId, run: Run, j: int,
         payload: memoryview) -> None:
    write_block(state.storage, t, g, s, payload)
    run.slot[g][j] = s
    run.tier[g][j] = t
    pool = state.pools[t][g]
    pool.place(s, run, j)
    pool.enqueue(s, run.priority(j), key=run.keys[j])


def _new_run(state: CacheState, t: int, groups: list[int], claimed: dict[int, list[SlotId]],
             parent: Run, plan: _Plan, first: int, end: int,
             blocks: list[list[memoryview]], placed: dict[int, list[tuple[Run, int]]]) -> None:
    """Blocks [first, end) of the request as a new run under the last block of ``parent``."""
    step = state.layout.step
    count = end - first
    tk = plan.raw[first * step:end * step]
    slots = [[NO_SLOT] * count for _ in range(state.config.num_groups)]
    tiers = [[0] * count for _ in range(state.config.num_groups)]
    run = Run(parent, tk, tk[:step], plan.keys[first:end], slots, tiers)
    parent.add_child(run)
    for gi, g in enumerate(groups):
        for j in range(count):
            _put(state, t, g, claimed[g].pop(), run, j, blocks[first + j - plan.local][gi])
            placed[g].append((run, j))


def _segments(blocks: list[tuple[Run, int]]) -> list[Segment]:
    out: list[Segment] = []
    for run, j in blocks:
        if out and out[-1][0] is run and out[-1][2] == j:
            out[-1] = (run, out[-1][1], j + 1)
        else:
            out.append((run, j, j + 1))
    return out
