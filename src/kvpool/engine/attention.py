"""Paged attention over kvpool's pool tensors, registered with transformers' AttentionInterface.

A step packs every scheduled sequence's new tokens into one row ``[1, T]``: the decodes first
(one token each), then each prefill chunk. Its metadata (token ids, positions, pool rows) is
built once on the host (:mod:`kvpool.engine.step_meta`) into one int64 tensor on the device;
:class:`StepBatch` slices it into views (and builds the masks) once per step and is passed to
the model as the keyword argument ``kvpool_batch``; transformers hands it to every attention
call, where :func:`paged_attention`

1. writes the layer's new K/V into the sequences' block slots (one ``index_copy_`` each), and
2. reads the K/V back through the precomputed rows (one ``index_select`` for the decodes, one
   for the prefills) and runs ``scaled_dot_product_attention``: all decodes in one call
   (query heads folded onto their KV heads, so grouped-query attention needs no repeated KV),
   and all prefill chunks in one call with a block-diagonal mask while that costs at most
   :data:`PACK_LIMIT` times the chunks' own scores (else one call per chunk).

The pool of a layer group ``[slots, layers, 2, tpb, kv_heads, head_dim]`` is read as rows
``[slots·layers·2·tpb, kv_heads, head_dim]``: the row of (slot, layer, K/V, offset) is
``slot·layers·2·tpb + layer·2·tpb + kv·tpb + offset``. A step's row indices are computed for
layer 0; layer l reads the same indices in the view that starts ``l·2·tpb`` rows later, so
no index is recomputed per layer.

Masks follow transformers': a query at position q sees keys ``k <= q`` and, in a sliding
window of W, ``k > q - W``. A window group's released blocks (table entries -1) lie before
that range and are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

from kvpool.engine.step_meta import StepMeta

ATTN_IMPLEMENTATION = "kvpool_paged"
"""The name kvpool's attention function is registered under in transformers."""


PACK_LIMIT = 4.0
"""Prefill chunks of a step share one attention call per layer (a block-diagonal mask over
all their keys) while that call's scores are at most this many times the chunks' own;
past it each chunk gets its own call."""


@dataclass(slots=True)
class Prefill:
    """Prefill queries ``[t0, t1)`` of the packed row against keys ``[k0, k1)`` of the step's
    gathered prefill keys, with their mask."""

    t0: int
    t1: int
    k0: int
    k1: int
    mask: torch.Tensor | None  # [1, 1, q, keys] bool; None = plain causal from key 0


@dataclass(slots=True)
class GroupStep:
    """A step's indices for one layer group (views of the step's metadata tensor)."""

    write_rows: torch.Tensor  # [T] layer-0 K rows of the new tokens
    decode_rows: torch.Tensor | None  # [decodes·2·keys]: per decode its K rows, then its V rows
    decode_keys: int  # keys per decode (the longest, or the CUDA graph's bucket)
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, keys] bool; None = every key valid
    prefill_rows: torch.Tensor | None  # [2·keys]: every chunk's K rows, then all V rows
    prefills: list[Prefill]


@dataclass(slots=True)
class PoolView:
    """A layer group's GPU pool as rows, and where each model layer lives in it."""

    rows: torch.Tensor  # [slots·layers·2·tpb, kv_heads, head_dim]
    num_layers: int
    tpb: int
    window: int | None


class StepBatch:
    """Everything the attention of one step needs, computed once for all layers from the
    step's metadata (:class:`kvpool.engine.step_meta.StepMeta`) and its device copy ``data``.
    ``masked`` forces the decode masks on (CUDA graphs: one graph for any key counts)."""

    __slots__ = ("groups", "layer_group", "layer_index", "num_decodes", "pools", "write_src")

    def __init__(self, pools: Sequence[PoolView], layer_group: Sequence[int],
                 layer_index: Sequence[int], meta: StepMeta, data: torch.Tensor, *,
                 masked: bool = False) -> None:
        self.pools = pools
        self.layer_group = layer_group
        self.layer_index = layer_index
        self.num_decodes = meta.num_decodes
        view = _Views(meta, data)
        self.write_src = view("write_src") if "write_src" in meta.segments else None
        self.groups = [_group_step(g, pool, meta, view, masked) for g, pool in enumerate(pools)]


class _Views:
    def __init__(self, meta: StepMeta, data: torch.Tensor) -> None:
        self.meta = meta
        self.data = data

    def __call__(self, name: str) -> torch.Tensor:
        seg = self.meta.segments[name]
        return self.data[seg.offset:seg.offset + seg.length]


def _group_step(g: int, pool: PoolView, meta: StepMeta, view: _Views,
                masked: bool) -> GroupStep:
    decode_rows: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefill_rows: torch.Tensor | None = None
    span = meta.spans[g]
    if meta.num_decodes:
        decode_rows = view(f"drows{g}")
        if masked or not meta.uniform[g]:
            lens = view(f"dlens{g}")
            keys = torch.arange(span, device=lens.device)
            decode_mask = (keys[None, :] < lens[:, None])[:, None, None, :]
    chunks = meta.chunks[g]
    prefills: list[Prefill] = []
    if chunks:
        prefill_rows = view(f"prows{g}")
        kpos, kseg = view(f"kpos{g}"), view(f"kseg{g}")
        nd = meta.num_decodes
        qpos, qseg = view("pos")[nd:], view("qseg")
        useful = sum((t1 - t0) * (k1 - k0) for t0, t1, k0, k1 in chunks)
        total = (chunks[-1][1] - nd) * chunks[-1][3]
        if len(chunks) > 1 and total <= PACK_LIMIT * useful:
            packed = _mask(qpos, kpos, pool.window) & (qseg[:, None] == kseg[None, :])
            prefills.append(Prefill(nd, chunks[-1][1], 0, chunks[-1][3], packed[None, None]))
        for t0, t1, k0, k1 in [] if prefills else chunks:
            mask: torch.Tensor | None = None
            if pool.window is not None or k1 - k0 != t1 - t0:
                mask = _mask(qpos[t0 - nd:t1 - nd], kpos[k0:k1], pool.window)[None, None]
            prefills.append(Prefill(t0, t1, k0, k1, mask))
    return GroupStep(view(f"write{g}"), decode_rows, span, decode_mask, prefill_rows, prefills)


def _mask(q: torch.Tensor, k: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, k] bool: key position <= query position (and within the window)."""
    allowed = k[None, :] <= q[:, None]
    if window is not None:
        allowed &= k[None, :] > q[:, None] - window
    return allowed


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, KVH, T, D]``
    of the step's new tokens; returns ``[1, T, H, D]``. Without a ``kvpool_batch`` (the model
    called outside the engine) it is transformers' own sdpa attention."""
    batch: StepBatch | None = kwargs.pop("kvpool_batch", None)
    sinks: torch.Tensor | None = kwargs.get("s_aux")
    if batch is None:
        result: tuple[torch.Tensor, None] = _outside_engine(
            module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        return result
    layer: int = module.layer_idx  # type: ignore[assignment]
    g = batch.layer_group[layer]
    pool = batch.pools[g]
    step = batch.groups[g]
    tpb = pool.tpb
    rows = pool.rows[batch.layer_index[layer] * 2 * tpb:]
    k_new = key[0].transpose(0, 1)  # [T, KVH, D]
    v_new = value[0].transpose(0, 1)
    if batch.write_src is not None:  # padded decodes write their real decode's K/V
        k_new = k_new.index_select(0, batch.write_src)
        v_new = v_new.index_select(0, batch.write_src)
    rows.index_copy_(0, step.write_rows, k_new)
    rows[tpb:].index_copy_(0, step.write_rows, v_new)
    q_all = query[0].transpose(0, 1)  # [T, H, D]
    heads, dim = q_all.shape[1], q_all.shape[2]
    kv_heads = key.shape[1]
    nd = batch.num_decodes
    outs: list[torch.Tensor] = []
    if nd:
        assert step.decode_rows is not None
        span = step.decode_keys
        kv_rows = rows.index_select(0, step.decode_rows).view(nd, 2, span, kv_heads, dim)
        k = kv_rows[:, 0].transpose(1, 2)  # [B, KVH, span, D]
        v = kv_rows[:, 1].transpose(1, 2)
        # query heads h = kv·rep + r fold onto their KV head: [B, KVH, rep, D] (no repeated KV)
        q = q_all[:nd].reshape(nd, kv_heads, heads // kv_heads, dim)
        o = scaled_dot_product_attention(q, k, v, attn_mask=step.decode_mask, scale=scaling)
        if sinks is not None:
            o = o * _sink_factor(q, k, step.decode_mask, scaling, sinks.view(kv_heads, -1, 1))
        outs.append(o.reshape(nd, heads, dim))
    if step.prefills:
        assert step.prefill_rows is not None
        n_keys = step.prefill_rows.shape[0] // 2
        kv_all = rows.index_select(0, step.prefill_rows).view(2, n_keys, kv_heads, dim)
        for p in step.prefills:
            outs.append(_prefill(q_all[p.t0:p.t1], kv_all[:, p.k0:p.k1], p.mask, scaling,
                                 sinks))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[None], None


def _prefill(q_rows: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None,
             scaling: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Prefill queries ``[q, H, D]`` against keys and values ``kv [2, keys, KVH, D]``."""
    heads, kv_heads = q_rows.shape[1], kv.shape[2]
    k = kv[0].transpose(0, 1)[None]
    v = kv[1].transpose(0, 1)[None]
    q = q_rows.transpose(0, 1)[None]
    o = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                     scale=scaling, enable_gqa=heads != kv_heads)
    if sinks is not None:
        if mask is None:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        k_heads = k.repeat_interleave(heads // kv_heads, dim=1)
        o = o * _sink_factor(q, k_heads, mask, scaling, sinks.view(heads, 1, 1))
    return o[0].transpose(0, 1)


def _sink_factor(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (gpt-oss): a per-head logit in the softmax's denominator with no value.
    sdpa's output times ``sigmoid(lse - sink)`` is that softmax's output (lse: the
    log-sum-exp of the query's visible scores)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.sigmoid(lse - sinks.to(lse.dtype))


def _outside_engine(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None, dropout: float, **kwargs: Any) -> Any:
    """transformers' own attention for a call without the engine: sdpa, or the model's eager
    attention where sdpa cannot express it (sinks)."""
    if kwargs.get("s_aux") is not None:
        import sys

        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, scaling=scaling,
                     dropout=dropout, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def register() -> None:
    """Register :func:`paged_attention` (and transformers' sdpa masks for calls outside the
    engine) under :data:`ATTN_IMPLEMENTATION`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
