"""Text to token ids for the router: ``/v1/completions`` prompts and ``/v1/chat/completions``
messages, tokenized as ``kvpool serve`` tokenizes them (a Hugging Face tokenizer and its chat
template), so the router routes by the ids the worker computes.

:class:`TextEncoder` wraps a loaded ``transformers`` tokenizer:

* :meth:`~TextEncoder.encode_prompt` is ``tokenizer.encode(prompt)`` (special tokens added as
  the tokenizer adds them: a BOS, for instance);
* :meth:`~TextEncoder.encode_chat` renders the chat template (``add_generation_prompt``) and
  encodes the text without adding special tokens: what ``tokenizer.apply_chat_template(...,
  tokenize=True)`` returns.

Encoding is cached by segment. A tokenizer first cuts a text at its added (special) tokens
and tokenizes the pieces between them independently; a chat template puts such tokens around
every message (``<|im_start|>``, ``<|im_end|>``, ...), so a long system prompt or the earlier
turns of a conversation are pieces that recur request after request. The encoder does the
same cut and keeps the ids of recent pieces (an LRU of :data:`SEGMENT_CACHE_BYTES` of text),
so only what is new in a request is tokenized. The cut is used only when it is exact: every
added token is matched literally (not normalized, no ``lstrip``/``rstrip``/``single_word``),
and a probe of mixed texts encodes to the same ids through the cut as through the tokenizer
(a pre-tokenizer that treats the first piece differently, such as Metaspace's ``first``, is
handled by keying the first piece apart). Otherwise every text goes through the tokenizer whole.
A piece not in the cache is encoded by the tokenizer, or, for a byte-level BPE tokenizer and
ASCII text, word by word from :class:`~kvpool.router.byte_words.ByteLevelWords` (the same ids
at a fraction of the cost: a new user message is mostly words seen before).

Thread-safe: the router calls it from a thread pool (:mod:`kvpool.router.text_requests`).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvpool.errors import InvalidArgumentError
from kvpool.router.byte_words import WORD_CACHE_WORDS, ByteLevelWords
from kvpool.router.chat_render import SKELETONS, SkeletonRenderer, contents_only_printed

__all__ = ["SEGMENT_CACHE_BYTES", "WORD_CACHE_SPEEDUP", "Plan", "TextEncoder"]

SEGMENT_CACHE_BYTES: Final = 64 << 20
"""What the segment cache may hold: its pieces' text plus a fixed cost per piece (their ids
take about as much again)."""
WORD_CACHE_SPEEDUP: Final = 8
"""About how much cheaper :class:`~kvpool.router.byte_words.ByteLevelWords` encodes a piece
than the tokenizer (measured 6-8x on SmolLM2's tokenizer, 16 to 512 tokens)."""
_ENTRY_OVERHEAD: Final = 200  # bytes a cached piece costs beyond its text (key, ids, links)
_PROBE_CHAT: Final = (
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there> {{ x }}"}),
    ({"role": "user", "content": ""}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "naïve café\n"}),
)
_PROBES: Final = (
    "Hello, world! 1234 the quick brown fox\n\n  jumps  over   the lazy dog.\t",
    " leading space, trailing space ",
    "naïve café — 東京 🚀 ÄÖÜ\r\nline",
    "",
)


_FIRST: Final = 0  # a piece at the start of its text
_AFTER: Final = 1  # a piece after an added token
_WHOLE: Final = 2  # a whole text, special tokens added (no cut)
_PLAIN: Final = 3  # a whole text without them (no cut)


def _u32(ids: Iterable[int]) -> bytes:
    return array("I", ids).tobytes()


@dataclass(frozen=True, slots=True)
class Plan:
    """A text cut into known ids (native u32 bytes) and pieces still to encode (``(text,
    mode)``), and the work left in characters the tokenizer must encode (an ASCII piece the
    word cache encodes counts :data:`WORD_CACHE_SPEEDUP` times less)."""

    parts: list[bytes | tuple[str, int]]
    work: int


class TextEncoder:
    """A tokenizer (``transformers``) with a segment cache; see the module docstring."""

    def __init__(self, tokenizer: Any, *, cache_bytes: int = SEGMENT_CACHE_BYTES,
                 max_skeletons: int = SKELETONS, max_words: int = WORD_CACHE_WORDS) -> None:
        self.tokenizer = tokenizer
        self.chat_template: str | None = getattr(tokenizer, "chat_template", None) or None
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._cache: OrderedDict[tuple[str, bool], bytes] = OrderedDict()
        self._cache_chars = 0
        self._cache_limit = cache_bytes
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._split: re.Pattern[str] | None = None
        self._special_ids: dict[str, bytes] = {}  # added token -> its id (u32 bytes)
        self._prefix = b""
        self._suffix = b""
        self._anchor = ""
        self._words: ByteLevelWords | None = None
        self.skeletons: SkeletonRenderer | None = None
        if self._backend is not None:
            self._words = ByteLevelWords.for_tokenizer(self._backend, max_words=max_words)
            self._prepare_cut()
        self._max_skeletons = max_skeletons
        self._render = self._fast_renderer()

    @property
    def segmented(self) -> bool:
        """Whether texts are cut at added tokens and their pieces cached (the cut is exact
        for this tokenizer)."""
        return self._split is not None

    # ------------------------------------------------------------------------------ encoding

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completion prompt's ids, special tokens added (``tokenizer.encode(prompt)``)."""
        return self.finish(self.prepare_prompt(prompt)).tolist()

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The chat template's rendering of ``messages`` (with the generation prompt), encoded
        without added special tokens; InvalidArgumentError when the tokenizer has no chat
        template or the template refuses the messages."""
        return self.finish(self.prepare_chat(messages)).tolist()

    # An encoding in two steps: :meth:`prepare_prompt` / :meth:`prepare_chat` render the text,
    # cut it and look its pieces up (cheap: C-speed string work and dict lookups), leaving
    # :attr:`Plan.work` characters to encode; :meth:`finish` encodes those (the costly part,
    # which the router runs in its thread pool when it is large). Ids are kept and joined as
    # native u32 bytes (one bytes.join, no int objects touched) into the u32 array the router
    # routes by.

    def prepare_prompt(self, prompt: str) -> Plan:
        if self._split is None:
            return Plan([(prompt, _WHOLE)], len(prompt))
        return self._plan(prompt, self._prefix, self._suffix)

    def prepare_chat(self, messages: Sequence[Mapping[str, str]]) -> Plan:
        """As :meth:`encode_chat`, to be finished by :meth:`finish`."""
        if self.chat_template is None:
            raise InvalidArgumentError(
                "the served model's tokenizer has no chat template: use /v1/completions or "
                "send 'prompt_token_ids'"
            )
        try:
            text = self._render(messages)
        except Exception as exc:  # the template is user data; its errors are the request's
            raise InvalidArgumentError(
                f"the chat template refused these messages: {exc}"
            ) from None
        if self._split is None:
            return Plan([(text, _PLAIN)], len(text))
        return self._plan(text, b"", b"")

    def finish(self, plan: Plan) -> array[int]:
        """The ids of a prepared text (a u32 array): its pieces looked up, the missing ones
        encoded (and cached)."""
        done: list[bytes] = []
        for part in plan.parts:
            if isinstance(part, bytes):
                done.append(part)
                continue
            text, mode = part
            if mode == _WHOLE:
                done.append(_u32(self.tokenizer.encode(text)))
            elif mode == _PLAIN:
                done.append(_u32(self.tokenizer.encode(text, add_special_tokens=False)))
            else:
                done.append(self._encode_cached(text, mode == _FIRST))
        out = array("I")
        out.frombytes(b"".join(done))
        return out

    def _slow_render(self, messages: Sequence[Mapping[str, str]]) -> str:
        text: str = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False)
        return text

    def _fast_renderer(self) -> Callable[[Sequence[Mapping[str, str]]], str]:
        """The chat template rendered by its compiled jinja template directly, with the
        arguments ``apply_chat_template`` passes (its per-call copying of the messages costs
        more than the rendering); used only when it renders the probes as that does."""
        slow = self._slow_render
        if self.chat_template is None:
            return slow
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.chat_template)
        except Exception:  # another transformers: its own path
            return slow
        extra = {str(k): v for k, v in self.tokenizer.special_tokens_map.items()}

        def fast(messages: Sequence[Mapping[str, str]]) -> str:
            text: str = compiled.render(messages=[dict(m) for m in messages], tools=None,
                                        documents=None, add_generation_prompt=True, **extra)
            return text

        try:
            if not all(fast(p) == slow(p) for p in _PROBE_CHAT):
                return slow
        except Exception:  # a template that refuses the probes: keep transformers' path
            return slow
        if not contents_only_printed(compiled.environment, self.chat_template):
            return fast
        self.skeletons = SkeletonRenderer(fast, max_skeletons=self._max_skeletons)
        try:
            if all(self.skeletons.render(p) == slow(p) for p in _PROBE_CHAT):
                return self.skeletons.render
        except Exception:  # cannot be: the same render
            pass
        self.skeletons = None
        return fast

    # ------------------------------------------------------------------------------ the cut

    def _prepare_cut(self) -> None:
        added = self._backend.get_added_tokens_decoder()
        plain: dict[str, int] = {}
        for token_id, tok in added.items():
            if tok.normalized or tok.lstrip or tok.rstrip or tok.single_word:
                return  # matched in ways a literal cut does not reproduce
            plain[tok.content] = int(token_id)
        if not plain:
            self._split = re.compile(r"(?!)")  # matches nothing: one piece per text
        else:  # longest first: the tokenizer matches the longest added token at a position
            alternatives = sorted(plain, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self._special_ids = {token: _u32((i,)) for token, i in plain.items()}
        self._anchor = next(iter(plain), "")
        probe = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        at = _find(full, probe)
        if at < 0:
            self._split = None
            return
        self._prefix, self._suffix = _u32(full[:at]), _u32(full[at + len(probe):])
        specials = list(plain)[:3]
        mixed = "".join(f"{p}{s}" for p, s in zip(_PROBES, specials * 2, strict=False))
        samples = [*_PROBES, mixed]
        for text in samples:
            if (self._pieces(text) != list(self.tokenizer.encode(
                    text, add_special_tokens=False))
                    or self.encode_prompt(text) != list(self.tokenizer.encode(text))):
                self._split = None
                return

    def _plan(self, text: str, prefix: bytes, suffix: bytes) -> Plan:
        assert self._split is not None
        parts: list[bytes | tuple[str, int]] = [prefix] if prefix else []
        special = self._special_ids
        cache = self._cache
        work = 0
        first = True
        words = self._words is not None
        with self._lock:
            for i, piece in enumerate(self._split.split(text)):
                if i % 2:  # an added token
                    parts.append(special[piece])
                    first = False
                    continue
                if not piece:
                    continue
                ids = cache.get((piece, first))
                if ids is not None:
                    cache.move_to_end((piece, first))
                    self.hits += 1
                    parts.append(ids)
                else:
                    parts.append((piece, _FIRST if first else _AFTER))
                    work += (len(piece) // WORD_CACHE_SPEEDUP if words and piece.isascii()
                             else len(piece))
                first = False
        if suffix:
            parts.append(suffix)
        return Plan(parts, work)

    def _pieces(self, text: str) -> list[int]:
        """``text`` cut and encoded piece by piece, without the cache (the load-time probe)."""
        plan = self._plan(text, b"", b"")
        out = array("I")
        for part in plan.parts:
            if isinstance(part, bytes):
                out.frombytes(part)
            else:
                out.frombytes(self._encode_piece(part[0], part[1] == _FIRST))
        return out.tolist()

    def _encode_cached(self, piece: str, first: bool) -> bytes:
        key = (piece, first)
        ids = self._encode_piece(piece, first)
        with self._lock:
            self.misses += 1
            if key not in self._cache:
                self._cache[key] = ids
                self._cache_chars += len(piece) + _ENTRY_OVERHEAD
                while self._cache_chars > self._cache_limit and self._cache:
                    (old, _), _ids = self._cache.popitem(last=False)
                    self._cache_chars -= len(old) + _ENTRY_OVERHEAD
        return ids

    def _encode_piece(self, piece: str, first: bool) -> bytes:
        if self._words is not None:  # byte-level BPE: a piece's ids do not depend on its place
            ids = self._words.encode_u32(piece)
            if ids is not None:
                return ids
        if first:
            return _u32(self._encode_plain(piece))
        # not the first piece: encode it after an added token, as it sits in the whole text
        return _u32(self._encode_plain(self._anchor + piece)[1:])

    def _encode_plain(self, text: str) -> list[int]:
        # encode, not encode_batch_fast: the batch call hands one text to rayon's threads,
        # which costs about 3.5x the CPU (measured: 437 against 124 us for 64 tokens)
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids


def _find(haystack: Sequence[int], needle: Sequence[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if list(haystack[i:i + n]) == list(needle):
            return i
    return -1
