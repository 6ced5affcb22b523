"""The OpenAI completions and chat-completions wire format: request bodies in (validated into
a prompt of token ids and :class:`~kvpool.engine.SamplingParams`), responses and SSE chunks
out. Used by :mod:`kvpool.engine.server`; no I/O here.

Every invalid body is an :class:`~kvpool.errors.InvalidArgumentError` whose message names the
field, so the server answers 400 with it; a ``model`` the server does not serve is an
:class:`UnknownModelError` (OpenAI's 404 ``model_not_found``). A chat message's ``role`` is one
of :data:`CHAT_ROLES` (``tool`` is not: kvpool serve takes no tools).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.engine.engine import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import InvalidArgumentError
from kvpool.httpserve.messages import chat_messages
from kvpool.validation import is_int

__all__ = ["CHAT_ROLES", "Answer", "ParsedRequest", "UnknownModelError", "parse_request"]

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")

_UNSUPPORTED = ("logprobs", "echo", "best_of", "suffix", "tools", "functions", "logit_bias")
_DEFAULT_COMPLETION_TOKENS = 16


@dataclass(slots=True)
class ParsedRequest:
    prompt: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False


class UnknownModelError(InvalidArgumentError):
    """The request names a model this server does not serve."""


def parse_request(body: object, *, chat: bool, tokenizer: Any, max_model_len: int,
                  cache_tokens: int | None = None,
                  models: Collection[str] | None = None) -> ParsedRequest:
    """Validate a request body and turn it into token ids and sampling parameters.

    ``models``: the names a request's ``model`` may give (None: any); a request without
    ``model`` is for the served one.

    A chat request without ``max_tokens`` may generate up to the model's length, or up to
    ``cache_tokens`` (the most tokens one request's KV fits in) when that is smaller.

    Raises:
        InvalidArgumentError: the body is not an object, a field has the wrong type or value,
            the prompt is empty or leaves no room to generate within ``max_model_len``.
        UnknownModelError: ``model`` is not one of ``models``.
    """
    if not isinstance(body, Mapping):
        raise InvalidArgumentError("the request body must be a JSON object")
    _check_model(body.get("model"), models)
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], {}):
            raise InvalidArgumentError(f"{name!r} is not supported by kvpool serve")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise InvalidArgumentError(f"'n' must be 1 (one choice per request), got {n!r}")
    prompt = _prompt(body, chat=chat, tokenizer=tokenizer)
    room = max_model_len - len(prompt)
    if room < 1:
        raise InvalidArgumentError(
            f"the prompt has {len(prompt)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens, which leaves no room to generate"
        )
    max_tokens = body.get("max_tokens")
    if chat and max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        limit = room
        if cache_tokens is not None and cache_tokens > len(prompt):
            limit = min(room, cache_tokens - len(prompt))
        max_tokens = limit if chat else min(limit, _DEFAULT_COMPLETION_TOKENS)
    elif is_int(max_tokens) and max_tokens >= 1 and len(prompt) + max_tokens > max_model_len:
        raise InvalidArgumentError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt)} and max_tokens asks for {max_tokens} more"
        )
    stop = body.get("stop")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_or(body.get("temperature"), 1.0),
        top_p=_or(body.get("top_p"), 1.0),
        top_k=_top_k(body.get("top_k")),
        seed=body.get("seed"),
        stop=() if stop is None else stop,
        stop_token_ids=body.get("stop_token_ids") or (),
        ignore_eos=body.get("ignore_eos", False),
    )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidArgumentError(f"'stream' must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise InvalidArgumentError(f"'stream_options' must be an object, got {options!r}")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidArgumentError(
            f"'stream_options.include_usage' must be true or false, got {include_usage!r}"
        )
    return ParsedRequest(prompt, params, stream, include_usage)


def _check_model(model: object, models: Collection[str] | None) -> None:
    if model is None or models is None:
        return
    if not isinstance(model, str):
        raise InvalidArgumentError(f"'model' must be a string, got {type(model).__name__}")
    if model not in models:
        names = ", ".join(repr(m) for m in models)
        raise UnknownModelError(
            f"the model {model!r} does not exist on this server; it serves {names}"
        )


def _prompt(body: Mapping[str, Any], *, chat: bool, tokenizer: Any) -> list[int]:
    ids = body.get("prompt_token_ids")
    if ids is not None:
        return _token_ids(ids, "prompt_token_ids")
    if chat:
        return _chat_prompt(body.get("messages"), tokenizer)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("'prompt' is empty")
        if tokenizer is None:
            raise InvalidArgumentError(
                "this model has no tokenizer: send 'prompt' as a list of token ids"
            )
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise InvalidArgumentError("'prompt' encodes to no tokens")
        return ids
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt")
    raise InvalidArgumentError(
        f"'prompt' must be a string or a list of token ids (one prompt per request), "
        f"got {type(prompt).__name__}"
    )


def _chat_prompt(messages: object, tokenizer: Any) -> list[int]:
    clean = chat_messages(messages, CHAT_ROLES)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidArgumentError(
            "this model has no chat template: use /v1/completions or send 'prompt_token_ids'"
        )
    try:
        encoded = tokenizer.apply_chat_template(clean, add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
    except Exception as exc:  # the template is user data; its errors are the request's
        raise InvalidArgumentError(f"the chat template refused these messages: {exc}") from None
    return list(encoded["input_ids"])


def _token_ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list):
        raise InvalidArgumentError(f"'{name}' must be a list of token ids")
    if not value:
        raise InvalidArgumentError(f"'{name}' is empty")
    if not all(is_int(t) and 0 <= t < 2**31 for t in value):
        raise InvalidArgumentError(f"'{name}' must hold token ids (ints in [0, 2**31))")
    return list(value)


def _top_k(value: object) -> Any:
    if value is None or value == -1:  # vLLM spells "no top-k" -1
        return 0
    return value


def _or(value: object, default: float) -> Any:
    return default if value is None else value


@dataclass(slots=True)
class Answer:
    """Builds one request's response objects; tracks the text already streamed.

    While a request runs, the last characters of its text are held back as long as they could
    still become a stop string or are an incomplete UTF-8 character, so a streamed text never
    has to be taken back.
    """

    request_id: str
    model: str
    chat: bool
    created: int
    request: ParsedRequest
    sent: int = 0
    role_sent: bool = False
    _holdback: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        stops = self.request.params.stop
        self._holdback = max((len(s) for s in stops), default=1) - 1

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        prompt = len(out.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(out.token_ids),
            "total_tokens": prompt + len(out.token_ids),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }

    def full(self, out: RequestOutput) -> dict[str, Any]:
        text = out.text or ""
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason,
                                  "token_ids": list(out.token_ids)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["logprobs"] = None
        return {"id": self.request_id, "object": "chat.completion" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(out)}

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        """The SSE chunk for this step's progress, None when there is nothing to send."""
        text = out.text or ""
        end = len(text)
        if not out.finished:
            end = max(self.sent, end - self._holdback)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        if not delta and not out.finished and (self.role_sent or not self.chat):
            return None
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason}
        if self.chat:
            d: dict[str, Any] = {"content": delta}
            if not self.role_sent:
                d["role"] = "assistant"
                self.role_sent = True
            choice["delta"] = d
        else:
            choice["text"] = delta
            choice["logprobs"] = None
        return self._envelope([choice])

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        chunk = self._envelope([])
        chunk["usage"] = self.usage(out)
        return chunk

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
