"""Property: whatever the workload, pool sizes, tiers, budgets and checkpoint policy, every
request of a hybrid model (Jamba: Mamba1 + attention; Qwen3-Next: gated delta net + attention)
gets transformers' dense logits, and the manager's invariants hold after every step (random
arrivals, shared prefixes, checkpoints cut inside chunks, preemption, offload)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_engine_properties import one_thread, request_st, run_workload  # noqa: E402, F401

from kvpool.engine import Engine  # noqa: E402


def _model(kind: str) -> Any:
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(99)
    if kind == "jamba":
        return transformers.JambaForCausalLM(transformers.JambaConfig(
            attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_state=4,
            mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, **common))
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        head_dim=8, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0, **common))


MODELS: dict[str, tuple[Any, Any]] = {}


def models(kind: str) -> tuple[Any, Any]:
    """(engine model, dense reference) with the same weights, built once per kind."""
    if kind not in MODELS:
        model = _model(kind).float().eval()
        MODELS[kind] = (model, copy.deepcopy(model))
    return MODELS[kind]


@settings(max_examples=5, deadline=None)
@given(
    kind=st.sampled_from(["jamba", "qwen3_next"]),
    policy=st.sampled_from(["marconi", "every_block", "last", "branch"]),
    tpb=st.sampled_from([2, 4]),
    gpu_tokens=st.integers(24, 64),
    state_slots=st.integers(5, 12),
    host_blocks=st.sampled_from([0, 12, 40]),
    max_batch_size=st.integers(1, 4),
    max_num_tokens=st.integers(4, 12),
    requests=st.lists(request_st, min_size=1, max_size=6),
    bases=st.lists(st.lists(st.integers(1, 127), min_size=14, max_size=14), min_size=2,
                   max_size=2),
)
def test_any_hybrid_workload_gives_dense_logits(
        kind: str, policy: str, tpb: int, gpu_tokens: int, state_slots: int, host_blocks: int,
        max_batch_size: int, max_num_tokens: int,
        requests: list[tuple[int, int, list[int], int, int]], bases: list[list[int]]) -> None:
    model, ref = models(kind)
    engine = Engine(model, cache={"tokens_per_block": tpb, "checkpoint_policy": policy,
                                  "gpu_blocks": {0: gpu_tokens // tpb, 1: state_slots},
                                  "host_blocks": host_blocks},
                    max_batch_size=max_batch_size, max_num_tokens=max(max_num_tokens,
                                                                      max_batch_size))
    run_workload(engine, ref, requests, bases)
