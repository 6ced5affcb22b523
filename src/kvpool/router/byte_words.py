"""Byte-level BPE encoding word by word, from a cache of words already seen.

A byte-level BPE tokenizer (GPT-2's scheme, used by SmolLM2, Llama 3, Qwen, ...) encodes a text
in three independent steps: a regular expression cuts it into words (a letter run with its
leading space, a digit run, a punctuation run, whitespace), each word's bytes are mapped to
printable characters, and the BPE model merges each word on its own. So a word's ids never
depend on its neighbours, and a word once encoded can be looked up: text a router sees repeats
its words far more than it invents new ones. Hugging Face ``tokenizers`` spends about 2 µs per
token of a request on the cut and the bookkeeping of its ``Encoding`` (offsets, masks); a word
cache does the cut with Python's ``re`` (C speed) and one dict lookup per word.

:class:`ByteLevelWords` is that cache. It is used only where it gives exactly the tokenizer's
ids:

* the tokenizer has no normalizer, a ``ByteLevel`` pre-tokenizer with GPT-2's expression and
  no prefix space, and a BPE model without dropout (read from its serialized form);
* the text is ASCII (:meth:`ByteLevelWords.encode` answers ``None`` otherwise, and the caller
  uses the tokenizer): for ASCII the expression's Unicode classes (letters, digits, white
  space) are the plain ASCII ones, so ``re`` cuts exactly where the tokenizer cuts.

Added (special) tokens are not its business: the caller cuts them out first
(:mod:`kvpool.router.tokenize`), as the tokenizer itself does before the pre-tokenizer runs.
The property tests compare it with the tokenizer on random texts.
"""

from __future__ import annotations

import json
import re
import threading
from itertools import chain
from typing import Any, Final

__all__ = ["WORD_CACHE_WORDS", "ByteLevelWords"]

WORD_CACHE_WORDS: Final = 1 << 20
"""Words kept (about 150 MB at most); when full, the cache starts again empty."""

# GPT-2's expression with its Unicode classes written for ASCII: \p{L} -> [A-Za-z],
# \p{N} -> [0-9], \s -> the six ASCII white-space characters (re.ASCII).
_WORDS: Final = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""",
    re.ASCII,
)


def _byte_chars() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters, for the ASCII bytes."""
    printable = [*range(ord("!"), ord("~") + 1)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(128):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_ASCII_TO_BYTE_LEVEL: Final = str.maketrans(_byte_chars())


class ByteLevelWords:
    """A word -> ids cache over a byte-level BPE model; see the module docstring."""

    def __init__(self, model: Any, *, max_words: int = WORD_CACHE_WORDS) -> None:
        self._model = model
        self._cache: dict[str, list[int]] = {}
        self._max = max_words
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, backend: Any) -> ByteLevelWords | None:
        """The cache for a ``tokenizers.Tokenizer``, or None when its pipeline is not plain
        byte-level BPE (then only the tokenizer gives its ids)."""
        try:
            spec = json.loads(backend.to_str())
        except Exception:  # not a tokenizers.Tokenizer
            return None
        pre = spec.get("pre_tokenizer") or {}
        model = spec.get("model") or {}
        if (spec.get("normalizer") is not None
                or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space")
                or not pre.get("use_regex", True)
                or model.get("type") != "BPE" or model.get("dropout") is not None
                or model.get("byte_fallback")):
            return None
        return cls(backend.model)

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids (no added tokens in it), or None when ``text`` is not ASCII."""
        if not text.isascii():
            return None
        words = _WORDS.findall(text)
        try:
            return list(chain.from_iterable(map(self._cache.__getitem__, words)))
        except KeyError:  # a word not seen yet (or the cache just started again)
            cache = self._cache
            out: list[int] = []
            for word in words:
                out += cache.get(word) or self._learn(word)
            return out

    def __len__(self) -> int:
        return len(self._cache)

    def _learn(self, word: str) -> list[int]:
        ids = [token.id for token in self._model.tokenize(word.translate(_ASCII_TO_BYTE_LEVEL))]
        with self._lock:
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[word] = ids
        return ids
