"""Paged attention over kvpool's pool tensors, registered with transformers' AttentionInterface.

A step packs every scheduled sequence's new tokens into one row ``[1, T]``: the decodes first
(one token each), then each prefill chunk. :class:`StepBatch` is built once per step and
passed to the model as the keyword argument ``kvpool_batch``; transformers hands it to every
attention call, where :func:`paged_attention`

1. writes the layer's new K/V into the sequences' block slots (one ``index_copy_`` each), and
2. reads each sequence's K/V back through its block table (one ``index_select``) and runs
   ``scaled_dot_product_attention``: all decodes in one call (query heads folded onto their
   KV heads, so grouped-query attention needs no repeated KV), each prefill chunk in its own.

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

ATTN_IMPLEMENTATION = "kvpool_paged"
"""The name kvpool's attention function is registered under in transformers."""


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's part of a step: tokens ``[start, end)`` of it are computed now."""

    table: dict[int, list[int]]  # layer group -> block table (-1 = not held)
    start: int
    end: int


@dataclass(slots=True)
class Prefill:
    """One prefill chunk of a layer group: packed tokens ``[t0, t1)``, its key rows and mask."""

    t0: int
    t1: int
    rows: torch.Tensor  # [2·keys] layer-0 rows: K, then V (``tpb`` rows later)
    mask: torch.Tensor | None  # [1, 1, q, keys] bool; None = plain causal from key 0


@dataclass(slots=True)
class GroupStep:
    """A step's indices for one layer group."""

    write_rows: torch.Tensor  # [T] layer-0 K rows of the new tokens
    decode_rows: torch.Tensor | None  # [decodes·2·keys]: per decode its K rows, then its V rows
    decode_keys: int  # keys per decode (the longest; shorter ones are masked)
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, keys] bool; None = every key valid
    prefills: list[Prefill]


@dataclass(slots=True)
class PoolView:
    """A layer group's GPU pool as rows, and where each model layer lives in it."""

    rows: torch.Tensor  # [slots·layers·2·tpb, kv_heads, head_dim]
    num_layers: int
    tpb: int
    window: int | None


class StepBatch:
    """Everything the attention of one step needs, computed once for all layers."""

    __slots__ = ("groups", "layer_group", "layer_index", "num_decodes", "pools", "tpb")

    def __init__(self, pools: Sequence[PoolView], layer_group: Sequence[int],
                 layer_index: Sequence[int], decodes: Sequence[ScheduledSeq],
                 prefills: Sequence[ScheduledSeq], device: torch.device) -> None:
        self.pools = pools
        self.layer_group = layer_group
        self.layer_index = layer_index
        self.num_decodes = len(decodes)
        self.groups = [_group_step(g, pool, decodes, prefills, device)
                       for g, pool in enumerate(pools)]


def _slot_rows(table: torch.Tensor, positions: torch.Tensor, pool: PoolView) -> torch.Tensor:
    """Layer-0 K rows of ``positions`` through block ``table`` (same leading shape)."""
    tpb = pool.tpb
    slots = table.gather(-1, torch.div(positions, tpb, rounding_mode="floor"))
    return slots * (pool.num_layers * 2 * tpb) + positions % tpb


def _first_key(q: int, window: int | None) -> int:
    return 0 if window is None else max(0, q - window + 1)


def _group_step(g: int, pool: PoolView, decodes: Sequence[ScheduledSeq],
                prefills: Sequence[ScheduledSeq], device: torch.device) -> GroupStep:
    window = pool.window
    tpb = pool.tpb
    writes: list[torch.Tensor] = []
    decode_rows = decode_mask = None
    span = 0
    if decodes:
        ends = [s.end for s in decodes]
        starts = [_first_key(e - 1, window) for e in ends]
        span = max(e - s for s, e in zip(starts, ends, strict=True))
        width = max(len(s.table[g]) for s in decodes)
        table = torch.tensor([s.table[g] + [0] * (width - len(s.table[g])) for s in decodes],
                             dtype=torch.long, device=device)
        first = torch.tensor(starts, dtype=torch.long, device=device)
        last = torch.tensor(ends, dtype=torch.long, device=device) - 1
        pos = first[:, None] + torch.arange(span, device=device)[None, :]
        valid = pos <= last[:, None]
        rows = _slot_rows(table, torch.where(valid, pos, first[:, None]), pool)
        decode_rows = torch.cat((rows, rows + tpb), dim=1).view(-1)
        if len(set(e - s for s, e in zip(starts, ends, strict=True))) > 1:
            decode_mask = valid[:, None, None, :]
        writes.append(_slot_rows(table, last[:, None], pool)[:, 0])
    chunks: list[Prefill] = []
    t = len(decodes)
    for s in prefills:
        table = torch.tensor(s.table[g], dtype=torch.long, device=device)
        lo = _first_key(s.start, window)
        keys = torch.arange(lo, s.end, device=device)
        rows = _slot_rows(table, keys, pool)
        n = s.end - s.start
        writes.append(rows[s.start - lo:])
        mask = None
        if lo > 0 or s.start > 0 or window is not None:
            q = torch.arange(s.start, s.end, device=device)[:, None]
            allowed = keys[None, :] <= q
            if window is not None:
                allowed &= keys[None, :] > q - window
            mask = allowed[None, None]
        chunks.append(Prefill(t, t + n, torch.cat((rows, rows + tpb)), mask))
        t += n
    write_rows = torch.cat(writes) if len(writes) > 1 else writes[0]
    return GroupStep(write_rows, decode_rows, span, decode_mask, chunks)


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
    for p in step.prefills:
        n_keys = p.rows.shape[0] // 2
        kv_rows = rows.index_select(0, p.rows).view(2, n_keys, kv_heads, dim)
        k = kv_rows[0].transpose(0, 1)[None]
        v = kv_rows[1].transpose(0, 1)[None]
        q = q_all[p.t0:p.t1].transpose(0, 1)[None]
        o = scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None,
                                         scale=scaling, enable_gqa=heads != kv_heads)
        if sinks is not None:
            mask = p.mask
            if mask is None:
                mask = torch.ones(q.shape[2], n_keys, dtype=torch.bool, device=q.device).tril()
            k_heads = k.repeat_interleave(heads // kv_heads, dim=1)
            o = o * _sink_factor(q, k_heads, mask, scaling, sinks.view(heads, 1, 1))
        outs.append(o[0].transpose(0, 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[None], None


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
