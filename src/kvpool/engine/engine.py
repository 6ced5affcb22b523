"""The engine: requests in, tokens out, one scheduler step at a time.

Each step runs the transformers model once over the step's packed tokens with kvpool's
attention (:mod:`kvpool.engine.attention`), ``past_key_values=None``: the only KV cache is
the manager's pool tensors. Hybrid models (Qwen3-Next, Falcon-H1, Jamba, ...) keep each
sequence's recurrent state in its running slot of a state layer group, run by
:mod:`kvpool.engine.recurrent`; after the step the engine saves the checkpoints the
manager's policy asks for (``checkpoint_positions`` / ``save_checkpoint``, docs/hybrid.md).
Single-threaded: one caller drives ``add_request`` / ``step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.core.manager import KVCacheManager
from kvpool.engine.attention import ATTN_IMPLEMENTATION, PoolView, StepBatch, register
from kvpool.engine.graphs import DecodeRunner
from kvpool.engine.layout import ModelLayout, cache_config, model_layout, text_config
from kvpool.engine.recurrent import (
    RecurrentRunner,
    ignores_initial_state,
    save_checkpoints,
    step_states,
)
from kvpool.engine.sampling import SamplingParams, sample
from kvpool.engine.scheduler import Request, Schedule, Scheduler, Status
from kvpool.engine.step_meta import GroupGeom, RowCache, SeqWork, StepMeta, build_step
from kvpool.errors import CapacityError, InvalidArgumentError
from kvpool.validation import check_int, is_int


@dataclass(slots=True)
class RequestOutput:
    """A request's progress after one step (``new_token_ids``) and in total (``token_ids``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str | None
    cached_tokens: int
    finish_reason: str | None
    finished: bool
    logits: list[torch.Tensor] | None = None


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(t) for t in src)
    return frozenset(ids)


class Engine:
    """A continuous-batching engine over one transformers causal LM (see the module docstring).

    ``cache`` holds :class:`kvpool.CacheConfig` fields the model does not decide, as
    :meth:`CacheConfig.from_mapping` reads them (``tokens_per_block``, ``gpu_blocks`` or
    ``gpu_mem``, ``host_blocks`` or ``host_mem``, ``disk_blocks``, ``disk={"path": ...}``,
    ``eviction={"policy": ...}``, ``events={"buffer_max_size": ...}``,
    ``remote={"url": "redis://...", "write": ...}``: a shared remote tier, which the scheduler
    prefetches from before each request's first admission, ...).
    The model's attention implementation is switched to kvpool's; called outside the engine
    it computes transformers' sdpa attention. ``static_decode`` (None: on CUDA) pads
    decode-only steps to bucketed shapes and replays them from CUDA graphs
    (:mod:`kvpool.engine.graphs`; eager on the CPU; never for a hybrid model).
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, cache: dict[str, Any] | None = None,
                 max_batch_size: int = 8, max_num_tokens: int = 2048,
                 static_decode: bool | None = None) -> None:
        check_int("max_batch_size", max_batch_size, 1)
        check_int("max_num_tokens", max_num_tokens, 1)
        if max_num_tokens < max_batch_size:
            raise InvalidArgumentError(
                f"max_num_tokens ({max_num_tokens}) must be >= max_batch_size ({max_batch_size})"
            )
        self.model = model
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device: torch.device = param.device
        self.layout: ModelLayout = model_layout(model.config, param.dtype, model)
        config = cache_config(self.layout, cache, device=str(self.device),
                              max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
        self.max_model_len = min(self.layout.max_model_len, config.max_seq_len)
        self.manager = KVCacheManager(config)
        self.vocab_size = int(text_config(model.config).vocab_size)
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        model.eval()
        self._pools = [
            PoolView(self._rows(g), geo.num_layers, config.tokens_per_block, self.layout.windows[g])
            for g, geo in enumerate(self.layout.geometry[:self.layout.num_attention_groups])
        ]
        self._recurrent = self._recurrent_runner() if self.layout.state_groups else None
        self._geoms = [GroupGeom(p.tpb, p.num_layers, p.window) for p in self._pools]
        self._row_cache = RowCache(self._geoms)
        self._staging = torch.empty(0, dtype=torch.long)
        if static_decode is None:
            static_decode = self.device.type == "cuda" and self._recurrent is None
        if static_decode and self._recurrent is not None:
            raise InvalidArgumentError("static_decode does not run hybrid (recurrent) models")
        self._static = DecodeRunner(self._pools, self._geoms, max_batch_size, self.device,
                                    self._logits, self._stage) if static_decode else None
        self._mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.scheduler = Scheduler(self.manager, max_batch_size, max_num_tokens)
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._eos = _eos_ids(model, tokenizer)
        self._generate_calls = 0
        self._saves: list[tuple[int, int]] = []

    def _recurrent_runner(self) -> RecurrentRunner:
        """The hybrid model's recurrent mixers on the state groups' pools."""
        lay = self.layout
        mixers = lay.mixers or {}
        shapes = lay.state_shapes or {}
        pools = {g: self.manager.tensors(g, 0) for g in lay.state_groups}
        hidden = int(text_config(self.model.config).hidden_size)
        stepwise = frozenset(layer for layer, mixer in mixers.items()
                             if ignores_initial_state(mixer, shapes[layer], hidden))
        return RecurrentRunner(mixers, lay.state_group, lay.state_index,
                               lambda g, j: (pools[g][0][:, j], pools[g][1][:, j]), stepwise)

    def _rows(self, g: int) -> torch.Tensor:
        pool: torch.Tensor = self.manager.tensors(g, 0)
        return pool.view(-1, pool.shape[-2], pool.shape[-1])

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kw: Any) -> Engine:
        """An engine over ``kvpool.engine.models.load_model(name_or_path)``."""
        from kvpool.engine.models import load_model

        model, tokenizer = load_model(name_or_path)
        return cls(model, tokenizer, **kw)

    # ------------------------------------------------------------------ requests

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("a text prompt needs a tokenizer; pass token ids")
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
        else:
            raise InvalidArgumentError(f"a prompt is a str or a list of token ids, got {prompt!r}")
        if not ids:
            raise InvalidArgumentError("the prompt is empty")
        vocab = self.vocab_size
        for t in ids:
            if not is_int(t) or not 0 <= t < vocab:
                raise InvalidArgumentError(f"prompt token {t!r} is not an id in [0, {vocab})")
        return ids

    def _check_capacity(self, total: int, prompt: int) -> None:
        """Refuse a request no pool can ever hold (all slots free)."""
        cfg = self.manager.config
        tpb = cfg.tokens_per_block
        for g, window in enumerate(self.layout.windows[:self.layout.num_attention_groups]):
            need = -(-total // tpb)
            if window is not None:
                need = min(need, max(-(-prompt // tpb), -(-(window + 1) // tpb) + 1) + 1)
            have = cfg.slots[0][g]
            if need > have:
                raise CapacityError(
                    f"a request of {total} tokens needs {need} blocks in layer group {g}, "
                    f"the cache has {have}: shorten it or give the engine more cache",
                    deficit={g: need - have},
                )

    def add_request(self, request_id: str, prompt: list[int] | str,
                    params: SamplingParams) -> None:
        """Queue a request. Raises (nothing queued) :class:`InvalidArgumentError` on bad input
        and :class:`CapacityError` when the cache can never hold it."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {params!r}")
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError("stop strings need a tokenizer")
        ids = self._prompt_ids(prompt)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidArgumentError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's maximum length {self.max_model_len}"
            )
        self._check_capacity(total, len(ids))
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(request_id, ids, params, gen, list(ids),
                      logits=[] if params.return_logits else None)
        self._requests[request_id] = req
        self.scheduler.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """Stop a request; the next ``step`` reports it once with finish_reason "abort".
        Unknown or finished ids are ignored."""
        req = self._requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return
        self.scheduler.finish(req, "abort")
        self._aborted.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of the requests that progressed or finished."""
        outputs = [self._output(r, []) for r in self._aborted]
        for r in self._aborted:
            self._requests.pop(r.request_id, None)
        self._aborted.clear()
        sched = self.scheduler.schedule()
        if not sched:
            stuck = self.scheduler.waiting and not (self.scheduler.running
                                                    or self.scheduler.suspended)
            if stuck:  # an empty cache cannot admit it: it never will (guards a loop forever)
                req = self.scheduler.waiting[0]
                self.scheduler.finish(req, "abort")
                self._requests.pop(req.request_id, None)
                outputs.append(self._output(req, []))
            return outputs
        with torch.inference_mode():
            try:
                logits, samplers = self._forward(sched)
            finally:  # the recurrent layers are transformers' own again outside the step
                states = self._recurrent.step if self._recurrent is not None else None
                if self._recurrent is not None:
                    self._recurrent.step = None
            tokens = sample(logits, [r.params for r in samplers], [r.generator for r in samplers])
        for req, _, end in sched.prefills:
            self.scheduler.computed(req, end)
        for req in sched.decodes:
            self.scheduler.computed(req, req.seq_len)
        if self._recurrent is not None and states is not None:
            with torch.inference_mode():
                save_checkpoints(self.manager, self._recurrent, self.layout.state_groups,
                                 states.stash, self._saves)
        for i, (req, tok) in enumerate(zip(samplers, tokens, strict=True)):
            if req.logits is not None:
                req.logits.append(logits[i].clone())
            outputs.append(self._append(req, tok))
        self.manager.flush_iteration_events()
        return outputs

    def _forward(self, sched: Schedule) -> tuple[torch.Tensor, list[Request]]:
        """One model call over the step's tokens; the logits of the rows that sample."""
        decodes, prefills, ids, keep, samplers = self._step_work(sched)
        if self._static is not None and not prefills:
            return self._static.run(self._static.meta(decodes, ids), len(decodes)), samplers
        meta = build_step(self._geoms, decodes, prefills, ids, keep)
        if self._recurrent is not None:
            self._recurrent.step, self._saves = step_states(
                self.manager, self.layout.state_groups, len(self.layout.windows),
                [(r.seq_id, r.seq_len - 1) for r in sched.decodes],
                [(r.seq_id, a, b) for r, a, b in sched.prefills], self.device)
        return self._logits(self._stage(meta.data).to(self.device, non_blocking=True),
                            meta), samplers

    def _logits(self, data: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """The model over a step's metadata on the device; fp32 logits of the kept rows.
        Everything on the device is built here (CUDA graphs capture this call)."""
        static = "write_src" in meta.segments
        batch = StepBatch(self._pools, self.layout.layer_group, self.layout.layer_index,
                          meta, data, masked=static)
        seg = meta.segments
        n, keep = seg["ids"].length, seg["keep"]
        out = self.model(
            input_ids=data[:n][None],
            position_ids=data[seg["pos"].offset:seg["pos"].offset + n][None],
            attention_mask=self._mask,
            past_key_values=None,
            use_cache=False,
            # every row sampled (decodes only): no index at all
            logits_to_keep=0 if keep.length == n else data[keep.offset:keep.offset
                                                           + keep.length],
            kvpool_batch=batch,
        )
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def _step_work(self, sched: Schedule) -> tuple[list[SeqWork], list[SeqWork], list[int],
                                                    list[int], list[Request]]:
        """The step's decodes and prefills, packed ids, kept rows and sampling requests."""
        ids: list[int] = []
        keep: list[int] = []
        samplers: list[Request] = []
        groups = range(len(self._pools))  # the attention groups
        block_ids = self.manager.block_ids
        cache = self._row_cache
        cache.step()
        decodes: list[SeqWork] = []
        prefills: list[SeqWork] = []
        for req in sched.decodes:
            n, seq = req.seq_len, req.seq_id
            ids.append(req.tokens[n - 1])
            decodes.append(SeqWork([cache.rows(seq, g, block_ids(seq, g)) for g in groups],
                                   n - 1, n))
            samplers.append(req)
        keep += range(len(ids))
        for req, start, end in sched.prefills:
            ids += req.tokens[start:end]
            seq = req.seq_id
            prefills.append(SeqWork([cache.rows(seq, g, block_ids(seq, g)) for g in groups],
                                    start, end))
            if end == req.seq_len:
                keep.append(len(ids) - 1)
                samplers.append(req)
        return decodes, prefills, ids, keep, samplers

    def _stage(self, data: Any) -> torch.Tensor:
        """The step's int64 metadata as a host tensor: shared with numpy on the CPU; on CUDA
        in a pinned buffer, which the device copies from without a sync (the buffer is
        rewritten only after the step's tokens were read back, which waits for that copy)."""
        host = torch.from_numpy(data)
        if self.device.type != "cuda":
            return host
        if self._staging.numel() < host.numel():
            self._staging = torch.empty(max(host.numel(), 2 * self._staging.numel()),
                                        dtype=torch.long, pin_memory=True)
        staged = self._staging[:host.numel()]
        staged.copy_(host)
        return staged

    def _append(self, req: Request, token: int) -> RequestOutput:
        """Record a sampled token, check the stop conditions, report the request."""
        req.tokens.append(token)
        p = req.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self._eos):
            reason = "stop"
        elif req.num_generated >= p.max_tokens:
            reason = "length"
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.tokens[len(req.prompt):],
                                             skip_special_tokens=True)
            if p.stop and self._hit_stop(req):
                reason = "stop"
        if reason is not None:
            self.scheduler.finish(req, reason)
            self._requests.pop(req.request_id, None)
        return self._output(req, [token])

    def _hit_stop(self, req: Request) -> bool:
        """Truncate ``req.text`` before the first stop string it contains."""
        text = req.text or ""
        longest = max(len(s) for s in req.params.stop)
        begin = max(0, req.stop_checked - longest + 1)
        req.stop_checked = len(text)
        hits = [i for i in (text.find(s, begin) for s in req.params.stop) if i >= 0]
        if not hits:
            return False
        req.text = text[:min(hits)]
        return True

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt,
            token_ids=req.tokens[len(req.prompt):],
            new_token_ids=new,
            text=req.text,
            cached_tokens=max(req.cached_tokens, 0),
            finish_reason=req.finish_reason,
            finished=req.status is Status.FINISHED,
            logits=list(req.logits) if req.logits is not None else None,
        )

    def generate(self, prompts: Sequence[list[int] | str],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run ``prompts`` to completion; one final output per prompt, in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidArgumentError(
                f"{len(params)} SamplingParams for {len(prompts)} prompts"
            )
        self._generate_calls += 1
        ids = [f"generate-{self._generate_calls}-{i}" for i in range(len(prompts))]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params, strict=True):
                self.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            for rid in added:
                self.abort(rid)
            self._aborted = [r for r in self._aborted if r.request_id not in added]
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
