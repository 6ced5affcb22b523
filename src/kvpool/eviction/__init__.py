"""Free queues of evictable blocks: which cached, unreferenced slot to give up next.

One policy object serves one (tier, layer group) pool. The manager tells it when a cached
block becomes evictable (``push``, with the block's key so a policy can keep history across
slot reuse), when it is claimed again (``remove``: a hit, or the block is dropped with an
evicted ancestor), and asks it for victims (``pop``) and whether the victim just popped
deserves a colder tier (``should_offload``).

Rules every policy keeps:

- Retention priority dominates: a victim comes from the lowest non-empty priority level; the
  policy orders blocks only within a level. A priority pushed with an expiry falls back to the
  default (35) once that time has passed (the block keeps its place in the policy's order
  class, at the most recent end).
- ``push`` of a slot already queued raises :class:`InvalidArgumentError` before any state
  changes; ``remove`` needs a queued slot (``KeyError`` otherwise, nothing changed); ``pop``
  on an empty queue raises :class:`IndexError`.

Policies (``POLICIES``, named in ``EVICTION_POLICIES``, chosen by
``CacheConfig(eviction=EvictionConfig(policy=...))``):

``lru``
    :class:`PrioritizedLRU`: least recently released first, no history (every engine's
    policy, and the cheapest).
``2q`` (the default), ``s3fifo``, ``arc``
    Scan-resistant policies (:class:`TwoQueue`, :class:`S3FIFO`, :class:`ARC`) built on
    :class:`SegmentedPolicy`: each level has a *recent* segment (blocks released once) and a
    *frequent* segment (blocks released again: hit while cached, or recomputed while their
    key was still in the ghost history). They differ in how the two segments share the
    level: a fixed 25% for the recent FIFO (2Q, Johnson & Shasha 1994), a 10% small FIFO and
    a main FIFO that gives frequently used blocks extra laps (S3-FIFO, Yang et al. 2023), or
    a share adapted from ghost hits (ARC, Megiddo & Modha 2003).

Prefix trees. The manager drops a full-attention block's queued descendants with it, so a
good victim is the tail of a chain. The manager pushes a released sequence's blocks tail
first, and the policies keep that: a segment gives its blocks in push order, and
``push_many`` raises each block's count to the highest count listed before it in the call (a
parent is used at least as often as its child), so the head of a released chain is never in a
worse segment than its tail. A parent released on its own, after frequent children (another
sequence held it longer), can still be a victim before them; they then go with it.

Cost. Every queue is a :class:`~kvpool.eviction.queue.LevelQueue`: per priority level two
lazy FIFOs (``fifo.py``: a push appends its slots as one batch and stores one stamp per slot
in a list indexed by slot; a claim only changes its slot's stamp, the entry left behind is
dead, skipped later, compacted away once dead entries outnumber live ones; victims are cut
from the oldest batch a slice at a time). So a block costs a few list stores per push, claim
and eviction, and the scan-resistant policies add their history's dict work (a lookup per
new key, an insert per victim).

Modules, bottom up: ``fifo`` (one lazy FIFO and its operations), ``queue`` (priority levels
of FIFOs, expiry, compaction: the base of every policy), ``history`` (the key history),
``lru``, ``segmented`` (the scan-resistant base), ``policies`` (2Q, S3-FIFO, ARC, the
registry, the factories), ``protocol`` (what the manager relies on).
"""

from kvpool.eviction.history import DEFAULT_GHOST_MULTIPLE, KeyHistory
from kvpool.eviction.lru import PrioritizedLRU
from kvpool.eviction.policies import ARC, POLICIES, S3FIFO, TwoQueue, make_policies, make_policy
from kvpool.eviction.protocol import EvictionPolicy
from kvpool.eviction.queue import LevelQueue
from kvpool.eviction.segmented import SegmentedPolicy

__all__ = [
    "ARC",
    "DEFAULT_GHOST_MULTIPLE",
    "POLICIES",
    "S3FIFO",
    "EvictionPolicy",
    "KeyHistory",
    "LevelQueue",
    "PrioritizedLRU",
    "SegmentedPolicy",
    "TwoQueue",
    "make_policies",
    "make_policy",
]
