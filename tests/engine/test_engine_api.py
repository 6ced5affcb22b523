"""The engine's request API: typed errors for bad input (the engine goes on), stop conditions,
abort, seeded sampling, and each finished request reported exactly once."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dense_reference import one_thread  # noqa: E402, F401

from engine_serve_fixtures import tiny_tokenizer  # noqa: E402
from kvpool.engine import Engine, RequestOutput, SamplingParams  # noqa: E402
from kvpool.errors import CapacityError, InvalidArgumentError  # noqa: E402


def tiny_model(vocab: int = 256, eos: int | None = None) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def make_engine(tokenizer: Any = None, **kw: Any) -> Engine:
    vocab = len(tokenizer) if tokenizer is not None else 256
    cache = kw.pop("cache", {"gpu_blocks": 32, "tokens_per_block": 4})
    return Engine(tiny_model(vocab, kw.pop("eos", None)), tokenizer, cache=cache, **kw)


def drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": 1.5}, {"temperature": -0.1}, {"temperature": "hot"},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"top_k": True}, {"seed": -3},
    {"stop": [""]}, {"stop": [3]}, {"stop_token_ids": [-1]}, {"stop_token_ids": "ab"},
    {"ignore_eos": 1}, {"return_logits": "yes"},
])
def test_bad_sampling_params(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


def test_bad_requests_leave_the_engine_serving() -> None:
    engine = make_engine()
    p = SamplingParams(max_tokens=4)
    bad: list[tuple[str, Any, Any]] = [
        ("empty", [], p),
        ("too-long", list(range(1, 126)), SamplingParams(max_tokens=4)),  # 125 + 4 > 128
        ("text-without-tokenizer", "hello", p),
        ("out-of-vocab", [1, 256], p),
        ("negative", [1, -2], p),
        ("not-params", [1, 2], {"max_tokens": 3}),
        ("", [1, 2], p),
        ("stop-without-tokenizer", [1, 2], SamplingParams(stop=["x"])),
    ]
    for rid, prompt, params in bad:
        with pytest.raises(InvalidArgumentError):
            engine.add_request(rid, prompt, params)
        assert not engine.has_unfinished_requests()
    engine.add_request("ok", [1, 2, 3], p)
    with pytest.raises(InvalidArgumentError, match="already in use"):
        engine.add_request("ok", [4, 5], p)
    outs = drain(engine)
    assert list(outs) == ["ok"] and len(outs["ok"][-1].token_ids) == 4


def test_request_larger_than_the_cache_is_refused_up_front() -> None:
    engine = make_engine(cache={"gpu_blocks": 8, "tokens_per_block": 4})  # 32 tokens at most
    with pytest.raises(CapacityError) as info:
        engine.add_request("big", list(range(1, 30)), SamplingParams(max_tokens=8))
    assert info.value.deficit == {0: 2}
    assert not engine.has_unfinished_requests()
    out = engine.generate([list(range(1, 25))], SamplingParams(max_tokens=8))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_cache_max_seq_len_bounds_requests() -> None:
    engine = make_engine(cache={"gpu_blocks": 32, "tokens_per_block": 4, "max_seq_len": 40})
    assert engine.max_model_len == 40
    with pytest.raises(InvalidArgumentError, match="maximum length 40"):
        engine.add_request("long", list(range(1, 35)), SamplingParams(max_tokens=8))
    out = engine.generate([list(range(1, 33))], SamplingParams(max_tokens=8))[0]
    assert len(out.token_ids) == 8


def test_bad_engine_arguments() -> None:
    model = tiny_model()
    with pytest.raises(InvalidArgumentError, match="max_num_tokens"):
        Engine(model, max_batch_size=8, max_num_tokens=4)
    with pytest.raises(InvalidArgumentError, match="decided by the model"):
        Engine(model, cache={"gpu_blocks": 8, "window_sizes": [None]})
    with pytest.raises(InvalidArgumentError, match="tokens_per_block"):
        Engine(model, cache={"gpu_blocks": 8, "tokens_per_block": 0})


def test_gpu_mem_sizes_the_pools_through_the_planner() -> None:
    engine = Engine(tiny_model(), cache={"gpu_mem": "1MiB", "host_mem": 1 << 20},
                    max_batch_size=2, max_num_tokens=64)
    # a block: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB
    assert engine.manager.config.slots == ((128,), (128,))
    with pytest.raises(InvalidArgumentError, match="pick one"):
        Engine(tiny_model(), cache={"gpu_blocks": 8, "gpu_mem": "1MiB"})


def test_finished_requests_are_reported_exactly_once() -> None:
    engine = make_engine(max_batch_size=2, max_num_tokens=8)
    for i, n in enumerate((3, 5, 1)):
        engine.add_request(f"r{i}", list(range(1 + i, 12 + i)), SamplingParams(max_tokens=n))
    outs = drain(engine)
    for i, n in enumerate((3, 5, 1)):
        finals = [o for o in outs[f"r{i}"] if o.finished]
        assert len(finals) == 1 and finals[0] is outs[f"r{i}"][-1]
        assert [t for o in outs[f"r{i}"] for t in o.new_token_ids] == finals[0].token_ids
        assert len(finals[0].token_ids) == n
    assert not engine.manager.sequences


def test_abort_reports_once_and_frees_the_sequence() -> None:
    engine = make_engine()
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50))
    engine.add_request("b", [6, 7, 8], SamplingParams(max_tokens=3))
    engine.step()
    engine.abort("a")
    engine.abort("unknown")  # ignored
    outs = drain(engine)
    assert [o.finish_reason for o in outs["a"]] == ["abort"]
    assert outs["a"][0].finished and len(outs["a"][0].token_ids) == 1
    assert outs["b"][-1].finish_reason == "length"
    assert not engine.manager.sequences


def test_stop_token_ids_and_eos() -> None:
    prompt = [3, 1, 4, 1, 5]
    greedy = make_engine().generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    stop = greedy[2]
    first = greedy.index(stop)
    out = make_engine().generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=[stop]))[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    eos_engine = make_engine(eos=stop)
    out = eos_engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    out = eos_engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == greedy and out.finish_reason == "length"


def test_stop_strings_cut_the_text() -> None:
    tok = tiny_tokenizer()
    engine = make_engine(tok)
    prompt = "The capital of France is"
    full = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert full.text is not None and full.text == tok.decode(full.token_ids)
    stop = full.text[4:6]
    cut = full.text.index(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    engine = make_engine(max_batch_size=4)
    params = SamplingParams(max_tokens=10, temperature=1.5, top_p=0.9, top_k=50, seed=11)
    alone = engine.generate([[5, 6, 7]], params)[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=1.0)
    batched = engine.generate([[9, 9, 9, 1], [5, 6, 7], [2, 2]], [other, params, other])
    assert batched[1].token_ids == alone
    reseeded = SamplingParams(max_tokens=10, temperature=1.5, top_p=0.9, top_k=50, seed=12)
    assert engine.generate([[5, 6, 7]], reseeded)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    engine = make_engine()
    prompt = [8, 6, 7, 5, 3, 0, 9]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
    for params in (SamplingParams(max_tokens=8, temperature=2.0, top_k=1, seed=1),
                   SamplingParams(max_tokens=8, temperature=2.0, top_p=1e-6, seed=2)):
        assert engine.generate([prompt], params)[0].token_ids == greedy


def test_model_called_outside_the_engine_is_transformers_sdpa() -> None:
    engine = make_engine()
    reference = tiny_model()
    reference.set_attn_implementation("sdpa")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        got = engine.model(ids).logits
        expected = reference(ids).logits
    assert float((got - expected).abs().max()) < 1e-5
