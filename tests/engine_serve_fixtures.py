"""Tiny, seeded, random transformers models with a real byte-level tokenizer, saved to a
directory, for the serving, loading and cluster tests (no weights are downloaded); ``kvpool``
subprocesses and a small HTTP client for the tests that run real servers."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

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


class KvpoolProcess:
    """A ``kvpool`` subprocess whose stdout lines are collected by a thread."""

    def __init__(self, *args: str) -> None:
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env,
        )
        self.lines: list[str] = []
        self.errors: list[str] = []  # stderr, read so the pipe never fills up
        for stream, sink in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors)):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()

    @staticmethod
    def _read(stream: Any, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.strip())

    def wait_line(self, prefix: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line {prefix!r}: {self.lines} {self.errors[-20:]}")

    def stop(self) -> None:
        stop_all([self])


def stop_all(procs: list[KvpoolProcess]) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL after 20 s)."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in procs:
        try:
            p.proc.wait(20)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


def http_request(base: str, method: str, path: str, body: object = None
          ) -> tuple[int, dict[str, str], Any]:
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        payload = json.loads(raw) if "json" in resp.getheader("Content-Type", "") else raw
        return resp.status, dict(resp.getheaders()), payload
    finally:
        conn.close()
