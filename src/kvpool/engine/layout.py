"""From a transformers model config to kvpool's layer groups and cache configuration.

Each decoder layer is full attention or a sliding window of W tokens (``config.layer_types``
when the config has it, else ``config.sliding_window`` for every layer). Layers with the same
window form one kvpool layer group, numbered by first layer as :mod:`~kvpool.planner.capacity`
numbers
them, so a plan's pools and the engine's groups agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.config import CacheConfig
from kvpool.errors import InvalidArgumentError
from kvpool.planner.capacity import LayerSpec, ModelSpec, parse_size, plan_pools
from kvpool.tiers.storage import GroupGeometry
from kvpool.validation import is_int

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ENGINE_DECIDES = ("window_sizes", "layer_geometry", "sink_tokens", "device")
DEFAULT_GPU_MEM = 1 << 30
"""GPU (device) KV budget when ``cache`` names neither ``gpu_blocks`` nor ``gpu_mem``."""


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Where every decoder layer's KV lives: its layer group and index within the group."""

    spec: ModelSpec
    layer_group: tuple[int, ...]
    layer_index: tuple[int, ...]
    windows: tuple[int | None, ...]  # per layer group
    geometry: tuple[GroupGeometry, ...]  # per layer group
    max_model_len: int


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs keep it in ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def model_layout(config: Any, dtype: torch.dtype) -> ModelLayout:
    """The layer groups of a transformers decoder config (raises on what kvpool cannot run)."""
    cfg = text_config(config)
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise InvalidArgumentError(
            "attention logit soft-capping (Gemma 2) is not supported by kvpool's sdpa attention"
        )
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"model dtype {dtype} is not one of {sorted(_DTYPES.values())}")
    n = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * n
    windows: list[int | None] = []
    for i, kind in enumerate(types[:n]):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention" and window:
            windows.append(int(window))
        else:
            raise InvalidArgumentError(f"layer {i} has attention type {kind!r}, which kvpool's "
                                       "engine does not run (full_attention, sliding_attention)")
    dt = _DTYPES[dtype]
    spec = ModelSpec(
        getattr(cfg, "model_type", "model"),
        tuple(LayerSpec(w, kv_heads=kv_heads, head_dim=head_dim, dtype=dt) for w in windows),
        int(getattr(cfg, "max_position_embeddings", 0) or 2048),
    )
    groups = spec.layer_groups()
    layer_group = [0] * n
    layer_index = [0] * n
    for grp in groups:
        for j, layer in enumerate(grp.layers):
            layer_group[layer] = grp.index
            layer_index[layer] = j
    return ModelLayout(
        spec=spec,
        layer_group=tuple(layer_group),
        layer_index=tuple(layer_index),
        windows=tuple(grp.window for grp in groups),
        geometry=tuple(GroupGeometry(len(grp.layers), kv_heads, head_dim, dt) for grp in groups),
        max_model_len=spec.max_seq_len,
    )


def _bytes(name: str, value: object) -> int:
    if isinstance(value, str):
        return parse_size(value)
    if not is_int(value) or value < 0:
        raise InvalidArgumentError(f"cache[{name!r}] must be bytes (int) or a size like '2GiB', "
                                   f"got {value!r}")
    return value


def cache_config(layout: ModelLayout, cache: Mapping[str, Any] | None, *, device: str,
                 max_batch_size: int, max_num_tokens: int) -> CacheConfig:
    """The manager's config: the caller's ``cache`` fields plus what the model decides.

    ``gpu_mem`` / ``host_mem`` / ``disk_mem`` (bytes or sizes like ``"2GiB"``) let the planner
    size the pools; ``gpu_blocks`` / ``host_blocks`` / ``disk_blocks`` set them directly.
    """
    fields = dict(cache or {})
    for name in _ENGINE_DECIDES:
        if name in fields:
            raise InvalidArgumentError(f"cache[{name!r}] is decided by the model; leave it out")
    tpb = fields.pop("tokens_per_block", 16)
    mems = {k: _bytes(k, fields.pop(k)) for k in ("gpu_mem", "host_mem", "disk_mem")
            if k in fields}
    fields.setdefault("max_seq_len", layout.max_model_len)
    base: dict[str, Any] = {
        "tokens_per_block": tpb,
        "window_sizes": list(layout.windows),
        "layer_geometry": list(layout.geometry),
        "device": device,
    }
    if "gpu_blocks" not in fields:
        gpu = mems.get("gpu_mem", DEFAULT_GPU_MEM)
        plan = plan_pools(layout.spec, tpb, gpu, mems.get("host_mem", 0), mems.get("disk_mem", 0),
                          max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                          max_seq_len=min(fields["max_seq_len"], layout.max_model_len))
        planned = plan.cache_config_kwargs()
        for key in ("gpu_blocks", "host_blocks", "disk_blocks"):
            value = planned[key]
            if key not in fields and (key == "gpu_blocks" or any(value.values())):
                base[key] = value
    elif mems:
        raise InvalidArgumentError("cache gives both gpu_blocks and a *_mem budget; pick one")
    base.update(fields)
    return CacheConfig.from_mapping(base)
