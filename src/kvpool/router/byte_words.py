"""Byte-level BPE encoding word by word, from a cache of words already seen.

A byte-level BPE tokenizer (GPT-2's scheme, used by SmolLM2, Llama 3, Qwen, ...) encodes a text
in three independent steps: a regular expression cuts it into words (a letter run with its
leading space, a digit run, a punctuation run, whitespace), each word's bytes are mapped to
printable characters, and the BPE model merges each word on its own. So a word's ids never
depend on its neighbours, and a word once encoded can be looked up: text a router sees repeats
its words far more than it invents new ones. Hugging Face ``tokenizers`` spends about 2 µs per
token of a request on the cut and the bookkeeping of its ``Encoding`` (offsets, masks); a word
cache does the cut with Python's ``re`` (C speed) and one dict lookup per word.

Above the words, a second cache holds *chunks*: the text between two spaces that follow a
character other than white space. No word of GPT-2's expression runs across such a space (a
letter, digit or punctuation run stops before it, a white-space run cannot start before it),
and the word that begins there starts with it, so ``" " + chunk`` encodes alone as it does in
the text. Most chunks are a word and its punctuation seen before: the text is cut with
``str.split(" ")`` (when no space follows white space, else one expression), all chunks are
looked up in one ``itemgetter`` call, and their ids (kept as u32 bytes) joined with one
``bytes.join``: about 50 ns per word instead of the expression's 250.

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
from array import array
from itertools import chain
from operator import itemgetter
from typing import Any, Final

from kvpool.router.chunk_table import ChunkTable

__all__ = ["WORD_CACHE_WORDS", "ByteLevelWords"]

WORD_CACHE_WORDS: Final = 1 << 20
"""Words and chunks kept (about 150 MB at most); when full, the caches start again empty."""

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
# A space after anything but white space starts a word: no word runs across it (see _chunks).
_CUT: Final = re.compile(r"(?<=[^ \t\n\r\x0b\x0c]) ")


def _chunks(text: str) -> list[str]:
    """``text`` cut at each space that follows a character other than white space, that space
    dropped (``str.split(" ")`` when no space follows white space)."""
    if ("  " in text or ("\n" in text and "\n " in text) or ("\t" in text and "\t " in text)
            or ("\r" in text and "\r " in text) or ("\x0b" in text and "\x0b " in text)
            or ("\x0c" in text and "\x0c " in text)):
        return _CUT.split(text)
    return text.split(" ")


class ByteLevelWords:
    """A word -> ids cache over a byte-level BPE model; see the module docstring."""

    def __init__(self, model: Any, *, max_words: int = WORD_CACHE_WORDS,
                 compiled: bool = True) -> None:
        self._model = model
        self._cache: dict[str, list[int]] = {}
        self._spaced: dict[str, bytes] = {}  # chunk -> the ids of " " + chunk (u32 bytes)
        self._max = max_words
        self._lock = threading.Lock()
        # chunks in arrays a compiled kernel scans (the jit extra); else the dict above
        self._table = (ChunkTable.create(self._table_chunk, max_chunks=max_words)
                       if compiled else None)

    @property
    def compiled(self) -> bool:
        """Whether chunks are looked up by the compiled kernel
        (:mod:`kvpool.router.chunk_table`)."""
        return self._table is not None

    @classmethod
    def for_tokenizer(cls, backend: Any, *, max_words: int = WORD_CACHE_WORDS
                      ) -> ByteLevelWords | None:
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
        return cls(backend.model, max_words=max_words)

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids (no added tokens in it), or None when ``text`` is not ASCII."""
        data = self.encode_u32(text)
        if data is None:
            return None
        ids = array("I")
        ids.frombytes(data)
        return ids.tolist()

    def encode_u32(self, text: str) -> bytes | None:
        """As :meth:`encode`, the ids as native u32 bytes."""
        if not text.isascii():
            return None
        if self._table is not None:
            found = self._table.encode_u32(text)
            if found is not None:
                return found
        chunks = _chunks(text)
        head = array("I", self._words_of(chunks[0]) if chunks[0] else ()).tobytes()
        del chunks[0]
        if not chunks:
            return head
        try:
            data = self._joined(chunks)
        except KeyError:  # chunks not seen yet: learnt, then all looked up again
            spaced = self._spaced
            for chunk in [c for c in chunks if c not in spaced]:
                self._chunk(chunk)
            try:
                data = self._joined(chunks)
            except KeyError:  # the cache started again on the way
                data = b"".join(map(self._chunk, chunks))
        return head + data if head else data

    def _joined(self, chunks: list[str]) -> bytes:
        """The cached ids of all ``chunks`` (one C call to look them up); KeyError when one
        is missing."""
        found = itemgetter(*chunks)(self._spaced)
        return found if len(chunks) == 1 else b"".join(found)

    def _chunk(self, chunk: str) -> bytes:
        """The ids of ``" " + chunk``, as native u32 bytes."""
        ids = self._spaced.get(chunk)
        if ids is None:
            ids = array("I", self._words_of(" " + chunk)).tobytes()
            with self._lock:
                self._make_room()
                self._spaced[chunk] = ids
        return ids

    def _words_of(self, text: str) -> list[int]:
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
        """Words and chunks held."""
        table = 0 if self._table is None else len(self._table)
        return len(self._cache) + len(self._spaced) + table

    def _table_chunk(self, chunk: str) -> list[int]:
        """A chunk's ids for the compiled table, room made for it there."""
        ids = self._words_of(chunk)
        with self._lock:
            self._make_room()
        return ids

    def _learn(self, word: str) -> list[int]:
        ids = [token.id for token in self._model.tokenize(word.translate(_ASCII_TO_BYTE_LEVEL))]
        with self._lock:
            self._make_room()
            self._cache[word] = ids
        return ids

    def _make_room(self) -> None:
        if len(self) >= self._max:  # start again, all
            self._cache.clear()
            self._spaced.clear()
            if self._table is not None:
                self._table.clear()
