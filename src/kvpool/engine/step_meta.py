"""A step's metadata, built once on the host: token ids, positions and every pool row index.

The engine packs a step's tokens into one row: the decodes first (one token each), then each
prefill chunk. Everything the attention of every layer needs is computed here in plain
Python and numpy into **one** int64 array (:class:`StepMeta`), which reaches the device in one
copy (from pinned memory, without a sync, on CUDA; shared, with no copy, on the CPU) and is
sliced there into named views. Replaces a few dozen small tensor operations per layer group
per step with a few numpy ones.

Row arithmetic: a layer group's pool ``[slots, layers, 2, tpb, kv_heads, head_dim]`` is read
as rows; the layer-0 K row of token position p of a sequence with block table t is
``t[p // tpb] · stride + p % tpb`` with ``stride = layers · 2 · tpb``; its V row is ``tpb``
rows later and layer l's rows ``l · 2 · tpb`` rows later (:mod:`kvpool.engine.attention`).

Decode steps replayed from CUDA graphs need static shapes: :func:`batch_buckets` and
:func:`span_bucket` round the number of decodes and of keys up, and :func:`pad_decodes`
fills the extra decodes with copies of the last real one whose writes take the real one's
K/V (``write_src``), so padding never changes a byte another sequence reads. Keys past a
decode's own are read from its first key's row and masked (``decode_lens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class GroupGeom:
    """What the row arithmetic needs of a layer group."""

    tpb: int
    num_layers: int
    window: int | None

    @property
    def stride(self) -> int:
        return self.num_layers * 2 * self.tpb


@dataclass(slots=True)
class SeqWork:
    """One sequence's part of a step: tokens ``[start, end)`` are computed now.
    ``rows[g]``: ``[2, positions]``, the layer-0 K and V rows of every position its block
    table in group g covers (:func:`position_rows`)."""

    rows: Sequence[IntArray]
    start: int
    end: int


def position_rows(table: Sequence[int], geom: GroupGeom) -> IntArray:
    """``[2, positions]``: the layer-0 K row, then V row, of every position of a block table
    (rows of blocks not held, -1, are negative and never read)."""
    t = np.asarray(table, dtype=np.int64)
    k = (t[:, None] * geom.stride + np.arange(geom.tpb, dtype=np.int64)).reshape(-1)
    return np.stack((k, k + geom.tpb))


class RowCache:
    """:func:`position_rows` per (sequence, layer group), recomputed only when the block
    table changed (a new block every ``tpb`` decode steps). :meth:`step` starts a step:
    entries of sequences the previous step did not use are dropped."""

    def __init__(self, geoms: Sequence[GroupGeom]) -> None:
        self.geoms = tuple(geoms)
        self._old: dict[tuple[int, int], tuple[list[int], IntArray]] = {}
        self._new: dict[tuple[int, int], tuple[list[int], IntArray]] = {}

    def step(self) -> None:
        self._old, self._new = self._new, {}

    def rows(self, seq_id: int, g: int, table: list[int]) -> IntArray:
        key = (seq_id, g)
        hit = self._old.get(key) or self._new.get(key)
        if hit is None or hit[0] != table:
            hit = (table, position_rows(table, self.geoms[g]))
        self._new[key] = hit
        return hit[1]


def first_key(q: int, window: int | None) -> int:
    """The first key position a query at ``q`` sees."""
    return 0 if window is None else max(0, q - window + 1)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Decode batch sizes CUDA graphs are captured for: 1, 2, 4, 8, then multiples of 8,
    and ``max_batch`` itself."""
    out = [b for b in (1, 2, 4) if b < max_batch]
    out += range(8, max_batch, 8)
    out.append(max_batch)
    return tuple(out)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``n`` (``n`` itself past the largest)."""
    for b in buckets:
        if b >= n:
            return b
    return n


def span_bucket(span: int, tpb: int) -> int:
    """Keys per decode rounded up to whole blocks and to 1/4 of the next power of two
    (at most ~25 % padding; a handful of buckets per doubling)."""
    blocks = -(-span // tpb)
    step = max(1, (1 << max(0, blocks.bit_length() - 1)) // 4)
    return -(-blocks // step) * step * tpb


def pad_decodes(decodes: Sequence[SeqWork], n: int) -> list[SeqWork]:
    """``decodes`` followed by copies of the last one up to ``n`` entries."""
    return list(decodes) + [decodes[-1]] * (n - len(decodes))


@dataclass(slots=True)
class Segment:
    offset: int
    length: int


class StepMeta:
    """The step's metadata in one int64 array: named segments (see :meth:`names`).

    Segments: ``ids``, ``pos`` ([T] packed tokens), ``keep`` (the rows whose logits are
    sampled), ``write_src`` ([decodes] the K/V row each decode writes, padding only), and per
    layer group g: ``write{g}`` ([T] layer-0 K rows the new tokens go to), ``drows{g}``
    ([decodes · 2 · span]: per decode its K rows, then its V rows), ``dlens{g}`` ([decodes]
    keys per decode), ``prows{g}`` ([2 · keys]: every prefill chunk's K rows, then all V rows),
    ``kpos{g}`` ([keys] key positions) and ``kseg{g}`` ([keys] chunk of each key); ``qseg``
    ([prefill tokens] the chunk of each query).
    """

    __slots__ = ("_ints", "_parts", "chunks", "data", "num_decodes", "segments", "spans",
                 "uniform")

    def __init__(self) -> None:
        self.segments: dict[str, Segment] = {}
        self._ints: list[int] = []  # list segments, first in ``data``
        self._parts: list[tuple[str, list[IntArray]]] = []  # array segments, after them
        self.num_decodes = 0
        self.spans: list[int] = []  # per group: keys per decode
        self.uniform: list[bool] = []  # per group: every decode reads all its span
        self.chunks: list[list[tuple[int, int, int, int]]] = []  # per group: (t0, t1, k0, k1)
        self.data: IntArray = np.zeros(0, dtype=np.int64)

    def add(self, name: str, values: IntArray | list[int]) -> None:
        if isinstance(values, list):
            self.segments[name] = Segment(len(self._ints), len(values))
            self._ints += values
        else:
            self._parts.append((name, [values.reshape(-1)]))

    def add_pieces(self, name: str, pieces: list[IntArray]) -> None:
        """A segment that is ``pieces`` one after the other (copied once, by :meth:`finish`)."""
        self._parts.append((name, pieces))

    def finish(self) -> StepMeta:
        """Lay the segments out in ``data``: one concatenation, one array (one copy to the
        device)."""
        offset = len(self._ints)
        arrays: list[IntArray] = [np.array(self._ints, dtype=np.int64)]
        for name, pieces in self._parts:
            size = sum(p.size for p in pieces)
            self.segments[name] = Segment(offset, size)
            offset += size
            arrays += pieces
        self.data = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        self._ints, self._parts = [], []
        return self

    def get(self, name: str) -> IntArray:
        seg = self.segments[name]
        return self.data[seg.offset:seg.offset + seg.length]

    def names(self) -> list[str]:
        return list(self.segments)


def _decode_rows(decodes: Sequence[SeqWork], g: int, geom: GroupGeom,
                 span: int) -> tuple[list[IntArray], list[int], list[int]]:
    """(per decode its K rows then its V rows, as pieces; write rows; keys per decode).
    Keys past a decode's own repeat its first key's rows (valid memory; the mask hides
    them)."""
    pieces: list[IntArray] = []
    writes: list[int] = []
    lens: list[int] = []
    window = geom.window
    for s in decodes:
        rows = s.rows[g]
        last = s.end - 1
        first = 0 if window is None else max(0, last - window + 1)
        n = s.end - first
        k, v = rows[0, first:s.end], rows[1, first:s.end]
        if n < span:
            pad = np.full(span - n, rows[0, first], dtype=np.int64)
            pieces += (k, pad, v, pad + geom.tpb)
        else:
            pieces += (k, v)
        writes.append(int(rows[0, last]))
        lens.append(n)
    return pieces, writes, lens


def _prefill_rows(prefills: Sequence[SeqWork], g: int, geom: GroupGeom, t0: int,
                  meta: StepMeta) -> IntArray:
    """Adds ``prows{g}``, ``kpos{g}``, ``kseg{g}``; returns the chunks' write rows."""
    tpb = geom.tpb
    rows: list[IntArray] = []
    kpos: list[IntArray] = []
    kseg: list[IntArray] = []
    writes: list[IntArray] = []
    chunks: list[tuple[int, int, int, int]] = []
    t = k = 0
    for i, s in enumerate(prefills):
        lo = first_key(s.start, geom.window)
        keys = np.arange(lo, s.end, dtype=np.int64)
        r = s.rows[g][0, lo:s.end]
        rows.append(r)
        kpos.append(keys)
        kseg.append(np.full(keys.size, i, dtype=np.int64))
        writes.append(r[s.start - lo:])
        n = s.end - s.start
        chunks.append((t0 + t, t0 + t + n, k, k + keys.size))
        t += n
        k += keys.size
    krows = np.concatenate(rows)
    meta.add(f"prows{g}", np.concatenate((krows, krows + tpb)))
    meta.add(f"kpos{g}", np.concatenate(kpos))
    meta.add(f"kseg{g}", np.concatenate(kseg))
    meta.chunks.append(chunks)
    return np.concatenate(writes)


def build_step(geoms: Sequence[GroupGeom], decodes: Sequence[SeqWork],
               prefills: Sequence[SeqWork], ids: Sequence[int], keep: Sequence[int], *,
               spans: Sequence[int] | None = None, real_decodes: int | None = None) -> StepMeta:
    """The metadata of one step (see :class:`StepMeta`). ``ids`` are the packed token ids
    (decodes first). ``spans`` fixes keys per decode per group (CUDA graphs; else the longest
    decode's); with ``real_decodes`` < ``len(decodes)`` the rest are padding
    (:func:`pad_decodes`) and ``write_src`` maps each to the real decode whose K/V it writes.
    """
    meta = StepMeta()
    nd = len(decodes)
    meta.num_decodes = nd
    pos = [s.end - 1 for s in decodes]
    for s in prefills:
        pos += range(s.start, s.end)
    meta.add("ids", list(ids))
    meta.add("pos", pos)
    meta.add("keep", list(keep))
    if real_decodes is not None:
        meta.add("write_src", [min(i, real_decodes - 1) for i in range(nd)])
    if prefills:
        meta.add("qseg", [i for i, s in enumerate(prefills) for _ in range(s.end - s.start)])
    for g, geom in enumerate(geoms):
        writes: list[IntArray | list[int]] = []
        if decodes:
            longest = max(s.end - first_key(s.end - 1, geom.window) for s in decodes)
            span = longest if spans is None else spans[g]
            rows, w, lens = _decode_rows(decodes, g, geom, span)
            meta.add_pieces(f"drows{g}", rows)
            meta.add(f"dlens{g}", lens)
            meta.spans.append(span)
            meta.uniform.append(all(n == span for n in lens))
            writes.append(w)
        else:
            meta.spans.append(0)
            meta.uniform.append(True)
        if prefills:
            writes.append(_prefill_rows(prefills, g, geom, nd, meta))
        else:
            meta.chunks.append([])
        only = writes[0]
        meta.add(f"write{g}", only if len(writes) == 1 and isinstance(only, list) else
                 np.concatenate([np.asarray(w, dtype=np.int64) for w in writes]))
    return meta.finish()
