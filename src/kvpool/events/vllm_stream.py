"""A manager's event stream published in vLLM's format, whole blocks only, as vLLM does.

vLLM hashes and announces full blocks only: the token ids of its ``BlockStored`` events are
always a whole number of blocks, and consumers written for it (vLLM-aware routers) assume so.
kvpool's manager also commits a sequence's partial last block (to reuse it partially), and its
events announce it. :class:`VllmStreamEncoder` encodes a stream of kvpool events into vLLM
batches and, by default, leaves those partial blocks out *for their whole life*: out of the
stored event that brings one, and out of its later tier moves and its removal (which a stateless
:func:`~kvpool.events.vllm_msgpack.encode_vllm_batch` call cannot recognise), so that a consumer
never sees a removal or a move of a block it was never told about.

With ``partial_blocks=True`` everything goes out, partial blocks included: what kvpool's own
router needs to match a prompt's trailing partial block for a kvpool worker hashed with
TensorRT-LLM's algorithms (``v1_block_key``, ``v2_sha256``, ``v2_sha256_64``), or matched by
tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from kvpool.events.model import AllCleared, BlockHash, KVCacheEvent, Removed, Stored, Updated
from kvpool.events.vllm_encode import encode_vllm_batch, whole_blocks
from kvpool.validation import check_int

__all__ = ["VllmStreamEncoder"]


class VllmStreamEncoder:
    """Encodes one manager's successive event batches for a vLLM-format publisher.

    ``encode(events)`` returns the ZMQ payload of one batch (see
    :func:`~kvpool.events.vllm_msgpack.encode_vllm_batch` for the mapping). The partial blocks
    left out are remembered per layer group until their removal (or an all-cleared event), so
    the memory this takes is bounded by the partial blocks cached.
    """

    def __init__(
        self,
        block_size: int,
        *,
        partial_blocks: bool = False,
        sliding_window_groups: Collection[int] = (),
        data_parallel_rank: int | None = None,
        state_groups: Collection[int] = (),
    ) -> None:
        self.block_size = check_int("block_size", block_size, 1)
        self.partial_blocks = partial_blocks
        self._sliding = frozenset(sliding_window_groups)
        self._state = frozenset(state_groups)  # hybrid models: kind "mamba" (docs/hybrid.md)
        self._rank = data_parallel_rank
        self._left_out: set[tuple[int, BlockHash]] = set()  # (layer group, hash)

    def encode(self, events: Iterable[KVCacheEvent], ts: float | None = None) -> bytes:
        if not self.partial_blocks:
            events = [e for e in map(self._whole, events) if e is not None]
        return encode_vllm_batch(
            events, ts, self._rank, block_size=self.block_size,
            sliding_window_groups=self._sliding, partial_blocks=True, state_groups=self._state,
        )

    def _whole(self, event: KVCacheEvent) -> KVCacheEvent | None:
        """``event`` without the partial blocks (None when nothing of it is left)."""
        data = event.data
        group = event.layer_group_id
        left_out = self._left_out
        if isinstance(data, Stored):
            kept = whole_blocks(data, self.block_size)
            if len(kept.blocks) == len(data.blocks):
                return event
            left_out.update((group, b.block_hash) for b in data.blocks[len(kept.blocks):])
            return _with(event, kept) if kept.blocks else None
        if not left_out:
            return event
        if isinstance(data, Removed):
            keep = [i for i, h in enumerate(data.block_hashes) if (group, h) not in left_out]
            if len(keep) == len(data.block_hashes):
                return event
            left_out.difference_update((group, h) for h in data.block_hashes)
            if not keep:
                return None
            levels = data.cache_levels
            return _with(event, Removed(
                tuple(data.block_hashes[i] for i in keep),
                None if levels is None else tuple(levels[i] for i in keep),
            ))
        if isinstance(data, Updated):
            return None if (group, data.block_hash) in left_out else event
        if isinstance(data, AllCleared):
            left_out.clear()
        return event


def _with(event: KVCacheEvent, data: Stored | Removed) -> KVCacheEvent:
    return KVCacheEvent(event.event_id, data, event.window_size, event.layer_group_id,
                        event.hash_algo, event.attention_dp_rank)
