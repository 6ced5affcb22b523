"""Recurrent layers (Mamba, Mamba2, gated delta net, short convolutions) on kvpool's state slots.

transformers' recurrent mixers (``Qwen3NextGatedDeltaNet``, ``FalconH1Mixer``,
``JambaMambaMixer``, ...) share one calling convention: ``forward(hidden_states, cache_params,
attention_mask)``, reading and writing their state through ``cache_params.get_conv_state``,
``get_recurrent_state``, ``update_conv_state`` and ``update_recurrent_state``. kvpool keeps
each sequence's state in its running slot of a state layer group
(``manager.block_ids(seq, layer_group=g) == [slot]``); :class:`RecurrentRunner` replaces each
mixer's ``forward`` with one that, inside an engine step, splits the step's packed row
``[1, T]`` by sequence so that no two sequences ever share or mix state:

* the decodes (one token each, first in the row) run as one batch ``[decodes, 1, hidden]``
  over their states gathered from their slots, written back after the call;
* each prefill chunk runs on its own, reading and writing its slot in place, cut at the
  positions where the manager wants a checkpoint; the state at a cut is copied aside
  (:attr:`StepStates.stash`) and the engine turns it into a checkpoint after the step.

A sequence computing from position 0 starts from no state (the slot's content is ignored).
Outside an engine step the mixers run as transformers' own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class StateShape:
    """One recurrent layer's state per sequence: its conv window and recurrent (SSM) state."""

    conv: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent: tuple[int, ...]
    recurrent_dtype: torch.dtype


class _StateCache:
    """The part of transformers' ``Cache`` a recurrent mixer calls, over the states ``conv``
    ``[B, C, K]`` and ``rec`` ``[B, ...]`` (views into kvpool's pool, or gathered copies).
    ``fresh``: the sequences start here (no previous state)."""

    def __init__(self, conv: torch.Tensor, rec: torch.Tensor, fresh: bool) -> None:
        self.conv = conv
        self.rec = rec
        self.fresh = fresh

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.rec

    def has_previous_state(self, layer_idx: int | None = None,
                           state_idx: int | None = None) -> bool:
        return not self.fresh

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> torch.Tensor:
        """transformers' ``LinearAttentionLayer.update_conv_state``: the new inputs with the
        left context the causal convolution needs; keeps the last ``K`` in the state."""
        width = self.conv.shape[-1]
        if self.fresh:
            full = conv_states
            if full.shape[-1] < width:
                full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
        else:
            full = torch.cat([self.conv.to(conv_states.dtype), conv_states], dim=-1)
        self.conv.copy_(full[..., -width:])
        self.fresh = False
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        self.rec.copy_(recurrent_states)
        return self.rec


class _Probe(_StateCache):
    """Records the state shapes a mixer writes on a one-token call."""

    def __init__(self) -> None:
        super().__init__(torch.empty(0), torch.empty(0), True)
        self.shape: dict[str, Any] = {}

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> torch.Tensor:
        width = int(kwargs.get("conv_kernel_size") or conv_states.shape[-1])
        self.shape["conv"] = (*conv_states.shape[1:-1], width), conv_states.dtype
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        self.shape["rec"] = tuple(recurrent_states.shape[1:]), recurrent_states.dtype
        return recurrent_states


def recurrent_mixers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Model layer -> its recurrent mixer: every submodule with a ``layer_idx`` whose
    ``forward`` takes ``cache_params`` (transformers' convention for stateful mixers)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            continue
        params = inspect.signature(type(module).forward).parameters
        if "cache_params" in params:
            found[layer] = module
    return found


def ignores_initial_state(mixer: torch.nn.Module, shape: StateShape, hidden_size: int) -> bool:
    """Whether ``mixer``'s multi-token path drops the recurrent state it is given
    (transformers' Jamba scan starts from zeros): such a mixer continues a sequence one token
    at a time, through its single-token path, which reads the state."""
    param = next(mixer.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(1, 2, hidden_size, generator=gen).to(param.device, param.dtype)
    rec = torch.randn(1, *shape.recurrent, generator=gen).to(param.device, shape.recurrent_dtype)
    outs = []
    with torch.inference_mode():
        for state in (rec, torch.zeros_like(rec)):
            conv = torch.zeros(1, *shape.conv, dtype=shape.conv_dtype, device=param.device)
            outs.append(type(mixer).forward(mixer, hidden, cache_params=_StateCache(
                conv, state.clone(), False)))
    return bool(torch.equal(outs[0], outs[1]))


def probe_state(mixer: torch.nn.Module, hidden_size: int) -> StateShape:
    """The state shapes ``mixer`` keeps per sequence, from one call on one zero token."""
    param = next(mixer.parameters())
    probe = _Probe()
    with torch.inference_mode():
        type(mixer).forward(mixer, torch.zeros(1, 1, hidden_size, dtype=param.dtype,
                                               device=param.device), cache_params=probe)
    if "conv" not in probe.shape or "rec" not in probe.shape:
        raise ValueError(f"{type(mixer).__name__} keeps no conv and recurrent state")
    (conv, conv_dtype), (rec, rec_dtype) = probe.shape["conv"], probe.shape["rec"]
    return StateShape(tuple(int(d) for d in conv), conv_dtype, tuple(int(d) for d in rec),
                      rec_dtype)


@dataclass(slots=True)
class Chunk:
    """A prefill chunk: rows ``[t0, t1)`` of the packed row are tokens ``[start, start +
    t1 - t0)`` of a sequence in ``slot``; ``cuts`` are token counts in ``(start, end)`` where
    the state is stashed (keyed by ``(seq_id, count)``)."""

    seq_id: int
    slot: int
    t0: int
    t1: int
    start: int
    cuts: tuple[int, ...] = ()


@dataclass(slots=True)
class StepStates:
    """What the recurrent layers need of one step, per state group: the decodes' slots
    (row order) and which start from nothing, and the prefill chunks."""

    decode_slots: list[torch.Tensor]  # per state group: [decodes] long
    decode_fresh: torch.Tensor | None  # [decodes] bool; None = none fresh
    chunks: list[list[Chunk]]  # per state group
    stash: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict)  # (seq, tokens) -> layer -> (conv, rec) copies


LayerViews = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""(state group, layer index in it) -> (conv ``[slots, ...]``, recurrent ``[slots, ...]``)
views of the group's tier-0 pool."""


class RecurrentRunner:
    """Runs a model's recurrent mixers on kvpool's state slots (see the module docstring).
    ``layer_group``/``layer_index``: per model layer its state group and index in it."""

    def __init__(self, mixers: dict[int, torch.nn.Module], layer_group: Sequence[int],
                 layer_index: Sequence[int], views: LayerViews,
                 stepwise: frozenset[int] = frozenset()) -> None:
        self.views = views
        self.stepwise = stepwise
        self.step: StepStates | None = None
        self.where = {layer: (layer_group[layer], layer_index[layer]) for layer in mixers}
        for layer, mixer in mixers.items():  # a model given to a new engine: rewrapped
            original = getattr(mixer.forward, "kvpool_original", mixer.forward)
            forward = self._wrap(original, layer_group[layer], layer_index[layer], layer)
            forward.kvpool_original = original  # type: ignore[attr-defined]
            mixer.forward = forward

    def states(self, g: int, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the states of every layer of state group g in ``slot``."""
        out = {}
        for layer, (grp, j) in self.where.items():
            if grp == g:
                conv, rec = self.views(g, j)
                out[layer] = (conv[slot].clone(), rec[slot].clone())
        return out

    def load(self, g: int, slot: int, states: dict[int, tuple[torch.Tensor, torch.Tensor]],
             ) -> None:
        """Write per-layer states (of :meth:`states` or a stash) into ``slot`` of group g."""
        for layer, (conv_s, rec_s) in states.items():
            grp, j = self.where[layer]
            if grp == g:
                conv, rec = self.views(g, j)
                conv[slot].copy_(conv_s)
                rec[slot].copy_(rec_s)

    def _wrap(self, original: Callable[..., torch.Tensor], g: int, j: int,
              layer: int) -> Callable[..., torch.Tensor]:
        def forward(hidden_states: torch.Tensor, cache_params: Any = None,
                    attention_mask: Any = None, **kwargs: Any) -> torch.Tensor:
            step = self.step
            if step is None:
                return original(hidden_states, cache_params=cache_params,
                                attention_mask=attention_mask, **kwargs)
            return self._run(original, step, g, j, layer, hidden_states)
        return forward

    def _run(self, mixer: Callable[..., torch.Tensor], step: StepStates, g: int, j: int,
             layer: int, hidden: torch.Tensor) -> torch.Tensor:
        conv_all, rec_all = self.views(g, j)
        outs: list[torch.Tensor] = []
        slots = step.decode_slots[g]
        nd = int(slots.numel())
        if nd:
            conv = conv_all.index_select(0, slots)
            rec = rec_all.index_select(0, slots)
            if step.decode_fresh is not None:
                keep = (~step.decode_fresh).to(conv.dtype)
                conv *= keep.view(-1, *[1] * (conv.dim() - 1))
                rec *= keep.to(rec.dtype).view(-1, *[1] * (rec.dim() - 1))
            out = mixer(hidden[0, :nd, None], cache_params=_StateCache(conv, rec, False))
            conv_all.index_copy_(0, slots, conv)
            rec_all.index_copy_(0, slots, rec)
            outs.append(out.reshape(1, nd, -1))
        for chunk in step.chunks[g]:
            conv, rec = conv_all[chunk.slot:chunk.slot + 1], rec_all[chunk.slot:chunk.slot + 1]
            cache = _StateCache(conv, rec, chunk.start == 0)
            for a, b, stash_at in _pieces(chunk):
                if cache.fresh or layer not in self.stepwise:
                    outs.append(mixer(hidden[:, a:b], cache_params=cache))
                else:  # its multi-token path would drop the state
                    outs += [mixer(hidden[:, t:t + 1], cache_params=cache) for t in range(a, b)]
                if stash_at is not None:
                    step.stash.setdefault((chunk.seq_id, stash_at), {})[layer] = (
                        conv[0].clone(), rec[0].clone())
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _pieces(chunk: Chunk) -> Iterator[tuple[int, int, int | None]]:
    """Row ranges of a chunk cut at its checkpoint positions, with the token count to stash
    after each (None at the chunk's end)."""
    a = chunk.t0
    for cut in chunk.cuts:
        b = chunk.t0 + cut - chunk.start
        yield a, b, cut
        a = b
    yield a, chunk.t1, None


class StateManager(Protocol):
    """What the engine asks of the manager for recurrent state (:class:`KVCacheManager`)."""

    def block_ids(self, seq_id: int, layer_group: int = 0, beam: int = 0) -> list[int]: ...

    def checkpoint_positions(self, seq_id: int, start: int, end: int) -> list[int]: ...

    def save_checkpoint(self, seq_id: int, num_tokens: int) -> Any: ...


def step_states(manager: StateManager, state_groups: Sequence[int], num_groups: int,
                decodes: Sequence[tuple[int, int]], prefills: Sequence[tuple[int, int, int]],
                device: torch.device) -> tuple[StepStates, list[tuple[int, int]]]:
    """A step's :class:`StepStates` and the checkpoints to save after it, ``(seq, tokens)``
    in order. ``decodes``: ``(seq, start)`` in row order; ``prefills``: ``(seq, start, end)``
    after them. Chunks are cut where the manager wants checkpoints inside them."""
    saves: list[tuple[int, int]] = []
    slots: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long, device=device)] * num_groups
    chunks: list[list[Chunk]] = [[] for _ in range(num_groups)]
    for seq, start in decodes:
        saves += [(seq, n) for n in manager.checkpoint_positions(seq, start, start + 1)]
    fresh = [start == 0 for _, start in decodes]
    t0 = len(decodes)
    cuts: list[tuple[int, ...]] = []
    for seq, start, end in prefills:
        want = manager.checkpoint_positions(seq, start, end)
        cuts.append(tuple(n for n in want if n < end))
        saves += [(seq, n) for n in want]
    for g in state_groups:
        slots[g] = torch.tensor([manager.block_ids(seq, g)[0] for seq, _ in decodes],
                                dtype=torch.long, device=device)
        t = t0
        for (seq, start, end), cut in zip(prefills, cuts, strict=True):
            chunks[g].append(Chunk(seq, manager.block_ids(seq, g)[0], t, t + end - start,
                                   start, cut))
            t += end - start
    decode_fresh = (torch.tensor(fresh, dtype=torch.bool, device=device) if any(fresh)
                    else None)
    return StepStates(slots, decode_fresh, chunks), saves


def save_checkpoints(manager: StateManager, runner: RecurrentRunner, state_groups: Sequence[int],
                     stash: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]],
                     saves: Sequence[tuple[int, int]]) -> None:
    """Save the step's checkpoints. One at a step's end is the running slot's state; one cut
    inside a chunk was stashed: it goes into the running slot for the save, and the state
    the step ended with comes back after."""
    for seq, n in saves:
        layers = stash.get((seq, n))
        if layers is None:
            manager.save_checkpoint(seq, n)
            continue
        slots = [(g, manager.block_ids(seq, g)[0]) for g in state_groups]
        final = [(g, s, runner.states(g, s)) for g, s in slots]
        for g, s in slots:
            runner.load(g, s, layers)
        manager.save_checkpoint(seq, n)
        for g, s, states in final:
            runner.load(g, s, states)
