"""Prefill worker: computes prompts' KV (batched under a token budget), samples the first token and
holds each request's KV for exactly one pull by a decode worker.

Finished prompts' full KV blocks stay in the worker's pool (an LRU of cached blocks) and serve any
later prompt that starts with the same blocks. With a prefix index configured, the worker publishes
which blocks it holds (``IndexPublisher``), so the router can send such prompts here.

The KV leaves as the return value of the Ray actor method ``pull_kv``: the caller (a decode worker)
owns the returned object, so it lives exactly as long as the decode worker holds it. Nothing is
``ray.put`` here, and no object ref ever travels out of band.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc
from opentelemetry.trace import SpanKind

from baton import metrics
from baton.api import InvalidRequestError, check_stop
from baton.api.proto import priority_from_proto, top_logprobs_to_proto
from baton.engine.engine import RequestOutput
from baton.services.handoff import kv_nbytes, kv_to_numpy
from baton.services.prefix_index import IndexPublisher, IndexSpec
from baton.services.worker import ActiveCounter, EngineLoop, Rpc, WorkerBase, WorkerSpec
from baton.tracing import Tracing, child_span, extract, record_error
from baton.v1 import worker_pb2 as wpb
from baton.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Export:
    kv: dict
    nbytes: int
    expires: float


class PrefillService(wgrpc.PrefillWorkerServicer):
    def __init__(self, name: str, loop: EngineLoop, max_export_bytes: int, export_lease_s: float,
                 tracing: Tracing | None = None) -> None:
        self.name = name
        self.loop = loop
        self.model = loop.engine.model_config.name
        self.max_export_bytes = max_export_bytes
        self.export_lease_s = export_lease_s
        self.tracing = tracing or Tracing(None, "prefill")
        self._exports: dict[str, _Export] = {}
        self._lock = threading.Lock()
        self.active = ActiveCounter()
        self.prefills = 0  # answered
        self.cached_tokens = 0  # prompt tokens of those that came from the prefix cache

    # -- gRPC ---------------------------------------------------------------------------------------------

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillResponse:
        attrs = {"baton.worker": self.name, "baton.request.id": request.request_id,
                 "gen_ai.usage.input_tokens": len(request.prompt_token_ids)}
        with self.active, Rpc(self.tracing, "baton.prefill.worker", context, attrs) as rpc:
            return self._prefill(request, context, rpc)

    def _prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext, rpc: Rpc) -> wpb.PrefillResponse:
        span = rpc.span
        params = rpc.params(request.sampling)
        if self.export_bytes() >= self.max_export_bytes:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"prefill worker {self.name} holds {self.export_bytes()} bytes of KV not yet pulled")
        rid = request.request_id
        # The prefill worker samples exactly one token; the decode worker continues.
        first_only = dataclasses.replace(params, max_tokens=1)
        engine = self.loop.engine
        ids = list(request.prompt_token_ids)
        grammar = rpc.grammar(engine.grammars, params, self.model, self.name)
        adapter = rpc.adapter(engine, request.adapter)
        try:
            prio = priority_from_proto(request.priority)
            q = self.loop.add(rid, lambda: engine.add_request(ids, first_only, request_id=rid, export_kv=True,
                                                             priority=prio, grammar=grammar, adapter=adapter),
                              check=lambda: engine.check_prompt(ids))
        except InvalidRequestError as e:
            rpc.invalid(e)
        context.add_callback(lambda: self.loop.abort(rid))
        out = rpc.check(q.get(), "prefill")
        if out is None:
            context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was cancelled")
        if not out.token_ids:  # ended at scheduling: the pool cannot hold the prompt now
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"prefill worker {self.name} cannot hold {len(ids)} prompt tokens in its KV cache now")
        self._observe(out, span)
        first = out.token_ids[0]
        # The decode worker's scheduler would end the request on this token by the same rule.
        finish = check_stop(params, first, 1, len(ids) + 1, engine.max_model_len, engine.tokenizer.eos_token_ids,
                            out.constraint_done)
        resp = wpb.PrefillResponse(first_token=first, cached_prompt_tokens=out.cached_prompt_tokens,
                                   sampler_state=out.sampler_state, worker=self.name,
                                   finish_reason=finish.value if finish else "", adapters=engine.adapters.held())
        if out.logprobs:
            resp.first_logprob = out.logprobs[0]
        if out.top_logprobs:
            resp.first_top_logprobs.CopyFrom(top_logprobs_to_proto(out.top_logprobs[0]))
        self.prefills += 1
        self.cached_tokens += out.cached_prompt_tokens
        rpc.finished = True
        if finish is None and context.is_active():
            t0 = time.time()
            kv = kv_to_numpy(out.kv)
            nbytes = kv_nbytes(kv)
            with self._lock:
                self._exports[rid] = _Export(kv, nbytes, time.monotonic() + self.export_lease_s)
            resp.kv_bytes = nbytes
            child_span(self.tracing.tracer, "baton.kv.export", span, t0, time.time(), {"baton.kv.bytes": nbytes})
        return resp

    def _observe(self, out: RequestOutput, span) -> None:
        """Metrics and the queue / compute spans, from the engine's timeline of the request."""
        m, w = self.model, self.name
        if out.scheduled_time is not None and out.arrival_time is not None:
            metrics.QUEUE_TIME.labels(m, w).observe(out.scheduled_time - out.arrival_time)
        if out.first_token_time is not None and out.scheduled_time is not None:
            metrics.PREFILL_TIME.labels(m, w).observe(out.first_token_time - out.scheduled_time)
        tracer = self.tracing.tracer
        child_span(tracer, "baton.prefill.queue", span, out.arrival_time, out.scheduled_time)
        child_span(tracer, "baton.prefill.compute", span, out.scheduled_time, out.first_token_time,
                   {"baton.prefix.cached_tokens": out.cached_prompt_tokens,
                    "baton.prefill.computed_tokens": out.prompt_tokens - out.cached_prompt_tokens})
        span.set_attribute("baton.prefix.cached_tokens", out.cached_prompt_tokens)

    def Release(self, request: wpb.ReleaseRequest, context: grpc.ServicerContext) -> wpb.ReleaseResponse:
        with self._lock:
            return wpb.ReleaseResponse(released=self._exports.pop(request.request_id, None) is not None)

    # -- Ray data plane -----------------------------------------------------------------------------------

    def take_export(self, request_id: str, carrier: dict | None = None) -> dict:
        span = self.tracing.tracer.start_span("baton.kv.pull", kind=SpanKind.SERVER,
                                              context=extract(carrier) if self.tracing.enabled else None,
                                              attributes={"baton.worker": self.name, "baton.request.id": request_id})
        try:
            return self._take_export(request_id, span)
        except Exception as e:
            record_error(span, e)
            raise
        finally:
            span.end()

    def _take_export(self, request_id: str, span) -> dict:
        with self._lock:
            exp = self._exports.pop(request_id, None)
        if exp is None:
            raise KeyError(f"prefill worker {self.name} holds no KV for request {request_id!r} "
                           "(never prefilled here, already pulled, or its lease expired)")
        span.set_attribute("baton.kv.bytes", exp.nbytes)
        return exp.kv

    def export_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._exports.values())

    def num_exports(self) -> int:
        with self._lock:
            return len(self._exports)

    def expire(self) -> int:
        now = time.monotonic()
        with self._lock:
            dead = [rid for rid, e in self._exports.items() if e.expires < now]
            for rid in dead:
                del self._exports[rid]
        if dead:
            log.warning("dropped %d KV exports nobody pulled within %.0f s", len(dead), self.export_lease_s)
        return len(dead)


class PrefillWorker(WorkerBase):
    """A Ray actor (wrapped with ray.remote by the launcher): an engine, a gRPC server, KV exports."""

    kind = "prefill"

    def __init__(self, spec: WorkerSpec, max_export_bytes: int, export_lease_s: float,
                 index: IndexSpec | None = None) -> None:
        """max_export_bytes: KV held for pulls at most (more: RESOURCE_EXHAUSTED); export_lease_s: an export
        nobody pulled within this is dropped; index: where to publish the blocks this worker caches."""
        super().__init__(spec)
        name = spec.name
        self.publisher: IndexPublisher | None = None
        if index is not None:
            pool = self.engine.pool
            self.publisher = IndexPublisher(index.connect(), name, lambda: self.loop.call(pool.cached_hashes),
                                            ttl_s=index.ttl_s, model=self.model)
            # Set before any request arrives; from then on the hooks run on the engine thread.
            pool.on_cache, pool.on_evict = self.publisher.cached, self.publisher.evicted
            self.publisher.start()
        self.service = PrefillService(name, self.loop, max_export_bytes, export_lease_s, self.tracing)
        self._serve(lambda server: wgrpc.add_PrefillWorkerServicer_to_server(self.service, server), 64)
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        while True:
            time.sleep(1.0)
            self.service.expire()

    def pull_kv(self, request_id: str, carrier: dict | None = None) -> dict:
        """Hand the request's KV to the caller ({"kv": ndarray, "dtype": str}); the export is dropped here.
        carrier: the caller's W3C trace context, so the pull joins the request's trace."""
        return self.service.take_export(request_id, carrier)

    def idle(self) -> bool:
        return super().idle() and self.service.num_exports() == 0

    def shutdown(self) -> None:
        super().shutdown()
        if self.publisher is not None:
            self.publisher.stop()

    def stats(self) -> dict:
        pool, s, p = self.engine.pool, self.service, self.publisher
        return {"exports": s.num_exports(), "export_bytes": s.export_bytes(),
                "free_blocks": pool.num_free_blocks, "num_blocks": pool.num_blocks,
                "cached_blocks": pool.num_cached_blocks, "requests": self.engine.num_requests,
                "active_prefills": s.active.value, "prefills": s.prefills, "cached_tokens": s.cached_tokens,
                "index_available": p.available if p else None, "index_blocks": p.num_held if p else 0,
                "grammar_compiles": self.engine.grammars.compiles, "grammar_hits": self.engine.grammars.hits}


__all__ = ["PrefillWorker"]
