"""Hybrid-model replay (kvpool.replay.hybrid): short shared prompts hit with kvpool's default
policy and never on vLLM's 544-token grid; the modes use the memory they are given."""

from __future__ import annotations

import pytest

from kvpool.errors import InvalidArgumentError
from kvpool.planner.hybrid import hybrid_presets
from kvpool.replay.hybrid import best_split, hybrid_hit_rate
from kvpool.replay.workloads import synthetic_workload

GIB = 1 << 30
SPEC = hybrid_presets()["qwen3-next-80b-a3b"]


def _short(n: int = 240) -> list:  # type: ignore[type-arg]
    return list(synthetic_workload(num_requests=n, system_prompt_tokens=300,
                                   turns_per_conversation=1, agent_fraction=0.0,
                                   user_tokens=64, output_tokens=32,
                                   num_system_prompts=4).requests)


def test_short_prompts_hit_with_marconi_and_never_on_the_align_grid() -> None:
    reqs = _short()
    marconi = best_split(reqs, SPEC, 8 * GIB, splits=(0.35,))
    align = best_split(reqs, SPEC, 8 * GIB, mode="align", splits=(0.35,))
    attention = hybrid_hit_rate(reqs, SPEC, 8 * GIB, mode="attention")
    assert align.tokens_per_block == 544 and align.hit_tokens == 0
    assert marconi.hit_rate >= 0.9 * attention.hit_rate > 0.5
    for r in (marconi, align):
        used = r.attention_blocks * SPEC.attention_bytes_per_token * r.tokens_per_block \
            + r.state_slots * SPEC.state_bytes
        assert used <= 8 * GIB


def test_bad_mode_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        hybrid_hit_rate(_short(2), SPEC, GIB, mode="nope")
