"""``KVCacheManager.prefetch``: pull requests' remote continuations into local slots.

For each request, in order:

1. under the manager's lock, its local match: the longest path of its full blocks (the
   prompt minus its last token, as admission counts them) in the tree whose every block holds
   a slot in every self-attention layer group, on any local tier;
2. without the lock, the longest remote-resident continuation of that match
   (:meth:`~kvpool.remote.tier.RemoteTier.fetch_continuation`: verified values only);
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.config import SequenceRequest
from kvpool.errors import InvalidArgumentError, RemoteTierError
from kvpool.hashing import BlockHasher, BlockKey
from kvpool.radix import NO_SLOT, Run, Segment, match_full
from kvpool.remote.hooks import write_block

if TYPE_CHECKING:
    from kvpool.manager import KVCacheManager
    from kvpool.remote.hooks import ManagerRemote

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


def local_blocks(m: KVCacheManager, r: SequenceRequest, nblocks: int) -> tuple[list[Segment], int]:
    """(path, n): the tree path of the request's first ``nblocks`` blocks and how many of its
    leading blocks hold a slot in every self-attention group (manager locked)."""
    root = m.roots.get((r.lora_id, r.cache_salt))
    if root is None or not nblocks:
        return [], 0
    path = match_full(root, _raw(r), nblocks, m.step)
    n = 0
    groups = m.self_groups
    for run, a, b in path:
        for j in range(a, b):
            if any(run.slot[g][j] == NO_SLOT for g in groups):
                return path, n
            n += 1
    return path, n


def _plan(m: KVCacheManager, r: SequenceRequest) -> _Plan | None:
    nblocks = (len(r.tokens) - 1) // m.tpb
    _, local = local_blocks(m, r, nblocks)
    if local >= nblocks:
        return None
    hasher = BlockHasher(m.config.hash_algo, m.tpb, lora_id=r.lora_id,
                         cache_salt=r.cache_salt, root=m._view.root_key(r.lora_id, r.cache_salt))
    keys = hasher.extend(r.tokens[:nblocks * m.tpb])
    return _Plan(_raw(r), keys, local)


def prefetch(m: KVCacheManager, remote: ManagerRemote,
             requests: Iterable[SequenceRequest]) -> list[int]:
    """Tokens made local per request (module docstring)."""
    reqs = _requests(requests)
    out: list[int] = []
    groups = list(m.self_groups)
    remote.stats.prefetch_calls += 1
    for r in reqs:
        with m._lock:
            plan = _plan(m, r) if m.config.enable_block_reuse else None
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
        blocks = _valid(m, blocks, groups)
        if not blocks:
            out.append(0)
            continue
        with m._lock:
            made = _install(m, remote, r, plan, blocks)
        out.append(made * m.tpb)
        remote.stats.prefetched_tokens += made * m.tpb
    return out


def _valid(m: KVCacheManager, blocks: list[list[memoryview]],
           groups: list[int]) -> list[list[memoryview]]:
    """The leading blocks whose payloads have this manager's block size in every group (a
    value of another geometry cannot come from this namespace; refused all the same)."""
    if getattr(m.storage, "tensors", None) is None:
        return blocks
    sizes = [m.storage.block_bytes(g) for g in groups]
    for b, payloads in enumerate(blocks):
        if any(len(p) != n for p, n in zip(payloads, sizes, strict=True)):
            return blocks[:b]
    return blocks


def _claim(m: KVCacheManager, t: int, groups: list[int], n: int) -> dict[int, list[int]]:
    """Up to ``n`` slots of tier t per group (free first, else evicted victims); the
    evictions' copies run before this returns."""
    claimed: dict[int, list[int]] = {}
    for g in groups:
        got = claimed[g] = []
        for _ in range(n):
            s = m._lower_slot(t, g)
            if s is None:
                break
            got.append(s)
    m._finish_call()
    return claimed


def _install(m: KVCacheManager, remote: ManagerRemote, r: SequenceRequest, plan: _Plan,
             blocks: list[list[memoryview]]) -> int:
    """Install the fetched blocks; return how many leading blocks became local."""
    m._check_storage()
    t = 1 if m._tiers > 1 else 0
    groups = list(m.self_groups)
    n = len(blocks)
    claimed = _claim(m, t, groups, n)
    n = min(n, *(len(c) for c in claimed.values()))
    end = plan.local + n
    path, local = local_blocks(m, r, end)
    placed: dict[int, list[tuple[Run, int]]] = {g: [] for g in groups}
    if n and local >= plan.local:
        pos = 0  # index in the request of the path's next block
        for run, a, b in path:  # fill path blocks that lack slots
            for j in range(a, b):
                k = pos - plan.local
                pos += 1
                if k < 0:
                    continue
                for gi, g in enumerate(groups):
                    if run.slot[g][j] == NO_SLOT:
                        _put(m, t, g, claimed[g].pop(), run, j, blocks[k][gi])
                        placed[g].append((run, j))
        if pos < end:
            parent = m._root((r.lora_id, r.cache_salt))
            if path:
                parent, _, at = path[-1]
                if at < len(parent.keys):
                    m._reindex(parent.split(at, m.step))
            _new_run(m, t, groups, claimed, parent, plan, pos, end, blocks, placed)
    for g in groups:
        m._free[t][g].extend(claimed[g])
    for g in groups:
        chain = _segments(placed[g])
        for seg in chain:
            m._emit.stored(g, [seg], r.lora_id)
        stats = remote.stats
        stats.prefetched_blocks += len(placed[g])
        stats.prefetched_bytes += len(placed[g]) * m.storage.block_bytes(g)
        m._stats.remote_prefetch_blocks += len(placed[g])
    m._emit.flush_removed()
    _, after = local_blocks(m, r, end)
    return max(0, after - plan.local)


def _put(m: KVCacheManager, t: int, g: int, s: int, run: Run, j: int,
         payload: memoryview) -> None:
    write_block(m.storage, t, g, s, payload)
    run.slot[g][j] = s
    run.tier[g][j] = t
    m._pools[t][g].place(s, run, j)
    m._queue[t][g].push(s, run.priority(j), key=run.keys[j])


def _new_run(m: KVCacheManager, t: int, groups: list[int], claimed: dict[int, list[int]],
             parent: Run, plan: _Plan, d: int, end: int,
             blocks: list[list[memoryview]], placed: dict[int, list[tuple[Run, int]]]) -> None:
    """Blocks [d, end) of the request as a new run under the last block of ``parent``."""
    step = m.step
    k = end - d
    tk = plan.raw[d * step:end * step]
    slots = [[NO_SLOT] * k for _ in range(m.config.num_groups)]
    tiers = [[0] * k for _ in range(m.config.num_groups)]
    run = Run(parent, tk, tk[:step], plan.keys[d:end], slots, tiers)
    parent.add_child(run)
    for gi, g in enumerate(groups):
        for j in range(k):
            _put(m, t, g, claimed[g].pop(), run, j, blocks[d + j - plan.local][gi])
            placed[g].append((run, j))


def _segments(blocks: list[tuple[Run, int]]) -> list[Segment]:
    out: list[Segment] = []
    for run, j in blocks:
        if out and out[-1][0] is run and out[-1][2] == j:
            out[-1] = (run, out[-1][1], j + 1)
        else:
            out.append((run, j, j + 1))
    return out
