"""``POST /query``: each worker's cached prefix of a request, per tier, in the shape of Mooncake
RFC #1403 as Dynamo's standalone indexer answers it (docs/router.md lists every field).

Request (one of ``token_ids``, ``prompt``, ``messages``; the text forms are tokenized as in
proxy mode, :mod:`kvpool.router.text_requests`)::

    {"token_ids": [...], "model_name"?: str, "tenant_id"?: str, "lora_name"?: null,
     "cache_salt"?: str}

Answer::

    {"scores": {"<worker>": {"0": <gpu tokens>}},          # device tier, per DP rank
     "frequencies": [<workers holding block i on device>, ...],
     "instances": {"<worker>": {"longest_matched": n, "gpu": n, "dp": {"0": n},
                                "cpu": n, "disk": n, "shared": n}},
     "prompt_tokens": n}

Counts are tokens: matched blocks × the worker's tokens per block, at most the tokens the
blocks cover (the prompt minus its last token). Tier counts are cumulative, as Dynamo's:
``gpu`` is the prefix held on the device, ``cpu`` the prefix held on device or host, ``disk``
on any local tier, ``shared`` (kvpool's) also counting blocks the worker can read from its
shared remote tier; so ``gpu <= cpu <= disk <= shared`` and ``longest_matched`` is their
maximum. Every registered worker whose hashing is known is listed, healthy or not. The
counts are what the workers' events say: the router's predictions of blocks on their way are
not in them. ``frequencies`` has one entry per block of the longest device-tier match:
how many workers hold it there. kvpool workers have one DP rank, ``"0"``.

``model_name`` and ``tenant_id`` are accepted and not used (one router, one model); a
``lora_name`` is refused (kvpool's block hashes carry no adapter).
"""

from __future__ import annotations

from array import array
from typing import Any, Final

import msgspec

from kvpool.errors import InvalidArgumentError
from kvpool.router.index import TIERS
from kvpool.router.request_keys import request_keys
from kvpool.router.scoring import Router

__all__ = ["QueryBody", "query"]

_LEVELS: Final = ("gpu", "cpu", "disk", "shared")


class QueryBody(msgspec.Struct):
    """A ``/query`` body."""

    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    model_name: str | None = None
    tenant_id: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None

    def check(self) -> None:
        if self.lora_name is not None:
            raise InvalidArgumentError(
                "lora_name: kvpool's block hashes carry no LoRA adapter; leave it out"
            )


def query(router: Router, tokens: array[int], cache_salt: str | None) -> dict[str, Any]:
    """The ``/query`` answer for validated u32 ``tokens``."""
    if not tokens:
        raise InvalidArgumentError("token_ids must not be empty")
    index = router.index
    stride = index.stride
    masks = index.masks
    shared = router.shared.masks
    covered = max(len(tokens) - 1, 0)
    instances: dict[str, dict[str, Any]] = {}
    scores: dict[str, dict[str, int]] = {}
    device_runs: list[int] = []
    for (scheme, tpb), gmask in index.groups().items():
        keys = request_keys(scheme, tpb, tokens, cache_salt)
        for slot, runs in _runs(keys, gmask, stride, masks, shared).items():
            worker = index.worker_at(slot)
            if worker is None:
                continue
            device_runs.append(runs[0])
            counts = [min(n * tpb, covered) for n in runs]
            entry = {"longest_matched": max(counts), "gpu": counts[0], "dp": {"0": counts[0]}}
            entry.update(zip(_LEVELS[1:], counts[1:], strict=True))
            instances[worker] = entry
            scores[worker] = {"0": counts[0]}
    longest = max(device_runs, default=0)
    frequencies = [sum(1 for r in device_runs if r > i) for i in range(longest)]
    return {"scores": scores, "frequencies": frequencies, "instances": instances,
            "prompt_tokens": len(tokens)}


def _runs(keys: list[int], gmask: int, stride: int, masks: dict[int, int],
          shared: dict[int, int]) -> dict[int, list[int]]:
    """Per slot of ``gmask``: the leading blocks held on the device, on device or host, on
    any local tier, and on any tier or a shared remote tier it reads."""
    slots = []
    m = gmask
    while m:
        low = m & -m
        slots.append(low.bit_length() - 1)
        m ^= low
    runs = {s: [0, 0, 0, 0] for s in slots}
    open_levels = {s: 0 for s in slots}  # levels 0..3 still extending: lowest open level
    for key in keys:
        if not open_levels:
            break
        mask = masks.get(key, 0)
        readers = shared.get(key, 0)
        for slot in list(open_levels):
            hottest = next((t for t in range(TIERS) if (mask >> (t * stride + slot)) & 1),
                           TIERS if (readers >> slot) & 1 else TIERS + 1)
            level = open_levels[slot]
            # the block extends every level at or above its hottest tier that is still open
            first = max(level, hottest)
            if first > TIERS:
                del open_levels[slot]
                continue
            run = runs[slot]
            for lv in range(first, TIERS + 1):
                run[lv] += 1
            if hottest > level:  # the levels below its tier stop here
                open_levels[slot] = hottest
    return runs
