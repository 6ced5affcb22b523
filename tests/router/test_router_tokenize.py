"""The router's fast text path against the reference: for random chats and prompts, the
encoder (:class:`~kvpool.router.tokenize.TextEncoder`: chat templates rendered from cached
skeletons, texts cut at added tokens with a segment cache, byte-level words and chunks from
their caches) gives exactly ``apply_chat_template(..., tokenize=True)`` and
``tokenizer.encode``, for SmolLM2's tokenizer (the bench's) and for other template styles on
a tiny tokenizer: cold and warm, conversations resent with their history, caches small enough
to evict on the way. Templates whose contents reach anything but output unchanged keep Jinja
(:func:`~kvpool.router.chat_render.contents_only_printed`, checked template by template)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from test_router_openai import chat_ids
from transformers.utils.chat_template_utils import _compile_jinja_template

from engine_serve_fixtures import SPECIAL_TOKENS, tiny_tokenizer
from kvpool.errors import InvalidArgumentError
from kvpool.router.byte_words import ByteLevelWords
from kvpool.router.chat_render import contents_only_printed
from kvpool.router.tokenize import TextEncoder

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ZEPHYR = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + "
    "eos_token }}{% else %}{{ raise_exception('Only user, system and assistant roles') }}"
    "{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    "{% endfor %}")
QWENISH = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% if message.tool_calls is defined %}tools{% endif %}"
    "{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TWICE = ("{% for m in messages %}{{ m['role'] ~ ':' ~ m['content'] }}|{{ m['content'] }}"
         "{% if not loop.last %}{{ '\n' }}{% endif %}{% endfor %}{{ messages|length }}"
         "{{ messages[0]['role'] }}")
SEPARABLE = {"chatml": CHATML, "zephyr": ZEPHYR, "qwenish": QWENISH, "twice": TWICE}
NOT_SEPARABLE = {
    "llama2": ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
               "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}"
               "{% set system = '' %}{% endif %}{% for message in rest %}"
               "{{ '[INST] ' + system + message['content'] | trim + ' [/INST]' }}{% endfor %}"),
    "trim": "{% for m in messages %}<|im_start|>{{ m['content'] | trim }}<|im_end|>{% endfor %}",
    "if": "{% for m in messages %}{% if m['content'] %}{{ m['content'] }}{% endif %}{% endfor %}",
    "in": "{% for m in messages %}{{ m['content'] }}{% if 'x' in m.content %}!{% endif %}"
          "{% endfor %}",
    "get": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "item_get": "{% for m in messages %}{{ m['get']('content') }}{% endfor %}",
    "items": "{% for m in messages %}{% for k, v in m.items() %}{{ v }}{% endfor %}{% endfor %}",
    "date": "{{ strftime_now('%Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "random": "{{ [1, 2]|random }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "next": "{% for m in messages %}{% if loop.nextitem and loop.nextitem['content'] %}x"
            "{% endif %}{{ m['content'] }}{% endfor %}",
    "filter_block": "{% filter upper %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                    "{% endfilter %}",
    "set_block": "{% for m in messages %}{% set x %}{{ m['content'] }}{% endset %}"
                 "{{ x|trim }}{% endfor %}",
    "macro": "{% macro say(m) %}{{ m['content'] }}{% endmacro %}"
             "{% for m in messages %}{{ say(m)|trim }}{% endfor %}",
    "slice": "{% for m in messages[1:] %}{{ m['content'] }}{% endfor %}",
    "reassign": "{% for m in messages %}{% set m = messages[0] %}{{ m['content'] }}{% endfor %}",
    "messages_set": "{% set messages = messages %}{% for m in messages %}{{ m['content'] }}"
                    "{% endfor %}",
    "tojson": "{{ messages|tojson }}",
    "first": "{{ (messages|first)['content'] }}",
    "cond": "{% for m in messages %}{{ m['content'] if m['role'] == 'user' else '' }}"
            "{% endfor %}",
    "length": "{% for m in messages %}{{ m['content']|length }}{% endfor %}",
    "generation": "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                  "{% endfor %}",
}


@pytest.mark.parametrize(("name", "template", "expected"), [
    *((n, t, True) for n, t in SEPARABLE.items()),
    *((n, t, False) for n, t in NOT_SEPARABLE.items()),
])
def test_templates_whose_contents_are_only_printed(name: str, template: str,
                                                   expected: bool) -> None:
    env = _compile_jinja_template(template).environment
    assert contents_only_printed(env, template) is expected


_SPECIALS = [*SPECIAL_TOKENS, "<|user|>", "<repo_name>", "<file_sep>"]
_PIECES = ["", " ", "  ", "   ", "\n", "\n ", " \n", "\n\n", "\t", " \t", "\r\n", "\x0b ",
           "\x0c", "word", " word", "Word,", "words.", "12", " 345", "'s", "'ll", " 'd", "é",
           "naïve café", "東京", "🚀", "\u00a0", "\u2028", "\x85", "\x1c ", "\x00",
           "<|im_", "end|>", "{{ x }}", "{% if %}", "\x00kvpool-content-0\x00", "user",
           "assistant\n", *_SPECIALS]
_CONTENT = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=6)),
                    max_size=10).map("".join)
_ROLES = ["system", "user", "assistant", "tool", "", "x y", "\x00", "<|im_end|>"]
_CHAT = st.lists(st.tuples(st.sampled_from(_ROLES), _CONTENT), min_size=1, max_size=6)

_TOKENIZERS: dict[str, Any] = {}


def _smollm2() -> Any:
    if "smollm2" not in _TOKENIZERS:
        from transformers import AutoTokenizer

        from kvpool.engine.models import smollm2_gguf_path

        gguf = smollm2_gguf_path(install=False)  # the bench's tokenizer (GGUF: about 7 s)
        _TOKENIZERS["smollm2"] = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return _TOKENIZERS["smollm2"]


def _tiny(template: str) -> Any:
    if template not in _TOKENIZERS:
        tok = tiny_tokenizer()
        tok.chat_template = template
        _TOKENIZERS[template] = tok
    return _TOKENIZERS[template]


_ENCODERS: dict[str, tuple[Any, TextEncoder, TextEncoder]] = {}


def _encoders(name: str) -> tuple[Any, TextEncoder, TextEncoder]:
    """The tokenizer, an encoder with the default caches and one whose caches evict all the
    time (four pieces' worth of segments, two skeletons, eight words and chunks)."""
    if name not in _ENCODERS:
        tok = _smollm2() if name == "smollm2" else _tiny(
            {**SEPARABLE, **NOT_SEPARABLE}[name])
        _ENCODERS[name] = (tok, TextEncoder(tok), TextEncoder(
            tok, cache_bytes=1000, max_skeletons=2, max_words=8))
    return _ENCODERS[name]


def _reference(tok: Any, chat: list[dict[str, str]]) -> list[int] | None:
    try:
        return chat_ids(tok, chat)
    except Exception:  # the template refused these messages
        return None


def _check(name: str, conversation: list[tuple[str, str]]) -> None:
    tok, warm, small = _encoders(name)
    chat = [{"role": r, "content": c} for r, c in conversation]
    for turn in range(1, len(chat) + 1):  # a client resends the history with each new turn
        expected = _reference(tok, chat[:turn])
        for encoder in (warm, small, warm):  # warm: a miss, then a hit
            if expected is None:
                with pytest.raises(InvalidArgumentError, match="chat template refused"):
                    encoder.encode_chat(chat[:turn])
            else:
                assert encoder.encode_chat(chat[:turn]) == expected


def test_smollm2_renders_from_skeletons_and_uses_word_chunks() -> None:
    _, encoder, _ = _encoders("smollm2")
    assert encoder.skeletons is not None and encoder.segmented and encoder._words is not None


@settings(max_examples=40, deadline=None)
@given(conversation=_CHAT, prompt=_CONTENT)
def test_smollm2_chats_encode_as_the_reference(conversation: list[tuple[str, str]],
                                               prompt: str) -> None:
    _check("smollm2", conversation)
    tok, warm, small = _encoders("smollm2")
    for encoder in (warm, small, warm):
        assert encoder.encode_prompt(prompt) == list(tok.encode(prompt))


@settings(max_examples=40, deadline=None)
@given(conversation=_CHAT, name=st.sampled_from([*SEPARABLE, "llama2", "trim", "if"]))
def test_other_templates_encode_as_the_reference(conversation: list[tuple[str, str]],
                                                 name: str) -> None:
    _check(name, conversation)
    assert (_encoders(name)[1].skeletons is not None) is (name in SEPARABLE)


def test_a_shared_history_is_looked_up_and_only_the_new_turn_encoded() -> None:
    tok, _, _ = _encoders("smollm2")
    encoder = TextEncoder(tok)
    history = [{"role": "system", "content": "You route requests. " * 40},
               {"role": "user", "content": "Which worker holds this prefix?"},
               {"role": "assistant", "content": "The one that served it last."}]
    encoder.encode_chat(history)
    skeletons = encoder.skeletons
    assert skeletons is not None
    misses, rendered = encoder.misses, skeletons.misses
    grown = [*history, {"role": "user", "content": "And the next one?"}]
    assert encoder.encode_chat(grown) == chat_ids(tok, grown)
    assert encoder.misses == misses + 1  # only the new turn's piece was encoded
    assert skeletons.misses == rendered + 1  # one skeleton per sequence of roles
    assert encoder.encode_chat(grown) == chat_ids(tok, grown)
    assert encoder.misses == misses + 1 and skeletons.misses == rendered + 1


_ASCII_SPACES = st.lists(st.sampled_from(
    [" ", "  ", "\t", "\n", "\r", "\x0b", "\x0c", "a", "Word", "'s", "12", ",", ".", "!?",
     " x", "x "]), max_size=24).map("".join)


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(_ASCII_SPACES, min_size=1, max_size=4), max_words=st.integers(1, 32))
def test_smollm2_word_chunks_encode_as_its_tokenizer(texts: list[str], max_words: int) -> None:
    """Chunks are cut at spaces after anything but white space (``str.split`` or the
    expression): every mix of white space around them, cold, warm and evicting."""
    backend = _smollm2().backend_tokenizer
    words = ByteLevelWords(backend.model, max_words=max_words)  # what for_tokenizer makes
    for text in [*texts, *texts]:
        assert words.encode(text) == backend.encode(text, add_special_tokens=False).ids
        assert len(words) <= max_words
