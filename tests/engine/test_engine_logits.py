"""Equal logits: the engine over kvpool's blocks against transformers' own dense forward.

Tiny seeded random models (Llama, Qwen2, Mistral with a sliding window, a Gemma-3-like model
with interleaved sliding/global layers; gpt-oss with attention sinks in fewer scenarios, its
MoE is slow), fp32 on CPU. In every scenario each generated position's logits equal the
dense forward over the same tokens (max abs diff <= 1e-4) and the greedy tokens are the
dense argmax; each scenario also checks that the cache path it exercises
really ran (reused tokens, onboarded blocks, preemptions, released window blocks), so a
broken path fails rather than silently falling back to recomputation.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dense_reference import (  # noqa: E402, F401
    TOL,
    assert_all_within_tol,
    check_dense,
    one_thread,
)

from kvpool.core.stats import CacheStats  # noqa: E402
from kvpool.engine import Engine, RequestOutput, SamplingParams  # noqa: E402
from kvpool.engine.scheduler import Schedule  # noqa: E402

# KVPOOL_TEST_DEVICE=cuda runs every scenario on the GPU (benchmarks/gpu_check.sh)
DEVICE = os.environ.get("KVPOOL_TEST_DEVICE", "cpu")
TPB = 4
WINDOW = 8
MAX_DIFF: list[float] = []


def _common(**kw: Any) -> dict[str, Any]:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                attn_implementation="sdpa")
    base.update(kw)
    return base


def llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_common()))


def qwen2() -> Any:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_common(
        use_sliding_window=False)))


def mistral() -> Any:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_common(
        sliding_window=WINDOW)))


def gemma3() -> Any:
    cfg = transformers.Gemma3TextConfig(**_common(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2))
    return transformers.Gemma3ForCausalLM(cfg)


def gpt_oss() -> Any:
    """Attention sinks (a learned per-head logit) and interleaved sliding/full layers; its
    reference is transformers' eager attention (gpt-oss has no sdpa path)."""
    cfg = transformers.GptOssConfig(**_common(
        intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    return transformers.GptOssForCausalLM(cfg)


MODELS: dict[str, Callable[[], Any]] = {
    "llama": llama, "qwen2": qwen2, "mistral": mistral, "gemma3": gemma3, "gpt_oss": gpt_oss}
EVERY_SCENARIO = ("llama", "qwen2", "mistral", "gemma3")  # gpt-oss (slow MoE): a few
SLIDING = ("mistral", "gemma3", "gpt_oss")


class Pair:
    """An engine and a dense reference with the same weights."""

    def __init__(self, name: str, cache: dict[str, Any], **kw: Any) -> None:
        torch.manual_seed(1234)
        model = MODELS[name]().float().eval().to(DEVICE)
        self.ref = copy.deepcopy(model)
        self.engine = Engine(model, cache={"tokens_per_block": TPB, **cache}, **kw)
        self.checked = 0

    def check(self, out: RequestOutput) -> None:
        """Logits and greedy tokens of ``out`` against the dense forward."""
        assert out.finished
        check_dense(self.ref, out, device=DEVICE, diffs=MAX_DIFF)
        self.checked += 1

    def run(self, prompts: list[list[int]], max_tokens: int = 6) -> list[RequestOutput]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logits=True)
        outs = self.engine.generate(prompts, params)
        for o in outs:
            self.check(o)
        return outs


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def record_schedules(engine: Engine) -> list[Schedule]:
    seen: list[Schedule] = []
    original = engine.scheduler.schedule

    def schedule() -> Schedule:
        s = original()
        seen.append(s)
        return s

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return seen


@pytest.fixture(params=EVERY_SCENARIO)
def model_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("name", list(MODELS))
def test_cold_prompts(name: str) -> None:
    pair = Pair(name, {"gpu_blocks": 64})
    outs = pair.run([tokens(1, 13), tokens(2, 4), tokens(3, 21)], max_tokens=8)
    assert [o.cached_tokens for o in outs] == [0, 0, 0]
    assert all(o.finish_reason == "length" for o in outs)


def test_prefix_of_full_blocks_reused(model_name: str) -> None:
    pair = Pair(model_name, {"gpu_blocks": 64})
    base = tokens(4, 17)
    pair.run([base])
    out = pair.run([base[:12] + tokens(5, 7)])[0]
    assert out.cached_tokens == 12
    assert pair.engine.manager.stats().full_reused >= 3


def test_partial_block_reuse_copies(model_name: str) -> None:
    pair = Pair(model_name, {"gpu_blocks": 64})
    base = tokens(6, 18)
    pair.run([base])
    # 14 shared tokens: 3 full blocks and 2 tokens of the fourth, copied into a fresh block
    outs = pair.run([base[:14] + tokens(7, 5), base[:14] + tokens(8, 3)])
    assert [o.cached_tokens for o in outs] == [14, 14]
    assert pair.engine.manager.stats().partial_reused >= 2


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_offloaded_prefix_onboarded(model_name: str, tiers: str, tmp_path: Path) -> None:
    cache: dict[str, Any] = {"gpu_blocks": 16, "host_blocks": 24}
    if tiers == "disk":
        cache.update(host_blocks=8, disk_blocks=40, disk={"path": str(tmp_path)})
    pair = Pair(model_name, cache, max_batch_size=2)
    stats, after = push_off_and_reuse(pair, tokens, base=(9, 22), fillers=(4, 25), shared=20,
                                      max_tokens=4)
    assert after.onboard_blocks > stats.onboard_blocks
    if tiers == "disk":
        assert after.tier_hits[2] > 0


def push_off_and_reuse(pair: Pair, tokens: Callable[[int, int], list[int]], *,
                       base: tuple[int, int], fillers: tuple[int, int], shared: int,
                       max_tokens: int) -> tuple[Any, Any]:
    """A prompt (``base``: seed, length), then ``fillers`` (count, length) new prompts that
    push its blocks off the GPU (and the host, with a disk tier), then a prompt sharing its
    first ``shared`` tokens, which must reuse them all (so they came back from a colder tier);
    the manager's stats before and after that last prompt."""
    prompt = tokens(*base)
    pair.run([prompt], max_tokens=max_tokens)
    for i in range(fillers[0]):
        pair.run([tokens(20 + i, fillers[1])], max_tokens=max_tokens)
    before = pair.engine.manager.stats()
    assert before.offload_blocks > 0
    out = pair.run([prompt[:shared] + tokens(base[0] + 1, 3)])[0]
    assert out.cached_tokens == shared
    return before, pair.engine.manager.stats()


def tight_pool(model_name: str) -> tuple[int, list[list[int]]]:
    """A GPU pool three growing sequences outgrow while decoding: three of up to 31 tokens
    need 24 blocks (18 in the pool); with a window of 8 in every layer a sequence holds at
    most 4 blocks, so three need up to 12 (7 in the pool)."""
    if model_name == "mistral":
        return 7, [tokens(30, 8), tokens(31, 7), tokens(32, 9)]
    return 18, [tokens(30, 10), tokens(31, 9), tokens(32, 11)]


def test_suspend_and_resume_mid_decode(model_name: str) -> None:
    gpu, prompts = tight_pool(model_name)
    pair = Pair(model_name, {"gpu_blocks": gpu, "host_blocks": 64}, max_batch_size=3)
    suspend_and_resume(pair, prompts, max_tokens=20)


def suspend_and_resume(pair: Pair, prompts: list[list[int]], *, max_tokens: int) -> None:
    """``prompts`` outgrow the GPU pool while decoding: sequences are suspended to the host
    and resumed (none recomputed), and each generates ``max_tokens`` (checked by ``pair``)."""
    outs = pair.run(prompts, max_tokens=max_tokens)
    assert pair.engine.scheduler.preemptions > 0
    assert pair.engine.scheduler.recomputations == 0
    stats = pair.engine.manager.stats()
    assert stats.offload_blocks > 0 and stats.onboard_blocks > 0
    assert all(len(o.token_ids) == max_tokens for o in outs)


def test_recompute_when_suspend_cannot_free(model_name: str) -> None:
    gpu, prompts = tight_pool(model_name)
    pair = Pair(model_name, {"gpu_blocks": gpu}, max_batch_size=3)
    pair.run(prompts, max_tokens=20)
    assert pair.engine.scheduler.recomputations > 0


def test_step_mixes_chunked_prefills_and_decodes(model_name: str) -> None:
    pair = Pair(model_name, {"gpu_blocks": 64}, max_num_tokens=9)
    seen = mix_prefills_and_decodes(pair, tokens(41, 23), tokens, max_tokens=6)
    chunked = [b for s in seen for r, b, _ in s.prefills if r.request_id == "b" and b > 0]
    assert chunked, "the long prompt was not chunked"


def test_abort_mid_prefill_commits_only_computed_blocks(model_name: str) -> None:
    pair = Pair(model_name, {"gpu_blocks": 64}, max_num_tokens=8)
    engine = pair.engine
    prompt = tokens(45, 23)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4))
    engine.step()  # computes 8 of 23 prompt tokens: two full blocks committed
    engine.abort("a")
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    out = pair.run([prompt])[0]
    assert out.cached_tokens == 8


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_past_the_window(name: str) -> None:
    pair = Pair(name, {"gpu_blocks": 48})
    engine = pair.engine
    windows = engine.layout.windows
    g = windows.index(WINDOW)
    params = SamplingParams(max_tokens=24, ignore_eos=True, return_logits=True)
    engine.add_request("long", tokens(50, 14), params)
    engine.add_request("short", tokens(51, 6), params)
    released = False
    done: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        req = engine.scheduler.running[0] if engine.scheduler.running else None
        if req is not None:
            released |= -1 in engine.manager.block_ids(req.seq_id, g)
    assert released, "no window block was released"
    for o in done:
        pair.check(o)
    assert len(done) == 2


def test_admission_onboards_while_others_reuse_host_blocks(model_name: str) -> None:
    """Seed 002: one step admits requests that onboard host blocks and requests that reuse
    the same host blocks (claimed before anything is allocated); no logits change."""
    pair = Pair(model_name, {"gpu_blocks": 20, "host_blocks": 48}, max_batch_size=4)
    onboard_while_others_reuse(pair, tokens)


def mix_prefills_and_decodes(pair: Pair, b: list[int], tokens: Callable[[int, int], list[int]],
                             *, max_tokens: int) -> list[Schedule]:
    """Request "a" (5 tokens), then the long prompt ``b`` and "c" (3 tokens) a step later,
    stepped to the end (each output checked by ``pair``); some step mixes decodes with a
    prefill chunk. Returns the engine's schedules."""
    engine = pair.engine
    seen = record_schedules(engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    engine.add_request("a", tokens(40, 5), params)
    engine.step()
    engine.add_request("b", b, params)
    engine.add_request("c", tokens(42, 3), params)
    done: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    for o in done:
        pair.check(o)
    assert len(done) == 3
    mixed = [s for s in seen if s.decodes and any(e - s0 > 1 for _, s0, e in s.prefills)]
    assert mixed, "no step mixed decodes with a prefill chunk"
    return seen


def onboard_while_others_reuse(pair: Pair, tokens: Callable[[int, int], list[int]]
                               ) -> tuple[CacheStats, CacheStats]:
    """Push two prompts' blocks to the host tier, then admit in one step requests that onboard
    them and requests that reuse the same ones (each output checked by ``pair``); at least 7
    blocks come back from the host. Returns the manager's stats before and after that step."""
    first, second = tokens(60, 17), tokens(61, 13)
    pair.run([first, second], max_tokens=3)
    for i in range(3):
        pair.run([tokens(70 + i, 30)], max_tokens=3)
    before = pair.engine.manager.stats()
    seen = record_schedules(pair.engine)
    outs = pair.run([first[:16] + tokens(62, 2), first[:12] + tokens(63, 3),
                     second[:12] + tokens(64, 1), tokens(65, 5)], max_tokens=4)
    assert len(seen[0].prefills) == 4, "the four requests were not admitted in one step"
    assert [o.cached_tokens for o in outs] == [16, 12, 12, 0]
    after = pair.engine.manager.stats()
    assert after.onboard_blocks - before.onboard_blocks >= 7
    return before, after


def test_max_abs_diff_seen() -> None:
    """Runs last in this module: every comparison above was within tolerance (and ran)."""
    assert_all_within_tol(MAX_DIFF, "engine vs dense")
