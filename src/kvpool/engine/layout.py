"""From a transformers model config to kvpool's layer groups and cache configuration.

Each decoder layer attends over all tokens or a sliding window of W tokens
(``config.layer_types`` when the config has it, else ``config.sliding_window`` for every
layer), or keeps a recurrent state instead (hybrid models: ``linear_attention`` layers of
Qwen3-Next and Jamba), or both (Falcon-H1's ``hybrid`` layers, attention and Mamba2 side by
side). Attention layers with the same window form one kvpool layer group, numbered by first
layer as :mod:`~kvpool.planner.capacity` numbers them, so a plan's pools and the engine's
groups agree. Recurrent layers whose state has the same shapes form one state group
(``CacheConfig.state_groups``, numbered after the attention groups), its
:class:`~kvpool.tiers.storage.StateGeometry` measured from the model's own mixers
(:func:`kvpool.engine.recurrent.probe_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.config import CacheConfig
from kvpool.engine.recurrent import StateShape, probe_state, recurrent_mixers
from kvpool.errors import InvalidArgumentError
from kvpool.planner.capacity import LayerSpec, ModelSpec, parse_size, plan_pools
from kvpool.tiers.storage import GroupGeometry, LayerGeometry, StateGeometry
from kvpool.validation import is_int

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ENGINE_DECIDES = ("window_sizes", "layer_geometry", "sink_tokens", "device", "state_groups")
_ATTENTION = ("full_attention", "sliding_attention", "hybrid")
STATE_SHARE = 0.25
"""Share of each tier's planned budget that goes to the state groups' slots (running states
and checkpoints) when ``cache`` gives budgets rather than slot counts."""
DEFAULT_GPU_MEM = 1 << 30
"""GPU (device) KV budget when ``cache`` names neither ``gpu_blocks`` nor ``gpu_mem``."""


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Where every decoder layer's KV and recurrent state live: its attention group and index
    within it (``layer_group``/``layer_index``; unused for a layer without attention), and its
    state group and index (``state_group``/``state_index``, -1 for a layer without state).
    Attention groups come first (``0 .. len(spec groups) - 1``), then ``state_groups``."""

    spec: ModelSpec  # the attention layers
    layer_group: tuple[int, ...]
    layer_index: tuple[int, ...]
    windows: tuple[int | None, ...]  # per layer group (None for state groups)
    geometry: tuple[LayerGeometry, ...]  # per layer group
    max_model_len: int
    state_group: tuple[int, ...] = ()
    state_index: tuple[int, ...] = ()
    state_groups: tuple[int, ...] = ()
    mixers: dict[int, Any] | None = None  # model layer -> its recurrent mixer module
    state_shapes: dict[int, StateShape] | None = None  # model layer -> its state per sequence

    @property
    def num_attention_groups(self) -> int:
        return len(self.windows) - len(self.state_groups)


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs keep it in ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"dtype {dtype} is not one of {sorted(_DTYPES.values())}")
    return _DTYPES[dtype]


def _state_groups(shape_of: Mapping[int, StateShape], n: int, first: int,
                  ) -> tuple[list[int], list[int], list[StateGeometry]]:
    """Recurrent layers grouped by their state shapes: per layer (group, index), -1 without."""
    group = [-1] * n
    index = [-1] * n
    shapes: list[StateShape] = []
    members: list[list[int]] = []
    for layer in sorted(shape_of):
        shape = shape_of[layer]
        if shape not in shapes:
            shapes.append(shape)
            members.append([])
        k = shapes.index(shape)
        group[layer] = first + k
        index[layer] = len(members[k])
        members[k].append(layer)
    geoms = [StateGeometry(len(m), (s.conv, s.recurrent),
                           dtypes=(_dtype_name(s.conv_dtype), _dtype_name(s.recurrent_dtype)))
             for s, m in zip(shapes, members, strict=True)]
    return group, index, geoms


def model_layout(config: Any, dtype: torch.dtype, model: Any = None) -> ModelLayout:
    """The layer groups of a transformers decoder config (raises on what kvpool cannot run).
    A hybrid model's recurrent layers need ``model`` (their state shapes are measured)."""
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
    mixers = recurrent_mixers(model) if model is not None else {}
    windows: list[int | None] = []
    attention: list[int] = []  # model layers with attention
    for i, kind in enumerate(list(types)[:n]):
        if kind in ("full_attention", "hybrid"):
            windows.append(None)
        elif kind == "sliding_attention" and window:
            windows.append(int(window))
        elif i not in mixers:
            raise InvalidArgumentError(
                f"layer {i} has attention type {kind!r}, which kvpool's engine does not run "
                "(full_attention, sliding_attention, or a recurrent mixer of a hybrid model "
                "given with its model)")
        if kind in _ATTENTION and (kind != "sliding_attention" or window):
            attention.append(i)
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
        for j, pos in enumerate(grp.layers):
            layer_group[attention[pos]] = grp.index
            layer_index[attention[pos]] = j
    hidden = int(cfg.hidden_size)
    shape_of = {layer: probe_state(mixer, hidden) for layer, mixer in mixers.items()}
    state_group, state_index, state_geoms = _state_groups(shape_of, n, len(groups))
    return ModelLayout(
        spec=spec,
        layer_group=tuple(layer_group),
        layer_index=tuple(layer_index),
        windows=tuple([grp.window for grp in groups] + [None] * len(state_geoms)),
        geometry=(*[GroupGeometry(len(grp.layers), kv_heads, head_dim, dt) for grp in groups],
                  *state_geoms),
        max_model_len=spec.max_seq_len,
        state_group=tuple(state_group),
        state_index=tuple(state_index),
        state_groups=tuple(range(len(groups), len(groups) + len(state_geoms))),
        mixers=dict(mixers),
        state_shapes=shape_of,
    )


def _bytes(name: str, value: object) -> int:
    if isinstance(value, str):
        return parse_size(value)
    if not is_int(value) or value < 0:
        raise InvalidArgumentError(f"cache[{name!r}] must be bytes (int) or a size like '2GiB', "
                                   f"got {value!r}")
    return value


def _state_slots(layout: ModelLayout, budgets: list[int],
                 max_batch_size: int) -> list[dict[int, int]]:
    """Per tier, the slots of each state group: :data:`STATE_SHARE` of the tier's budget split
    evenly between the state groups; on the GPU at least a running slot per sequence and one
    checkpoint more."""
    out: list[dict[int, int]] = []
    n = len(layout.state_groups)
    for tier, budget in enumerate(budgets):
        row = {}
        for g in layout.state_groups:
            slot_bytes = layout.geometry[g].block_bytes(1)
            slots = int(budget * STATE_SHARE / n) // slot_bytes
            row[g] = max(slots, max_batch_size + 1) if tier == 0 else slots
        out.append(row)
    return out


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
    if layout.state_groups:
        base["state_groups"] = list(layout.state_groups)
    if "gpu_blocks" not in fields:
        budgets = [mems.get("gpu_mem", DEFAULT_GPU_MEM), mems.get("host_mem", 0),
                   mems.get("disk_mem", 0)]
        state = _state_slots(layout, budgets, max_batch_size)
        if layout.state_groups:
            budgets = [int(b * (1 - STATE_SHARE)) for b in budgets]
        plan = plan_pools(layout.spec, tpb, *budgets,
                          max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                          max_seq_len=min(fields["max_seq_len"], layout.max_model_len))
        planned = plan.cache_config_kwargs()
        for tier, key in enumerate(("gpu_blocks", "host_blocks", "disk_blocks")):
            value = {**planned[key], **state[tier]}
            if key not in fields and (key == "gpu_blocks" or any(value.values())):
                base[key] = value
    elif mems:
        raise InvalidArgumentError("cache gives both gpu_blocks and a *_mem budget; pick one")
    base.update(fields)
    return CacheConfig.from_mapping(base)
