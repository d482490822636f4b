"""The single-process engine: continuous batching over one model and one KV pool.

``step()`` is three calls with typed hand-offs: ``schedule() -> SchedulerOutput`` (with speculative drafts
added to its decodes when speculation is on: ``with_drafts``), ``execute(output, accept)`` (each sampled token
goes to the scheduler's ``accept`` as it is drawn; returns the accepted draft tokens), ``finish_pass(output,
accepted) -> finished``; then new tokens are detokenized (stop strings end a request here) and returned as
per-request deltas.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from baton.api import FinishReason, InvalidRequestError, Priority, SamplingParams, TopLogprobs
from baton.api.prefix import adapter_root
from baton.api.prompts import check_prompt_ids
from baton.config import ConfigError, EngineConfig
from baton.detokenizer import IncrementalDetokenizer
from baton.engine.block_pool import BlockPool
from baton.engine.device import resolve_device, resolve_dtype
from baton.engine.model_runner import KV_DTYPES, KVCache, KVSnapshot, ModelRunner, kv_cache_dtype, token_slots
from baton.engine.sampling import SamplingState, seed_bytes, seed_from_bytes
from baton.engine.scheduler import Scheduler, SchedulerConfig
from baton.engine.sequence import Sequence, SequenceStatus
from baton.engine.speculative import make_speculator
from baton.engine.weights import engine_weights
from baton.grammar import CompiledGrammar, Grammars
from baton.kernels import cpu as cpu_kernels
from baton.loader import LoadedModel
from baton.memory import MemoryReport
from baton.model.attention import AttentionMetadata, TritonAttention, make_backend
from baton.model.llama import LlamaModel
from baton.model.lora import AdapterCache, LoraAdapter, LoraSlots, SlotTable

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta), or a whole result from ``generate``."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None  # one per token when the request asked for top_logprobs
    # Timeline (wall clock, seconds): arrival, first admitted into a pass, first token; None until known.
    arrival_time: float | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # Prefill hand-off (requests added with export_kv=True), on the output with the first token:
    kv: KVSnapshot | None = None  # the prompt's K/V, on CPU
    sampler_state: bytes = b""  # the request's seed (sampling.seed_bytes): all a worker needs to draw on exactly
    constraint_done: bool = False  # structured output: the structure is complete (ends the request)
    # Speculative decoding, on the finished output: the passes with proposed tokens for the request, the proposed
    # tokens computed, and of them kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(eq=False)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    export_kv: bool = False
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    kv: KVSnapshot | None = None
    adapter: LoraAdapter | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded, weights, self.weights_source = engine_weights(config, loaded)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.weights == "q4" or config.attention == "cpu":
            what = "--weights q4" if config.weights == "q4" else "the cpu attention backend"
            if self.device.type != "cpu":
                raise ConfigError(f"{what} runs on CPU only")
            try:
                cpu_kernels.library()
            except cpu_kernels.KernelBuildError as e:
                raise ConfigError(f"{what} needs the CPU kernels: {e}") from e
        if config.kv_dtype != "auto" and config.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"unsupported kv dtype {config.kv_dtype!r}; choose auto, {', '.join(KV_DTYPES)}")
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        mc = self.model_config
        self.model = LlamaModel(mc, weights, self.dtype, self.device, make_backend(config.attention, self.device),
                                max_positions=self.max_model_len, weight_mode=config.weights)
        # No copy of the file's weights stays: the model holds them in the layout its kernels read.
        self.loaded = dataclasses.replace(self.loaded, weights={})
        del weights
        kv_dtype = kv_cache_dtype(config.kv_dtype, self.model, self.dtype)
        per_block = KVCache.bytes_per_block(mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim,
                                            kv_dtype)
        num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory} bytes is less than one KV block "
                              f"({per_block} bytes)")
        self.kv_cache = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                                kv_dtype, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, sample_vocab_size=self.tokenizer.vocab_size)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, prefill_chunk=config.prefill_chunk,
            prefill_order=config.prefill_order,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            window=self.model_config.kv_window,
        ), self.pool)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._pending_emit: list[_Request] = []  # prefilled arrivals whose first token is not yet emitted
        self.last_batch = (0, 0)  # sequences and tokens in the latest forward pass
        self._grammars: Grammars | None = None
        # LoRA: the adapters this engine holds (loaded on first use, any thread) and, made at the first adapter
        # request, the model's slots; requests whose adapter finds no free slot wait in _parked, in order.
        self.adapters = AdapterCache(mc, config.max_loras, config.max_lora_rank)
        self.slot_table: SlotTable | None = None
        self.on_adapter_evict: Callable[[], None] | None = None  # an adapter lost its slot (a worker's metrics)
        self._parked: list[_Request] = []
        self.speculator = (make_speculator(config, mc, self.tokenizer, num_blocks, self.max_model_len, self.dtype,
                                           self.device) if config.speculative != "off" else None)
        self._same_bits_rows = self.model.weights.same_bits_rows()

    def memory(self) -> MemoryReport:
        """This process's memory by part: the weights (and whether they are shared), the KV pool, the rest."""
        kv = [t for c in self.kv_cache.layers for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
        return MemoryReport.measure(self.model.weights.tensors(), kv)

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler for this tokenizer (thread-safe; built at first use)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer)
        return self._grammars

    @property
    def last_masks(self) -> tuple[float, float] | None:
        """Structured output in the latest pass: seconds computing token masks, and seconds the sampler
        waited for them after the forward pass; None when no row was constrained."""
        return self.runner.masker.last

    def _matcher(self, params: SamplingParams, grammar: CompiledGrammar | None):
        if params.constraint is None:
            return None
        if grammar is None or grammar.key != params.constraint.key:
            grammar, _ = self.grammars.compile(params.constraint)
        return grammar.matcher()

    # -- requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt", "prompt is empty")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams,
                    request_id: str | None = None, export_kv: bool = False,
                    priority: Priority = Priority.INTERACTIVE, grammar: CompiledGrammar | None = None,
                    adapter: LoraAdapter | None = None) -> str:
        """Queue a request; raises InvalidRequestError (naming the field) when it cannot be served.

        export_kv: the output that carries the first token also carries the prompt's KV and the
        sampler state, for a hand-off to another engine (a prefill worker sets it).
        grammar: the params' constraint, compiled (``grammars.compile``) off the engine's thread; without
        it a constrained request is compiled here.
        adapter: a LoRA adapter (from ``adapters.get``) the request runs under; None: the base model.
        """
        ids = self.check_prompt(prompt_token_ids)
        request_id = self._new_id(request_id)
        state = SamplingState.create(params, ids, self.device, self._matcher(params, grammar))
        seq = Sequence(request_id, ids, len(ids), state, time.time(), priority=Priority(priority))
        req = _Request(seq, IncrementalDetokenizer(self.tokenizer, ids, params.stop), export_kv=export_kv)
        self._admit(req, adapter)
        return request_id

    def _admit(self, req: _Request, adapter: LoraAdapter | None) -> None:
        """Register a new request and queue it for the scheduler, once its adapter holds a model slot."""
        self._requests[req.seq.request_id] = req
        if adapter is not None:
            req.adapter = adapter
            req.seq.hash_root = adapter_root(adapter.content_id)
            if self.slot_table is None:
                slots = LoraSlots(self.model_config, self.config.max_loras, self.config.max_lora_rank, self.dtype,
                                  self.device, triton=isinstance(self.model.backend, TritonAttention))
                self.model.lora, self.slot_table = slots, SlotTable(slots)
                self.slot_table.on_evict = lambda: self.on_adapter_evict and self.on_adapter_evict()
            # behind parked requests unless its adapter holds a slot already (then it takes nothing from them)
            if (self._parked and not self.slot_table.holds(adapter.content_id)) or not self._pin(req):
                self._parked.append(req)
                return
        self.scheduler.add(req.seq)

    def _pin(self, req: _Request) -> bool:
        slot = self.slot_table.acquire(req.adapter)
        if slot is None:
            return False
        req.seq.lora_slot = slot
        return True

    def _unpin(self, req: _Request) -> None:
        if req.seq.lora_slot >= 0:
            self.slot_table.release(req.seq.lora_slot)
            req.seq.lora_slot = -1

    def _unpark(self) -> None:
        """Parked requests whose adapter now finds a slot join the scheduler, first come first."""
        if not self._parked:
            return
        waiting = []
        for req in self._parked:
            if self._pin(req):
                self.scheduler.add(req.seq)
            else:
                waiting.append(req)
        self._parked = waiting

    def check_prompt(self, prompt_token_ids: Seq[int]) -> list[int]:
        """The prompt as a list, or InvalidRequestError naming the field. Reads only settings, so any
        thread may call it."""
        ids = check_prompt_ids(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        need = -(-(len(ids) + 1) // self.pool.block_size)
        if need > self.pool.num_blocks:
            raise InvalidRequestError(
                "prompt", f"prompt needs {need} KV blocks but the cache has {self.pool.num_blocks}; "
                "raise the KV cache memory or shorten the prompt")
        return ids

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"request id {request_id!r} is already in use")
        return request_id

    # -- hand-off from a prefill engine ---------------------------------------------------------------

    def reserve_blocks(self, num_tokens: int) -> list[int] | None:
        """Blocks for an incoming prefilled request, taken before its KV is pulled; None if the pool is
        short (backpressure: the caller refuses or retries, nothing is pulled)."""
        return self.pool.allocate(-(-num_tokens // self.pool.block_size))

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back a reservation whose KV never arrived."""
        self.pool.free(block_ids)

    def add_prefilled(self, prompt_token_ids: Seq[int], first_token: int | Seq[int], params: SamplingParams,
                      block_ids: list[int], kv: KVSnapshot, request_id: str | None = None,
                      sampler_state: bytes = b"", cached_prompt_tokens: int = 0,
                      first_logprob: float | None = None, priority: Priority = Priority.INTERACTIVE,
                      first_top_logprobs: TopLogprobs | None = None, grammar: CompiledGrammar | None = None,
                      adapter: LoraAdapter | None = None) -> str:
        """Continue a request whose prompt was computed elsewhere: ``kv`` (the prompt's K/V) goes into
        ``block_ids`` (from ``reserve_blocks``, now owned by the request) and the first token is emitted
        by the next ``step`` (or ``emit_arrivals``). A constrained request's matcher is rebuilt from
        ``grammar`` and replays the first token; a first token the grammar refuses is a ValueError.

        A migrated request (its worker died mid-stream) passes every token it has generated so far as
        ``first_token`` (a list); ``kv`` then covers the prompt and all of them but the last. They are
        emitted together, before any step (the client has them already), and the request goes on as it
        would have: penalties, the constraint, ``max_tokens`` and the seeded draws (``sampler_state``: the
        request's seed) all count them."""
        ids = self.check_prompt(prompt_token_ids)
        done = [first_token] if isinstance(first_token, int) else [int(t) for t in first_token]
        if not done:
            raise ValueError("a prefilled request needs its first token")
        if len(ids) + len(done) > self.max_model_len:
            raise InvalidRequestError("prompt_token_ids", f"the prompt and {len(done)} generated tokens exceed "
                                      f"the {self.max_model_len}-token context")
        if len(done) > params.max_tokens:
            raise ValueError(f"{len(done)} generated tokens are more than max_tokens {params.max_tokens}")
        request_id = self._new_id(request_id)
        known = len(ids) + len(done) - 1
        if kv.num_tokens != known:
            raise ValueError(f"KV covers {kv.num_tokens} tokens but the prompt and the generated tokens but the "
                             f"last have {known}")
        state = SamplingState.create(params, ids, self.device, self._matcher(params, grammar),
                                     seed=seed_from_bytes(sampler_state))
        for token in done:
            state.append(token)
            if state.constraint_failed:
                raise ValueError(f"the generated token {token} does not fit the request's constraint")
        self.kv_cache.write(block_ids, kv)
        now = time.time()
        seq = Sequence(request_id, ids + done, len(ids), state, now, first_token_time=now,
                       block_ids=list(block_ids), num_computed_tokens=known,
                       num_cached_tokens=cached_prompt_tokens, priority=Priority(priority))
        req = _Request(seq, IncrementalDetokenizer(self.tokenizer, ids, params.stop), new_tokens=list(done))
        if len(done) == 1:  # a migrated request's earlier log-probs are the client's already
            if first_logprob is not None:
                req.new_logprobs.append(first_logprob)
            if first_top_logprobs is not None:
                req.new_top_logprobs.append(first_top_logprobs)
        self._admit(req, adapter)
        self._pending_emit.append(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks; False if it is unknown or already done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._finish(req, FinishReason.CANCELLED)
        return True

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        """End a request in the scheduler, or, parked (its adapter waits for a slot), outside it: its blocks (a
        hand-off's KV) freed here. Its slot is unpinned either way."""
        seq = req.seq
        if req in self._parked:
            self._parked.remove(req)
            if seq.finish_reason is None:
                self.pool.free(seq.held_block_ids)
                seq.block_ids = []
                seq.finish_reason = reason
                seq.status = SequenceStatus.FINISHED
        else:
            self.scheduler.finish(seq, reason)
        self._unpin(req)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- one step ---------------------------------------------------------------------------------------

    def emit_arrivals(self) -> list[RequestOutput]:
        """The first tokens of prefilled arrivals (``add_prefilled``), without waiting for a forward
        pass. ``step`` calls it first; a serving loop calls it as soon as requests arrive, so the first
        token is not held back by a whole decode step."""
        pending, self._pending_emit = self._pending_emit, []
        return [self._emit(r) for r in pending if r.seq.request_id in self._requests]

    def step(self) -> list[RequestOutput]:
        early = self.emit_arrivals()  # first: the first token may also stop a request
        self._unpark()
        out = self.scheduler.schedule()
        touched = {s.request_id: self._requests[s.request_id] for s in out.finished}
        start = time.perf_counter()  # the pass's time, proposals included, teaches the speculator
        if self.speculator is not None and out.decodes:
            drafts = self.speculator.propose([s.seq for s in out.decodes], self.scheduler.reserve)
            out = self.scheduler.with_drafts(out, drafts, self._same_bits_rows)
        self.last_batch = (len(out.scheduled), out.num_tokens)  # occupancy of this pass, for metrics
        if not out.is_empty:
            def accept(seq: Sequence, token: int, lp: float | None, top: TopLogprobs | None) -> bool:
                going = self.scheduler.accept(seq, token)
                req = self._requests[seq.request_id]
                req.new_tokens.append(token)
                if seq.first_token_time is None:
                    seq.first_token_time = time.time()
                if req.export_kv and seq.num_output_tokens == 1:
                    snap = self.kv_cache.read(seq.block_ids, seq.num_prompt_tokens)
                    req.kv = KVSnapshot(snap.values.cpu(), None if snap.scales is None else snap.scales.cpu())
                if lp is not None:
                    req.new_logprobs.append(lp)
                if top is not None:
                    req.new_top_logprobs.append(top)
                touched[seq.request_id] = req
                return going

            accepted = self.runner.execute(out, accept)
            seconds = time.perf_counter() - start
            self.scheduler.finish_pass(out, accepted)
            if self.speculator is not None and out.decodes:
                self.speculator.record([(s.seq, len(s.draft)) for s in out.decodes], accepted,
                                       sum(s.num_tokens for s in out.decodes), seconds, decode_only=not out.prefills)
        return early + [self._emit(req) for req in touched.values()]

    def _emit(self, req: _Request) -> RequestOutput:
        seq = req.seq
        text, stopped = "", False
        # One token at a time, as decoding without speculation feeds them: a stop string ends the request at
        # the token that completes it, and the tokens a pass accepted after it are dropped (never sent, not
        # counted).
        for i, token in enumerate(req.new_tokens):
            part, stopped = req.detok.add([token])
            text += part
            if stopped:
                extra = len(req.new_tokens) - i - 1
                if extra:
                    del req.new_tokens[i + 1:], req.new_logprobs[i + 1:], req.new_top_logprobs[i + 1:]
                    del seq.token_ids[len(seq.token_ids) - extra:]
                    seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
                self._finish(req, FinishReason.STOP)
                seq.finish_reason = FinishReason.STOP  # before any end the dropped tokens reached
                break
        finished = seq.finish_reason is not None
        if finished and not stopped:
            text += req.detok.flush()
        if finished:
            del self._requests[seq.request_id]
            self._finish(req, seq.finish_reason)
        out = RequestOutput(
            request_id=seq.request_id, token_ids=req.new_tokens, text=text, finished=finished,
            finish_reason=seq.finish_reason.value if finished else None,
            prompt_tokens=seq.num_prompt_tokens, cached_prompt_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_output_tokens,
            logprobs=req.new_logprobs if seq.params.logprobs else None,
            top_logprobs=req.new_top_logprobs if seq.params.top_logprobs else None,
            arrival_time=seq.arrival_time, scheduled_time=seq.scheduled_time, first_token_time=seq.first_token_time,
            constraint_done=seq.sampling.constraint_done,
        )
        if finished and seq.spec is not None:
            out.spec_drafts, out.spec_draft_tokens = seq.spec.drafts, seq.spec.draft_tokens
            out.spec_accepted_tokens = seq.spec.accepted_tokens
        if req.kv is not None:
            out.kv, req.kv = req.kv, None
            out.sampler_state = seed_bytes(seq.sampling.seed)
        req.new_tokens, req.new_logprobs, req.new_top_logprobs = [], [], []
        return out

    # -- evaluation -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, token_ids: Seq[int], chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """For each position i >= 1: log p(token_i | tokens before it) and the model's top-1 prediction.

        Runs through the paged cache in chunks, so later chunks attend to earlier tokens as stored
        (quantized when the KV cache is int8), as generation does. Returns two [n - 1] tensors
        (float32 log-probs, int64 argmax ids)."""
        ids = self.check_prompt(token_ids)
        blocks = self.reserve_blocks(len(ids))
        if blocks is None:
            raise InvalidRequestError("prompt", f"the KV cache cannot hold {len(ids)} tokens right now")
        bs, dev = self.pool.block_size, self.device
        logprobs, top1 = [], []
        try:
            for start in range(0, len(ids), chunk):
                part = ids[start:start + chunk]
                pos = torch.arange(start, start + len(part))
                meta = AttentionMetadata(token_slots(blocks, start, start + len(part), bs, dev), None,
                                         (self.runner.prefill_span(0, start, len(part), blocks, bs),))
                logits = self.model.forward(torch.tensor(part, device=dev), pos.to(dev), self.kv_cache.layers, meta,
                                            torch.arange(len(part), device=dev))
                lp = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(ids[start + 1:start + len(part) + 1], device=dev)
                rows = torch.arange(len(targets), device=dev)
                logprobs.append(lp[rows, targets].cpu())
                top1.append(logits[: len(targets)].argmax(-1).cpu())
        finally:
            self.release_blocks(blocks)
        return torch.cat(logprobs), torch.cat(top1)

    # -- convenience ----------------------------------------------------------------------------------------

    def generate(self, prompts: Iterable[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 adapters: Seq[LoraAdapter | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching) and return whole results, in order.
        adapters: one per prompt (None: the base model)."""
        prompts = list(prompts)
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        alist = list(adapters) if adapters is not None else [None] * len(prompts)
        ids = [self.add_request(p, sp, adapter=a) for p, sp, a in zip(prompts, plist, alist)]
        results = {i: RequestOutput(i, [], "", False, None, 0, 0, 0, [] if sp.logprobs else None,
                                    [] if sp.top_logprobs else None)
                   for i, sp in zip(ids, plist)}
        while any(not r.finished for r in results.values()):
            for delta in self.step():
                r = results[delta.request_id]
                r.token_ids += delta.token_ids
                r.text += delta.text
                if delta.logprobs is not None:
                    r.logprobs += delta.logprobs
                if delta.top_logprobs is not None:
                    r.top_logprobs += delta.top_logprobs
                r.finished, r.finish_reason = delta.finished, delta.finish_reason
                r.prompt_tokens, r.cached_prompt_tokens = delta.prompt_tokens, delta.cached_prompt_tokens
                r.completion_tokens = delta.completion_tokens
                r.spec_drafts, r.spec_draft_tokens = delta.spec_drafts, delta.spec_draft_tokens
                r.spec_accepted_tokens = delta.spec_accepted_tokens
        return [results[i] for i in ids]

