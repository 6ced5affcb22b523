"""The engine: requests in, tokens out, one scheduler step at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.engine.sampling import SamplingParams
from kvpool.manager import KVCacheManager


@dataclass(slots=True)
class RequestOutput:
    """A request's progress after one step (``new_token_ids``) and in total (``token_ids``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str | None
    cached_tokens: int
    finish_reason: str | None
    finished: bool
    logits: list[torch.Tensor] | None = None


class Engine:
    """A continuous-batching engine over one transformers causal LM (single-threaded)."""

    def __init__(self, model: Any, tokenizer: Any = None, *, cache: dict[str, Any] | None = None,
                 max_batch_size: int = 8, max_num_tokens: int = 2048) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = 0
        self.manager: KVCacheManager
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kw: Any) -> Engine:
        from kvpool.engine.models import load_model  # type: ignore[import-not-found]

        model, tokenizer = load_model(name_or_path)
        return cls(model, tokenizer, **kw)

    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams) -> None:
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        raise NotImplementedError

    def generate(self, prompts: Sequence[list[int] | str],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        raise NotImplementedError
