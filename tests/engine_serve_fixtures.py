"""Tiny, seeded, random transformers models with a real byte-level tokenizer, saved to a
directory, for the serving, loading and cluster tests (no weights are downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (every text encodes, one token per byte) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
    )


def tiny_llama(vocab_size: int, *, seed: int = 0, eos_token_id: int | None = None,
               max_positions: int = 4096) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_tiny_model(path: Path, *, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """Save a tiny random Llama (and, by default, the byte-level tokenizer) to ``path``."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed=seed, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    if with_tokenizer:
        tokenizer.save_pretrained(path)
    return path
