"""Property: whatever the workload, pool sizes, tiers, batch and token budgets, every request's
logits equal transformers' dense forward over its tokens, and the manager's invariants hold
after every step (random arrivals, shared prefixes, preemption, chunking, window release)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpool.engine import Engine, RequestOutput, SamplingParams  # noqa: E402
from kvpool.errors import CapacityError  # noqa: E402

WINDOW = 6


def _model(kind: str) -> Any:
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(99)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, **common))
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=2, head_dim=8,
                                        query_pre_attn_scalar=8, sliding_window=WINDOW,
                                        layer_types=["sliding_attention", "full_attention"],
                                        **common)
    return transformers.Gemma3ForCausalLM(cfg)


MODELS: dict[str, tuple[Any, Any]] = {}


def models(kind: str) -> tuple[Any, Any]:
    """(engine model, dense reference) with the same weights, built once per kind."""
    if kind not in MODELS:
        model = _model(kind).float().eval()
        MODELS[kind] = (model, copy.deepcopy(model))
    return MODELS[kind]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


request_st = st.tuples(
    st.integers(0, 1),  # which shared base prompt
    st.integers(0, 14),  # how much of it
    st.lists(st.integers(1, 127), min_size=0, max_size=6),  # own suffix
    st.integers(1, 7),  # max_tokens
    st.integers(0, 4),  # arrival step
)


@settings(max_examples=14)
@given(
    kind=st.sampled_from(["llama", "gemma3"]),
    tpb=st.sampled_from([2, 4]),
    gpu_tokens=st.integers(24, 64),
    host_blocks=st.sampled_from([0, 12, 40]),
    max_batch_size=st.integers(1, 4),
    max_num_tokens=st.integers(4, 12),
    requests=st.lists(request_st, min_size=1, max_size=6),
    bases=st.lists(st.lists(st.integers(1, 127), min_size=14, max_size=14), min_size=2,
                   max_size=2),
)
def test_any_workload_gives_dense_logits(kind: str, tpb: int, gpu_tokens: int,
                                         host_blocks: int, max_batch_size: int,
                                         max_num_tokens: int,
                                         requests: list[tuple[int, int, list[int], int, int]],
                                         bases: list[list[int]]) -> None:
    model, ref = models(kind)
    engine = Engine(model, cache={"tokens_per_block": tpb, "gpu_blocks": gpu_tokens // tpb,
                                  "host_blocks": host_blocks},
                    max_batch_size=max_batch_size, max_num_tokens=max(max_num_tokens,
                                                                      max_batch_size))
    run_workload(engine, ref, requests, bases)


def run_workload(engine: Engine, ref: Any, requests: list[tuple[int, int, list[int], int, int]],
                 bases: list[list[int]]) -> None:
    """Run ``requests`` (``request_st``) through ``engine`` step by step, checking the
    manager's invariants after every step and every finished request's logits against
    ``ref``'s dense forward."""
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, (b, k, suffix, max_tokens, when) in enumerate(requests):
        prompt = bases[b][:k] + suffix or [1]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logits=True)
        arrivals.setdefault(when, []).append((f"r{i}", prompt, params))
    finished: list[RequestOutput] = []
    step = 0
    admitted = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            try:
                engine.add_request(rid, prompt, params)
                admitted += 1
            except CapacityError:
                pass
        finished += [o for o in engine.step() if o.finished]
        engine.manager.check_invariants()
        step += 1
        assert step < 500
    assert len(finished) == admitted
    for out in finished:
        assert out.finish_reason == "length" and out.logits is not None
        tokens = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            dense = ref(torch.tensor([tokens])).logits[0]
        n = len(out.prompt_token_ids)
        expected = dense[n - 1:n - 1 + len(out.token_ids)]
        assert float((expected - torch.stack(out.logits)).abs().max()) <= 1e-4
        assert expected.argmax(-1).tolist() == out.token_ids
    assert not engine.manager.sequences
