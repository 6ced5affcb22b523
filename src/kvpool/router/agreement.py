"""A choice replicas agree on although their load views lag (``agree_margin`` of
:class:`~kvpool.router.scoring.Router`; router replicas on NATS, ``docs/router.md``).

Replicas share their in-flight state over NATS (:mod:`kvpool.router.nats_inflight`), but an
announcement takes a moment to arrive: at any instant two replicas' queued prefill per worker
may differ by a request or two, and their predictions by the requests routed meanwhile. With
``cost``'s plain rule (lowest cost; ties to the fewest unfinished requests, then a rotation
kept per router) such differences flip close comparisons, and each replica's rotation is its
own: the same request goes to different workers.

The rule here: every candidate whose score is within ``margin`` cost tokens of the best is
*near the best*; among those the request picks by rendezvous hashing on its tie key (its first
block key: requests of one prefix agree on their worker everywhere, and different prefixes
spread over the near-best workers). A load difference smaller than the margin changes nothing
unless it moves a candidate across the margin's edge; the winner then is the same on every
replica unless the views differ across that edge. The margin also keeps a prefix's requests on
one worker until its load is ``margin`` cost tokens above another's (hysteresis by hashing).
Saturated workers are left out as in ``cost`` mode.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence
from functools import lru_cache
from typing import Final

from kvpool.router.decision import CandidateScore
from kvpool.router.index import GroupKey

__all__ = ["DEFAULT_AGREE_MARGIN", "agreed_choice", "rendezvous_weight", "request_tie_key"]

DEFAULT_AGREE_MARGIN: Final = 32.0
"""Router replicas' margin (``bus: nats``): two blocks of 16 tokens, or about three queued
requests' difference at ``load_weight`` 0.02 and 512 prefill tokens each."""

_M64: Final = (1 << 64) - 1


def request_tie_key(group_keys: dict[GroupKey, list[int]], toks: array[int]) -> int:
    """The request's first block key (of the first hashing group with a whole block), else a
    CRC of its token ids: the same on every replica."""
    for keys in group_keys.values():
        if keys:
            return keys[0] & _M64
    return zlib.crc32(toks.tobytes())


@lru_cache(maxsize=4096)
def _worker_seed(worker_id: str) -> int:
    return zlib.crc32(worker_id.encode()) * 0x9E3779B97F4A7C15 & _M64


def rendezvous_weight(key: int, worker_id: str) -> int:
    """A 64-bit weight of (key, worker), the same in every process (splitmix64's finalizer)."""
    z = (key ^ _worker_seed(worker_id)) & _M64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
    return z ^ (z >> 31)


def agreed_choice(cands: Sequence[CandidateScore], margin: float, tie_key: int) -> int:
    """The index of the candidate to route to: among the unsaturated ones (all, when every
    one is saturated) within ``margin`` of the best score, the highest rendezvous weight."""
    eligible = [i for i, c in enumerate(cands) if not c.saturated] or list(range(len(cands)))
    best = max(cands[i].score for i in eligible)
    near = [i for i in eligible if cands[i].score >= best - margin]
    if len(near) == 1:
        return near[0]
    return max(near, key=lambda i: rendezvous_weight(tie_key, cands[i].worker_id))
