"""The word cache of byte-level BPE tokenizers (:mod:`kvpool.router.byte_words`) against the
tokenizer itself: the same ids for any ASCII text (every ASCII character, control characters
and GPT-2's contractions included), cold, warm and after the cache starts again; None for
other text; and refused for tokenizers whose pipeline is not plain byte-level BPE."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from test_router_openai import _bpe_tokenizer, _encoder, _metaspace_tokenizer

from kvpool.router.byte_words import ByteLevelWords

_ASCII = st.lists(st.one_of(
    st.text(alphabet=st.characters(max_codepoint=127), max_size=8),
    st.sampled_from(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", " router", "routes",
                     "  ", "\n\n", " \t", "\x0b", "\x1c", "\x85", "12", " 345", "!!", " ."]),
), max_size=16).map("".join).filter(str.isascii)

_BPE: dict[str, Any] = {}


def _backend() -> Any:
    if not _BPE:
        _BPE["tok"] = _bpe_tokenizer().backend_tokenizer
    return _BPE["tok"]


@given(texts=st.lists(_ASCII, min_size=1, max_size=4), max_words=st.integers(1, 64))
def test_ascii_text_encodes_to_the_tokenizers_ids(texts: list[str], max_words: int) -> None:
    backend = _backend()
    words = ByteLevelWords.for_tokenizer(backend)
    assert words is not None
    small = ByteLevelWords(backend.model, max_words=max_words)
    for text in [*texts, *texts]:  # cold, then warm
        expected = backend.encode(text, add_special_tokens=False).ids
        assert words.encode(text) == expected
        assert small.encode(text) == expected  # the cache started again on the way
        assert len(small) <= max_words


@given(text=st.text(min_size=1, max_size=20).filter(lambda t: not t.isascii()))
def test_other_text_is_left_to_the_tokenizer(text: str) -> None:
    words = ByteLevelWords.for_tokenizer(_backend())
    assert words is not None and words.encode(text) is None


def test_only_plain_byte_level_bpe_gets_a_word_cache() -> None:
    from tokenizers import normalizers

    assert ByteLevelWords.for_tokenizer(_metaspace_tokenizer().backend_tokenizer) is None
    normalized = _bpe_tokenizer().backend_tokenizer
    normalized.normalizer = normalizers.NFC()
    assert ByteLevelWords.for_tokenizer(normalized) is None
    assert ByteLevelWords.for_tokenizer(object()) is None
    # the router's encoder takes it where it applies, and only there
    assert _encoder("bpe")[1]._words is not None
    assert _encoder("metaspace")[1]._words is None
