"""Hybrid models as the planner sees them: attention layers plus recurrent-state layers.

A :class:`HybridSpec` is a model whose attention layers keep per-token KV in blocks and whose
recurrent layers (Mamba1/2, gated delta net) keep a fixed-size state per sequence: per layer a
conv state and an SSM / recurrent state (docs/hybrid.md). The catalogue holds published
geometries (each model's ``config.json``):

=======================  ======  ===============  =========================================
model                    layers  attention        recurrent layers (per layer state)
=======================  ======  ===============  =========================================
qwen3-next-80b-a3b       48      12 × (2, 256)    36 GDN: conv (8192, 3), (32, 128, 128)
nemotron-h-8b            52      4 × (8, 128)     24 Mamba2: conv (10240, 3), (128, 64, 128) fp32
falcon-h1-7b             44      44 × (2, 128)    44 Mamba2: conv (5120, 3), (24, 128, 256)
jamba-v0.1               32      4 × (8, 128)     28 Mamba1: conv (8192, 3), (8192, 16)
=======================  ======  ===============  =========================================

(attention: KV heads, head dim; Falcon-H1 runs attention and Mamba2 in parallel in every
layer.) :meth:`HybridSpec.vllm_block_size` is the attention block size vLLM 0.33 picks for
such a model (``Platform._align_hybrid_block_size``): the smallest multiple of the attention
kernel's block alignment (16 for FlashAttention, the default) whose per-layer attention page
(``block × 2 × kv_heads × head_dim × itemsize``) is at least one layer's state page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from kvpool.errors import InvalidArgumentError
from kvpool.planner.model_spec import DTYPE_BYTES

__all__ = ["DEFAULT_STATE_FRACTION", "HybridPlan", "HybridSpec", "hybrid_presets",
           "plan_hybrid"]

DEFAULT_STATE_FRACTION: Final = 0.2
"""Share of each tier's budget (above the running slots) for state checkpoints: the best split
of benchmarks/bench_hybrid.py on the conversation trace."""


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True, slots=True)
class HybridSpec:
    """A hybrid model's attention and recurrent-state geometry."""

    name: str
    attention_layers: int
    kv_heads: int
    head_dim: int
    state_layers: int
    state_shapes: tuple[tuple[int, ...], ...]  # per layer: conv state, SSM/recurrent state
    max_seq_len: int
    dtype: str = "bfloat16"
    state_dtypes: tuple[str, ...] = ("bfloat16", "bfloat16")
    parallel: bool = False  # attention and recurrent mixer in the same layers (Falcon-H1)

    @property
    def num_layers(self) -> int:
        return (max(self.attention_layers, self.state_layers) if self.parallel
                else self.attention_layers + self.state_layers)

    def __post_init__(self) -> None:
        for name in ("attention_layers", "kv_heads", "head_dim", "state_layers", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{self.name}: {name} must be an int >= 1, got {v!r}")
        if len(self.state_dtypes) != len(self.state_shapes) or not all(
                d in DTYPE_BYTES for d in (self.dtype, *self.state_dtypes)):
            raise InvalidArgumentError(f"{self.name}: one known dtype per state shape")

    @property
    def attention_bytes_per_token(self) -> int:
        """K and V of one token over every attention layer."""
        return self.attention_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        """K and V of one token in one attention layer (vLLM's attention page of 1 token)."""
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def state_layer_bytes(self) -> int:
        """One layer's state (vLLM's Mamba page)."""
        return sum(_prod(s) * DTYPE_BYTES[d]
                   for s, d in zip(self.state_shapes, self.state_dtypes, strict=True))

    @property
    def state_bytes(self) -> int:
        """One sequence's whole state: one running slot or one checkpoint."""
        return self.state_layers * self.state_layer_bytes

    def vllm_block_size(self, kernel_block: int = 16) -> int:
        """The attention block size vLLM uses for this model (module docstring)."""
        page = kernel_block * self.layer_bytes_per_token
        return kernel_block * -(-self.state_layer_bytes // page)

    def state_geometry_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.state_shapes


_PRESETS: Final[Mapping[str, HybridSpec]] = MappingProxyType({
    # Qwen3-Next-80B-A3B: layers 4k+3 are full attention; gated delta net elsewhere:
    # conv_dim = 2 x 16 key heads x 128 + 32 value heads x 128 = 8192, kernel 4
    "qwen3-next-80b-a3b": HybridSpec(
        "qwen3-next-80b-a3b", attention_layers=12, kv_heads=2, head_dim=256, state_layers=36,
        state_shapes=((8192, 3), (32, 128, 128)), max_seq_len=262_144),
    # Nemotron-H-8B: 4 attention, 24 Mamba2 (+24 MLP) layers; d_inner 8192, 8 groups,
    # state 128: conv_dim = 8192 + 2 x 8 x 128; SSM cache in float32 (mamba_ssm_cache_dtype)
    "nemotron-h-8b": HybridSpec(
        "nemotron-h-8b", attention_layers=4, kv_heads=8, head_dim=128, state_layers=24,
        state_shapes=((10240, 3), (128, 64, 128)), max_seq_len=8192,
        state_dtypes=("bfloat16", "float32")),
    # Falcon-H1-7B: 44 layers, each attention and Mamba2 in parallel; 24 SSM heads of 128,
    # d_ssm 3072, 1 group of state 256: conv_dim = 3072 + 2 x 256 ... x (see docs)
    "falcon-h1-7b": HybridSpec(
        "falcon-h1-7b", attention_layers=44, kv_heads=2, head_dim=128, state_layers=44,
        state_shapes=((5120, 3), (24, 128, 256)), max_seq_len=262_144, parallel=True),
    # Jamba v0.1: attention at layers 8k+4, Mamba1 elsewhere; d_inner 8192, d_state 16
    "jamba-v0.1": HybridSpec(
        "jamba-v0.1", attention_layers=4, kv_heads=8, head_dim=128, state_layers=28,
        state_shapes=((8192, 3), (8192, 16)), max_seq_len=262_144),
})


def hybrid_presets() -> Mapping[str, HybridSpec]:
    """The built-in hybrid model geometries by name (read-only)."""
    return _PRESETS


@dataclass(frozen=True, slots=True)
class HybridPlan:
    """Pools of a hybrid model: group 0 attention blocks, group 1 state slots, per tier."""

    spec: HybridSpec
    tokens_per_block: int
    attention_blocks: tuple[int, ...]  # per tier (GPU, host, disk)
    state_slots: tuple[int, ...]  # per tier; the GPU's include the running slots
    running_slots: int
    budget_bytes: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return self.spec.attention_bytes_per_token * self.tokens_per_block

    def used_bytes(self, tier: int) -> int:
        return (self.attention_blocks[tier] * self.block_bytes
                + self.state_slots[tier] * self.spec.state_bytes)

    def cache_config_kwargs(self) -> dict[str, Any]:
        """``CacheConfig`` arguments for these pools (add ``disk_path`` for a disk tier)."""
        return {
            "tokens_per_block": self.tokens_per_block,
            "window_sizes": [None, None], "state_groups": [1],
            "gpu_blocks": [self.attention_blocks[0], self.state_slots[0]],
            "host_blocks": [self.attention_blocks[1], self.state_slots[1]],
            "disk_blocks": [self.attention_blocks[2], self.state_slots[2]],
            "max_seq_len": self.spec.max_seq_len, "enable_partial_reuse": False,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.spec.name, "tokens_per_block": self.tokens_per_block,
                "attention_block_bytes": self.block_bytes, "state_bytes": self.spec.state_bytes,
                "attention_blocks": list(self.attention_blocks),
                "state_slots": list(self.state_slots), "running_slots": self.running_slots,
                "budget_bytes": list(self.budget_bytes),
                "vllm_block_size": self.spec.vllm_block_size()}


def plan_hybrid(spec: HybridSpec, tokens_per_block: int, gpu_bytes: int, host_bytes: int = 0,
                disk_bytes: int = 0, *, max_batch_size: int,
                state_fraction: float = DEFAULT_STATE_FRACTION) -> HybridPlan:
    """Split each tier's budget between state slots and attention blocks: the GPU first gets
    one running slot per concurrent sequence, then ``state_fraction`` of every tier's bytes
    holds checkpoints and the rest attention blocks. Raises :class:`InvalidArgumentError` when
    the GPU cannot hold the running slots and one block per sequence."""
    if not 0 <= state_fraction < 1:
        raise InvalidArgumentError(f"state_fraction must be in [0, 1), got {state_fraction!r}")
    block = spec.attention_bytes_per_token * tokens_per_block
    running = max_batch_size * spec.state_bytes
    if gpu_bytes < running + max_batch_size * block:
        raise InvalidArgumentError(
            f"{spec.name}: {max_batch_size} sequences need {running + max_batch_size * block:,}"
            f" B of GPU memory (running states + one block each), the budget is {gpu_bytes:,}")
    blocks, states = [], []
    for t, budget in enumerate((gpu_bytes, host_bytes, disk_bytes)):
        free = budget - (running if t == 0 else 0)
        ckpt = int(free * state_fraction) // spec.state_bytes
        states.append(ckpt + (max_batch_size if t == 0 else 0))
        blocks.append((free - ckpt * spec.state_bytes) // block)
    return HybridPlan(spec, tokens_per_block, tuple(blocks), tuple(states), max_batch_size,
                      (gpu_bytes, host_bytes, disk_bytes))
