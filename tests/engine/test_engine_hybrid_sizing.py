"""The engine sizes a hybrid model's state pools from memory budgets by the planner's rule
(kvpool.planner.hybrid.split_state, the one ``kvpool plan`` uses): on the GPU one running slot
per concurrent sequence, then DEFAULT_STATE_FRACTION of each tier's rest for checkpoints; the
attention pools are planned from what is left."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool.engine import Engine, SamplingParams  # noqa: E402
from kvpool.planner.hybrid import DEFAULT_STATE_FRACTION, split_state  # noqa: E402

MIB = 1 << 20


def _jamba() -> object:
    cfg = transformers.JambaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("batch", [2, 8])
def test_budgets_size_state_pools_as_the_planner_does(batch: int) -> None:
    gpu, host = MIB, 3 * MIB
    engine = Engine(_jamba(), cache={"tokens_per_block": 4, "gpu_mem": gpu, "host_mem": host},
                    max_batch_size=batch)
    cfg = engine.manager.config
    (g,) = engine.layout.state_groups
    slot = engine.layout.geometry[g].block_bytes(1)
    # the rule written out: running slots first, then 20 % of the rest per tier
    want_gpu = batch + int((gpu - batch * slot) * DEFAULT_STATE_FRACTION) // slot
    want_host = int(host * DEFAULT_STATE_FRACTION) // slot
    assert (cfg.slots[0][g], cfg.slots[1][g]) == (want_gpu, want_host)
    split = split_state([gpu, host, 0], [slot], max_batch_size=batch)
    assert split.state_slots == ((want_gpu,), (want_host,), (0,))
    block = engine.layout.geometry[0].block_bytes(4)
    for t in (0, 1):
        attention = cfg.slots[t][0] * block
        assert attention <= split.attention_bytes[t]
        assert attention + cfg.slots[t][g] * slot - (batch * slot if t == 0 else 0) \
            <= (gpu, host)[t]
    # the pools work: a prompt's prefix is reused from its checkpoint by the next request
    prompt = list(range(1, 22))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([prompt], params)
    assert engine.generate([[*prompt, 5, 6]], params)[0].cached_tokens == 20


def test_running_slots_that_do_not_fit_are_refused() -> None:
    from kvpool.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="running states"):
        Engine(_jamba(), cache={"tokens_per_block": 4, "gpu_mem": 1024}, max_batch_size=64)
