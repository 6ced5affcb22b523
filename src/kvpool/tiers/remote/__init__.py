"""The shared remote tier: blocks in a Redis- or Valkey-compatible store, below disk.

Layered bottom-up, each module using only those above it in this list:

- :mod:`~kvpool.tiers.remote.namespace`: which engines may share bytes, and a block's remote key;
- :mod:`~kvpool.tiers.remote.codec`: the verified value format (header + raw block bytes);
- :mod:`~kvpool.tiers.remote.store`: batched, pipelined reads and writes on a server or a cluster,
  with typed failures and a reconnection backoff (redis-py, the ``remote`` extra;
  :mod:`~kvpool.tiers.remote.resp` reads its ``MGET`` replies);
- :mod:`~kvpool.tiers.remote.memory`: an in-process store with the server's LRU-by-bytes behaviour;
- :mod:`~kvpool.tiers.remote.writer`: write-behind off the scheduler thread;
- :mod:`~kvpool.tiers.remote.tier`: what a manager calls: offload a block, fetch the longest
  resident continuation of a chain.

The manager's use of them (``CacheConfig.remote``, ``prefetch``) comes next.
"""

from kvpool.tiers.remote.codec import ValueCodec
from kvpool.tiers.remote.memory import MemoryStore
from kvpool.tiers.remote.namespace import RemoteNamespace, ScopeNamespace
from kvpool.tiers.remote.store import BlockStore, RemoteStore
from kvpool.tiers.remote.tier import RemoteTier
from kvpool.tiers.remote.writer import REMOTE_WRITE_MODES, RemoteWriter

__all__ = [
    "REMOTE_WRITE_MODES",
    "BlockStore",
    "MemoryStore",
    "RemoteNamespace",
    "RemoteStore",
    "RemoteTier",
    "RemoteWriter",
    "ScopeNamespace",
    "ValueCodec",
]
