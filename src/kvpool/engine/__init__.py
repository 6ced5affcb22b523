"""kvpool.engine: a continuous-batching engine for transformers causal LMs whose KV cache
lives only in a :class:`kvpool.KVCacheManager`'s pool tensors.

Needs the ``engine`` extra (transformers). ``Engine(model, tokenizer)`` or
``Engine.from_pretrained("smollm2")``; ``engine.generate(prompts, SamplingParams(...))`` or the
incremental ``add_request`` / ``step`` / ``abort`` for servers.
"""

from __future__ import annotations

from kvpool.engine.engine import Engine, RequestOutput
from kvpool.engine.sampling import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
