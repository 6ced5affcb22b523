"""Decode steps with static shapes, replayed from CUDA graphs on CUDA.

A decode-only step is padded to a bucket (:func:`kvpool.engine.step_meta.batch_buckets` for
the number of decodes, :func:`~kvpool.engine.step_meta.span_bucket` for the keys each reads),
so a few shapes cover every step. On CUDA each shape is captured once into a CUDA graph whose
inputs are one static int64 metadata buffer on the device (token ids, positions, pool rows,
key counts: the layout depends on the shape only); a step then costs one copy from pinned
host memory into that buffer and one replay, with no host sync, instead of hundreds of
kernel launches from Python. The first step of a shape runs the model once on a side stream
(warm-up, computing the step for real), captures it and replays it; both write the same K/V.
If a capture fails the runner says so once and the engine runs eagerly from then on.

On the CPU (``static_decode=True``, for tests) the same padded, masked step runs eagerly, so
the padding and masking the graphs rely on are checked against the dense model there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpool.engine.attention import PoolView
from kvpool.engine.step_meta import (
    GroupGeom,
    SeqWork,
    StepMeta,
    batch_buckets,
    bucket_for,
    build_step,
    first_key,
    pad_decodes,
    span_bucket,
)

Forward = Callable[[torch.Tensor, StepMeta], torch.Tensor]


class DecodeRunner:
    """Padded decode steps (see the module docstring); ``forward(data, meta)`` runs the
    model on a metadata tensor and returns fp32 logits ``[rows, vocab]``."""

    def __init__(self, pools: Sequence[PoolView], geoms: Sequence[GroupGeom], max_batch: int,
                 device: torch.device, forward: Forward,
                 stage: Callable[[Any], torch.Tensor]) -> None:
        self.pools = pools
        self.geoms = tuple(geoms)
        self.buckets = batch_buckets(max_batch)
        self.device = device
        self.forward = forward
        self.stage = stage  # numpy metadata -> host tensor (pinned on CUDA)
        self.capture = device.type == "cuda"
        self._graphs: dict[tuple[int, tuple[int, ...]], _Graph] = {}
        self._pool: Any = None
        self.replays = 0

    def meta(self, decodes: Sequence[SeqWork], ids: list[int]) -> StepMeta:
        """The padded step: decodes and ids to the batch bucket, keys to the span bucket."""
        nd = len(decodes)
        nb = bucket_for(nd, self.buckets)
        spans = [span_bucket(max(s.end - first_key(s.end - 1, geo.window) for s in decodes),
                             geo.tpb) for geo in self.geoms]
        padded = pad_decodes(decodes, nb)
        ids = ids + [ids[-1]] * (nb - nd)
        return build_step(self.geoms, padded, [], ids, list(range(nb)), spans=spans,
                          real_decodes=nd)

    def run(self, meta: StepMeta, real: int) -> torch.Tensor:
        """The logits of the ``real`` decodes of a padded step."""
        if not self.capture:
            return self._eager(meta)[:real]
        key = (meta.num_decodes, tuple(meta.spans))
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._graphs[key] = self._capture(meta)
            except RuntimeError as exc:  # the model does something a graph cannot hold
                print(f"kvpool.engine: CUDA graph capture failed, decoding eagerly: {exc}",
                      file=sys.stderr)
                self.capture = False
                return self._eager(meta)[:real]
        else:
            graph.data.copy_(self.stage(meta.data), non_blocking=True)
            graph.graph.replay()
            self.replays += 1
        return graph.logits[:real]

    def _eager(self, meta: StepMeta) -> torch.Tensor:
        return self.forward(self.stage(meta.data).to(self.device, non_blocking=True), meta)

    def _capture(self, meta: StepMeta) -> _Graph:
        data = torch.empty(meta.data.size, dtype=torch.long, device=self.device)
        data.copy_(self.stage(meta.data), non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.forward(data, meta)  # warm-up: computes this step (same writes as replay)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward(data, meta)
        if self._pool is None:
            self._pool = graph.pool()
        graph.replay()
        return _Graph(data, graph, logits)


class _Graph:
    __slots__ = ("data", "graph", "logits")

    def __init__(self, data: torch.Tensor, graph: Any, logits: torch.Tensor) -> None:
        self.data = data
        self.graph = graph
        self.logits = logits
