"""Per-sequence state: tokens, beams, block tables per layer group, retention, hashing."""

from __future__ import annotations

from array import array

from kvpool.config import RetentionConfig
from kvpool.core.radix import Run, SlotId
from kvpool.hashing.keys import BlockKey


class Sequence:
    """One admitted request's KV.

    ``tables[g][b]`` is beam b's block table in layer group g: GPU slot ids in block order,
    ``-1`` for a block a sliding window released (or never needed). Every table entry holds one
    reference on its slot. ``tokens`` are beam 0's tokens (the ones committed for reuse).
    """

    __slots__ = (
        "at_len", "at_run", "beam_width", "cache_salt", "committed_blocks", "committed_floor",
        "encoder_tokens", "keys", "lora_id", "moved", "own_run", "prompt_len", "retention",
        "root", "root_key", "seq_id", "suspended", "tables", "tokens",
    )

    def __init__(
        self,
        seq_id: int | str,
        tokens: array[int],
        beam_width: int,
        keys: list[BlockKey],
        root: Run,
        root_key: BlockKey,
        tables: list[list[list[SlotId]]],
        *,
        lora_id: int | None,
        cache_salt: str | None,
        retention: RetentionConfig | None,
        encoder_tokens: array[int] | None,
    ) -> None:
        self.seq_id = seq_id
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.beam_width = beam_width
        self.keys = keys  # keys of the first full blocks (matched, then committed)
        self.root = root
        self.root_key = root_key
        self.tables = tables
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        self.retention = retention
        self.encoder_tokens = encoder_tokens
        self.committed_blocks = 0
        # where the committed blocks end in the tree: after block ``at_len`` - 1 of ``at_run``
        # (a hint: checked against ``keys`` before use, since a split or an eviction may move
        # or drop those blocks)
        self.at_run = root
        self.at_len = 0
        self.own_run: Run | None = None  # the run this sequence's last commit created/extended
        self.committed_floor = len(tokens)  # rewind_tokens never goes below this
        self.suspended = False
        # while suspended: (group, old GPU slot) -> (tier, slot, table positions (beam, index))
        self.moved: dict[tuple[int, SlotId], tuple[int, SlotId, list[tuple[int, int]]]] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)
