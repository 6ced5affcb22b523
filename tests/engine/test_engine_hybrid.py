"""Equal logits for hybrid models: the engine over kvpool's blocks and recurrent-state slots
against transformers' own forward of the whole sequence.

Tiny seeded random Qwen3-Next (gated delta net + gated attention), Falcon-H1 (Mamba2 and
attention side by side in every layer) and Jamba (Mamba1 + attention), fp32 on CPU, run by
transformers' torch reference kernels. In every scenario each generated position's logits
equal the dense forward over the same tokens (max abs diff <= 1e-4) and the greedy tokens
are the dense argmax; each scenario also checks that the path it exercises really ran
(reuse from a checkpoint, a checkpoint onboarded from the host or disk, preemption, a
checkpoint cut inside a prefill chunk).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import test_engine_logits as logits  # noqa: E402
from test_engine_logits import MAX_DIFF, TPB, one_thread  # noqa: E402, F401

from kvpool.engine import Engine  # noqa: E402

VOCAB = 128


def qwen3_next() -> Any:
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
        max_position_embeddings=256)
    return transformers.Qwen3NextForCausalLM(cfg)


def falcon_h1() -> Any:
    cfg = transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1,
        mamba_chunk_size=8, max_position_embeddings=256)
    return transformers.FalconH1ForCausalLM(cfg)


def jamba() -> Any:
    cfg = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        max_position_embeddings=256)
    return transformers.JambaForCausalLM(cfg)


MODELS: dict[str, Callable[[], Any]] = {
    "qwen3_next": qwen3_next, "falcon_h1": falcon_h1, "jamba": jamba}
_BUILT: dict[str, Any] = {}


def model(name: str) -> Any:
    """A fresh copy of the seeded model (built once per test session)."""
    if name not in _BUILT:
        torch.manual_seed(1234)
        _BUILT[name] = MODELS[name]().float().eval()
    return copy.deepcopy(_BUILT[name]).to(logits.DEVICE)


class Pair(logits.Pair):
    """An engine and a dense reference with the same weights (``check``/``run`` as for the
    attention-only models)."""

    def __init__(self, name: str, cache: dict[str, Any], **kw: Any) -> None:
        self.ref = model(name)
        self.engine = Engine(model(name), cache={"tokens_per_block": TPB, **cache}, **kw)
        self.checked = 0


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, VOCAB, (n,), generator=g)]


@pytest.fixture(params=list(MODELS))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_layout_maps_recurrent_layers_to_a_state_group(name: str) -> None:
    engine = Engine(model(name), cache={"tokens_per_block": TPB, "gpu_blocks": 16})
    lay = engine.layout
    cfg = engine.manager.config
    assert lay.state_groups and tuple(cfg.state_groups) == lay.state_groups
    recurrent = [i for i, g in enumerate(lay.state_group) if g >= 0]
    assert recurrent == sorted(lay.mixers or {})
    if name == "falcon_h1":  # every layer attends and keeps a Mamba2 state
        assert recurrent == [0, 1] and lay.num_attention_groups == 1
    else:
        assert recurrent == [0, 2]
    (g,) = lay.state_groups
    pools = engine.manager.tensors(g)
    assert [tuple(p.shape[:2]) for p in pools] == [(16, 2), (16, 2)]


def test_layout_without_the_model_refuses_recurrent_layers() -> None:
    from kvpool.engine.layout import model_layout
    from kvpool.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"layer 0 has attention type "
                       r"'linear_attention'.*recurrent mixer"):
        model_layout(model("jamba").config, torch.float32)


def test_cold_prompts(name: str) -> None:
    pair = Pair(name, {"gpu_blocks": 48})
    outs = pair.run([tokens(1, 13), tokens(2, 1), tokens(3, 21)], max_tokens=6)
    assert [o.cached_tokens for o in outs] == [0, 0, 0]


def test_reuse_from_checkpoints_at_block_boundaries(name: str) -> None:
    pair = Pair(name, {"gpu_blocks": 48, "checkpoint_policy": "every_block"})
    base = tokens(4, 18)
    pair.run([base])
    before = pair.engine.manager.stats()
    # shares 14 tokens (ends mid-block: resumes at the checkpoint after 12), then 16 (a boundary)
    outs = pair.run([base[:14] + tokens(5, 5)])
    outs += pair.run([base[:16] + tokens(6, 3)])
    assert [o.cached_tokens for o in outs] == [12, 16]
    assert pair.engine.manager.stats().full_reused - before.full_reused >= 7


def test_default_policy_checkpoints_a_branch_point(name: str) -> None:
    """marconi: the first request to branch off a cached prefix leaves a checkpoint at the
    branch point; the next one sharing that prefix resumes there."""
    pair = Pair(name, {"gpu_blocks": 48})
    assert pair.engine.manager.config.checkpoint_policy == "marconi"
    base = tokens(7, 17)
    pair.run([base])
    first = pair.run([base[:13] + tokens(8, 4)])[0]
    second = pair.run([base[:13] + tokens(9, 6)])[0]
    assert (first.cached_tokens, second.cached_tokens) == (0, 12)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_checkpoint_onboarded(name: str, tier: str, tmp_path: Path) -> None:
    state = 1  # the state group (after the one attention group)
    cache: dict[str, Any] = {"gpu_blocks": {0: 24, state: 4}, "host_blocks": 32,
                             "checkpoint_policy": "every_block"}
    if tier == "disk":  # least recently used first, so base's checkpoint reaches the disk
        cache.update(host_blocks={0: 32, state: 2}, disk_blocks=48, disk={"path": str(tmp_path)},
                     eviction={"checkpoint_alpha": None})
    pair = Pair(name, cache, max_batch_size=2)
    before, after = logits.push_off_and_reuse(pair, tokens, base=(10, 14), fillers=(3, 13),
                                              shared=12, max_tokens=2)
    hit = 2 if tier == "disk" else 1
    assert after.tier_hits[hit] > before.tier_hits[hit]


def test_suspend_and_resume_mid_decode(name: str) -> None:
    pair = Pair(name, {"gpu_blocks": {0: 12, 1: 12}, "host_blocks": 48},
                max_batch_size=3)
    logits.suspend_and_resume(pair, [tokens(30, 10), tokens(31, 9), tokens(32, 11)],
                              max_tokens=14)


def test_step_mixes_chunked_prefills_and_decodes(name: str) -> None:
    """Chunks of up to 9 tokens cut at the checkpoints inside them (every block): a later prompt
    resumes from one of those cut checkpoints."""
    pair = Pair(name, {"gpu_blocks": 64, "checkpoint_policy": "every_block"},
                max_num_tokens=10)
    b = tokens(41, 23)
    seen = logits.mix_prefills_and_decodes(pair, b, tokens, max_tokens=5)
    chunks = [(s0, e) for s in seen for r, s0, e in s.prefills if r.request_id == "b"]
    assert len(chunks) > 1 and chunks[0][1] % TPB, "b's first chunk does not end mid-block"
    cut = chunks[0][1] // TPB * TPB  # a checkpoint cut inside b's first chunk
    out = pair.run([b[:cut + 1] + tokens(43, 2)])[0]
    assert out.cached_tokens == cut


def test_admission_onboards_while_others_reuse_host_checkpoints(name: str) -> None:
    """Seed 002 with checkpoints: one step admits requests that onboard host blocks and
    checkpoints and requests that reuse the same ones (claimed before anything is
    allocated); no logits change."""
    state = 1
    pair = Pair(name, {"gpu_blocks": {0: 20, state: 8}, "host_blocks": 48,
                       "checkpoint_policy": "every_block"}, max_batch_size=4)
    before, after = logits.onboard_while_others_reuse(pair, tokens)
    assert after.tier_hits[1] - before.tier_hits[1] >= 3


def test_model_outside_the_engine_is_transformers_own() -> None:
    pair = Pair("qwen3_next", {"gpu_blocks": 16})
    ids = torch.tensor([tokens(80, 9)])
    with torch.no_grad():
        assert torch.equal(pair.engine.model(ids, use_cache=False).logits,
                           pair.ref(ids, use_cache=False).logits)


def test_max_abs_diff_seen() -> None:
    """Runs last in this module: every comparison above was within tolerance (and ran)."""
    logits.assert_all_within_tol(MAX_DIFF, "engine vs dense (hybrid models)")
