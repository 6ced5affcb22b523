"""Replay workloads: the requests a replay feeds to its simulated engines.

A :class:`Workload` is a name, a tuple of :class:`Request` sorted by arrival time, and a
JSON-able metadata dict saying where it came from. Two sources exist:

* :func:`load_mooncake` reads a Mooncake-format JSONL trace (one request per line with
  ``timestamp`` in ms, ``input_length``, ``output_length`` and ``hash_ids``) and synthesises
  token ids so that equal hash ids give equal token blocks;
* :func:`synthetic_workload` builds a deterministic multi-turn chat and agent workload
  (:class:`SyntheticParams` documents every knob).

Both are deterministic: the same inputs and seed give equal workloads (same tokens, same order).
Token ids are kept as ``array('I')`` (4 bytes a token): the conversation trace alone holds
145 M prompt tokens: 580 MB this way, several GB as lists of Python ints.

The pieces: :mod:`kvpool.replay.requests` (Request, Workload), :mod:`kvpool.replay.mooncake`
(traces) and :mod:`kvpool.replay.synthetic`; this module re-exports their public names.
"""

from __future__ import annotations

from kvpool.replay.mooncake import (
    BUILTIN_TRACES,
    DEFAULT_TOKENS_PER_HASH_ID,
    builtin_trace,
    hash_id_block,
    load_mooncake,
)
from kvpool.replay.requests import DEFAULT_VOCAB_SIZE, Request, Workload
from kvpool.replay.synthetic import SyntheticParams, generate_synthetic, synthetic_workload

__all__ = [
    "BUILTIN_TRACES",
    "DEFAULT_TOKENS_PER_HASH_ID",
    "DEFAULT_VOCAB_SIZE",
    "Request",
    "SyntheticParams",
    "Workload",
    "builtin_trace",
    "generate_synthetic",
    "hash_id_block",
    "load_mooncake",
    "synthetic_workload",
]
