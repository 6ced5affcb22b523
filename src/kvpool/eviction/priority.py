"""Retention priorities and offload gates: the values requests and policies share.

A block's retention priority is an int in ``[MIN_PRIORITY, MAX_PRIORITY]``; blocks with no
priority of their own have ``DEFAULT_PRIORITY`` (TensorRT-LLM's default, 35). The offload gate
says which eviction victims may go down a tier. :mod:`kvpool.config` validates requests against
these, and events carry the priority a block was stored with.
"""

from __future__ import annotations

DEFAULT_PRIORITY = 35
MIN_PRIORITY = 0
MAX_PRIORITY = 100
OFFLOAD_GATES: tuple[str, ...] = ("all", "reused")
"""``CacheConfig.eviction.offload_gate`` values: every victim may go down a tier, or only reused
ones."""
