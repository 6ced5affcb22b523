"""A model's KV geometry as the planner sees it: attention layers, layer groups, presets.

A model's layers fall into *layer groups*, one per distinct memory life cycle (full attention,
or a sliding window of W tokens with S sink tokens), numbered in layer order of first
appearance; a block of a group costs

    bytes_per_block = Σ over the group's layers of 2 (K, V) × tpb × kv_heads × head_dim × itemsize
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType
from typing import Any, Final

from kvpool.errors import InvalidArgumentError
from kvpool.validation import is_int

__all__ = ["DTYPE_BYTES", "LayerGroupSpec", "LayerSpec", "ModelSpec", "presets"]

DTYPE_BYTES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "float32": 4,
        "fp32": 4,
        "float16": 2,
        "fp16": 2,
        "half": 2,
        "bfloat16": 2,
        "bf16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "fp8": 1,
        "int8": 1,
    }
)
"""Bytes per element of the KV dtypes the planner knows."""


def group_label(window: int | None, sink_tokens: int) -> str:
    """``full`` or ``window W`` (``+ S sink``), for tables and messages."""
    if window is None:
        return "full"
    return f"window {window}" + (f" + {sink_tokens} sink" if sink_tokens else "")


def as_tuple(name: str, value: object) -> tuple[Any, ...]:
    """``value`` as a tuple; a str, bytes or non-iterable raises, naming ``name``."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a sequence, got {value!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer's KV geometry.

    ``window`` is the sliding window in tokens (``None`` = full attention); ``sink_tokens`` are
    the leading tokens a windowed layer keeps forever (only meaningful with a window).
    """

    window: int | None
    _: KW_ONLY
    kv_heads: int
    head_dim: int
    sink_tokens: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.window is not None and (not is_int(self.window) or self.window < 1):
            raise InvalidArgumentError(f"window must be None or an int >= 1, got {self.window!r}")
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise InvalidArgumentError(f"sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if self.window is None and self.sink_tokens:
            raise InvalidArgumentError(
                f"sink_tokens={self.sink_tokens} needs a sliding window (full attention keeps "
                "every token already)"
            )
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise InvalidArgumentError(
                f"unknown dtype {self.dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
            )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in this layer."""
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class LayerGroupSpec:
    """Layers that share one memory life cycle: the same ``(window, sink_tokens)``."""

    index: int
    window: int | None
    sink_tokens: int
    layers: tuple[int, ...]
    bytes_per_token: int

    def bytes_per_block(self, tokens_per_block: int) -> int:
        """Bytes of one slot of this group's pool (all its layers, K and V)."""
        return self.bytes_per_token * tokens_per_block

    @property
    def label(self) -> str:
        """``full`` or ``window W`` (``+ S sink``), for tables and messages."""
        return group_label(self.window, self.sink_tokens)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's attention layers, in order, and the longest sequence it serves."""

    name: str
    layers: tuple[LayerSpec, ...]
    max_seq_len: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", as_tuple(f"model {self.name!r}: layers", self.layers))
        if not self.layers:
            raise InvalidArgumentError(f"model {self.name!r} has no layers")
        if not all(isinstance(layer, LayerSpec) for layer in self.layers):
            raise InvalidArgumentError(f"model {self.name!r}: layers must be LayerSpec objects")
        if not is_int(self.max_seq_len) or self.max_seq_len < 1:
            raise InvalidArgumentError(f"max_seq_len must be an int >= 1, got {self.max_seq_len!r}")

    @staticmethod
    def preset(name: str) -> ModelSpec:
        """The preset called ``name`` (see :func:`presets`); unknown names list the valid ones."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown model preset {name!r}; valid presets: {', '.join(_PRESETS)}"
            ) from None

    def layer_groups(self) -> tuple[LayerGroupSpec, ...]:
        """Groups of layers with the same ``(window, sink_tokens)``, numbered by first layer."""
        order: dict[tuple[int | None, int], list[int]] = {}
        for i, layer in enumerate(self.layers):
            order.setdefault((layer.window, layer.sink_tokens), []).append(i)
        return tuple(
            LayerGroupSpec(
                index=g,
                window=window,
                sink_tokens=sink,
                layers=tuple(members),
                bytes_per_token=sum(self.layers[i].bytes_per_token for i in members),
            )
            for g, ((window, sink), members) in enumerate(order.items())
        )


def _uniform(
    name: str, n: int, *, kv_heads: int, head_dim: int, max_seq_len: int, window: int | None
) -> ModelSpec:
    layer = LayerSpec(window, kv_heads=kv_heads, head_dim=head_dim)
    return ModelSpec(name, (layer,) * n, max_seq_len)


def _interleaved(
    name: str,
    n: int,
    *,
    kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    window: int,
    global_every: int,
    dtype: str = "bfloat16",
) -> ModelSpec:
    """Every ``global_every``-th layer (1-based) is full attention, the others are windowed."""
    local = LayerSpec(window, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    full = LayerSpec(None, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    layers = tuple(full if (i + 1) % global_every == 0 else local for i in range(n))
    return ModelSpec(name, layers, max_seq_len)


# Public geometries (layer counts, KV heads, head dims, windows) of well-known checkpoints; the
# planner needs nothing else from a model.
_PRESETS: Final[Mapping[str, ModelSpec]] = MappingProxyType(
    {
        "llama-3-8b": _uniform(
            "llama-3-8b", 32, kv_heads=8, head_dim=128, max_seq_len=8192, window=None
        ),
        "mistral-7b": _uniform(
            "mistral-7b", 32, kv_heads=8, head_dim=128, max_seq_len=32768, window=4096
        ),
        # Gemma 2 alternates local (even layers) and global (odd layers) attention.
        "gemma-2-9b": _interleaved(
            "gemma-2-9b", 42, kv_heads=8, head_dim=256, max_seq_len=8192, window=4096,
            global_every=2,
        ),
        # Gemma 3: five local layers, then one global layer.
        "gemma-3-12b": _interleaved(
            "gemma-3-12b", 48, kv_heads=8, head_dim=256, max_seq_len=131072, window=1024,
            global_every=6,
        ),
        "tiny": _interleaved(
            "tiny", 4, kv_heads=2, head_dim=16, max_seq_len=2048, window=64, global_every=2,
            dtype="float16",
        ),
    }
)


def presets() -> Mapping[str, ModelSpec]:
    """The built-in model geometries by name (read-only)."""
    return _PRESETS
