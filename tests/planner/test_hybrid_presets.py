"""The hybrid catalogue's state shapes equal what transformers' own recurrent mixers keep when
built from each model's published config.json values: the mixer's conv channels
(``conv_dim``) and its recurrent state's shape, read from one mixer built from the config
(weights left uninitialised: only the shapes matter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.initialization import no_init_weights  # noqa: E402
from transformers.models.falcon_h1 import modeling_falcon_h1  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

from kvpool.planner.hybrid import hybrid_presets  # noqa: E402

Shape = tuple[int, tuple[int, ...]]

# the config.json fields a layer's state depends on (each model's published config)
PUBLISHED: dict[str, tuple[Callable[..., Any], Any, Callable[[Any], Shape], dict[str, Any]]] = {
    "falcon-h1-7b": (  # tiiuae/Falcon-H1-7B-Instruct
        transformers.FalconH1Config, modeling_falcon_h1.FalconH1Mixer,
        lambda m: (m.conv_dim, (m.num_heads, m.head_dim, m.ssm_state_size)),
        {"hidden_size": 3072, "num_attention_heads": 12, "num_key_value_heads": 2,
         "head_dim": 128, "mamba_d_ssm": 3072, "mamba_n_heads": 24, "mamba_d_head": 128,
         "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2}),
    "qwen3-next-80b-a3b": (  # Qwen/Qwen3-Next-80B-A3B-Instruct
        transformers.Qwen3NextConfig, modeling_qwen3_next.Qwen3NextGatedDeltaNet,
        lambda m: (m.conv_dim, (m.num_v_heads, m.head_k_dim, m.head_v_dim)),
        {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
         "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128,
         "linear_conv_kernel_dim": 4}),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_state_matches_transformers_mixer(name: str) -> None:
    config_cls, mixer_cls, read, fields = PUBLISHED[name]
    cfg = config_cls(num_hidden_layers=1, vocab_size=8, **fields)
    with no_init_weights():
        mixer = mixer_cls(cfg, layer_idx=0)
    conv_channels, recurrent = read(mixer)
    (conv, rec) = hybrid_presets()[name].state_shapes
    assert conv[0] == conv_channels  # (the kernel's length is kept as vLLM keeps it: d_conv - 1)
    assert rec == recurrent
