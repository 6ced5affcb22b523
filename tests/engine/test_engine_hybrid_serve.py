"""``kvpool serve`` over a hybrid checkpoint directory: a tiny random Jamba (Mamba1 +
attention) with the byte-level tokenizer, served by a real ``kvpool serve`` process on
127.0.0.1; its greedy completion equals transformers' own (a dense forward per token)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_serve_fixtures import KvpoolProcess, http_request, tiny_tokenizer  # noqa: E402


def _save_tiny_jamba(path: Path) -> Path:
    tokenizer = tiny_tokenizer()
    cfg = transformers.JambaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(0)
    transformers.JambaForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _dense_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_serve_runs_a_hybrid_checkpoint_directory(tmp_path: Path) -> None:
    path = _save_tiny_jamba(tmp_path / "jamba")
    proc = KvpoolProcess("serve", "--model", str(path), "--port", "0", "--tokens-per-block",
                         "4", "--gpu-blocks", "64")
    try:
        base = proc.wait_line("kvpool serve listening on ").split()[-1]
        prompt = "a hybrid model on kvpool"
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, _, answer = http_request(base, "POST", "/v1/completions", body)
        assert status == 200, answer
        ids = tiny_tokenizer().encode(prompt)
        assert answer["choices"][0]["token_ids"] == _dense_greedy(path, ids, 6)
        assert answer["usage"]["completion_tokens"] == 6
    finally:
        proc.stop()
