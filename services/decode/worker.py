"""Decode worker: continuous batching over its paged KV pool.

For each request it first reserves the blocks the prompt's KV needs (no room: RESOURCE_EXHAUSTED at
once, so memory pressure is backpressure), then pulls the KV from the prefill worker by calling that
worker's ``pull_kv`` actor method on a gRPC thread (never on the decode loop), writes it into the
reserved blocks and lets the sequence join the running batch at the next step. The pulled object
is owned by this process and dropped as soon as it has been copied into the pool.
"""

from __future__ import annotations

import logging
import time

import grpc
import ray
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from baton import metrics
from baton.api import InvalidRequestError
from baton.api.proto import priority_from_proto, top_logprobs_from_proto
from baton.engine.engine import RequestOutput
from baton.services.handoff import kv_from_numpy, kv_nbytes
from baton.services.worker import ActiveCounter, EngineLoop, Rpc, WorkerBase, WorkerSpec, response_from_output
from baton.tracing import Tracing, child_span, record_error
from baton.v1 import worker_pb2 as wpb
from baton.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class DecodeService(wgrpc.DecodeWorkerServicer):
    def __init__(self, name: str, loop: EngineLoop, namespace: str | None, pull_timeout_s: float,
                 tracing: Tracing | None = None) -> None:
        self.name = name
        self.loop = loop
        self.model = loop.engine.model_config.name
        self.tracing = tracing or Tracing(None, "decode")
        self.namespace = namespace
        self.pull_timeout_s = pull_timeout_s
        self._actors: dict[str, ray.actor.ActorHandle] = {}
        self.active = ActiveCounter()
        self.kv_bytes_received = 0
        self.kv_seconds = 0.0
        self.handoffs = 0

    def _prefill_actor(self, name: str) -> ray.actor.ActorHandle:
        if name not in self._actors:
            self._actors[name] = ray.get_actor(name, namespace=self.namespace)
        return self._actors[name]

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext):
        attrs = {"baton.worker": self.name, "baton.request.id": request.request_id,
                 "baton.prefill.worker": request.prefill_worker}
        with self.active, Rpc(self.tracing, "baton.decode.worker", context, attrs) as rpc:
            yield from self._decode(request, context, rpc)

    def _decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext, rpc: Rpc):
        span = rpc.span
        params = rpc.params(request.sampling)
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        engine = self.loop.engine
        grammar = rpc.grammar(engine.grammars, params, self.model, self.name)
        adapter = rpc.adapter(engine, request.adapter)
        # A migrated request goes on after the tokens it generated elsewhere: its KV covers them but the last.
        generated = list(request.generated_token_ids) or [request.first_token]
        known = len(prompt) + len(generated) - 1
        if request.generated_token_ids:
            span.set_attribute("baton.migration.generated_tokens", len(generated))
        try:
            blocks = self.loop.call(lambda: engine.reserve_blocks(known))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.name} is not answering; retry")
        if blocks is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"decode worker {self.name} has no free KV blocks for {known} tokens")
        owned = True
        try:
            t0 = time.perf_counter()
            timeout = self.pull_timeout_s
            remaining = context.time_remaining()
            if remaining is not None and remaining < timeout:
                timeout = max(0.1, remaining)
            transfer = self.tracing.tracer.start_span(
                "baton.kv.transfer", kind=SpanKind.CLIENT, context=trace.set_span_in_context(span),
                attributes={"baton.prefill.worker": request.prefill_worker})
            try:
                obj = ray.get(self._prefill_actor(request.prefill_worker).pull_kv.remote(
                    rid, self.tracing.inject(transfer)), timeout=timeout)
            except Exception as e:  # noqa: BLE001 - any failed hand-off is reported the same way
                record_error(transfer, e)
                transfer.end()
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"KV hand-off from prefill worker {request.prefill_worker} failed: {e}")
            kv = kv_from_numpy(obj)
            nbytes = kv_nbytes(obj)
            seconds = time.perf_counter() - t0
            transfer.set_attribute("baton.kv.bytes", nbytes)
            transfer.set_attribute("baton.kv.seconds", seconds)
            transfer.end()
            metrics.KV_TRANSFER_BYTES.labels(self.model, self.name).inc(nbytes)
            metrics.KV_TRANSFER_SECONDS.labels(self.model, self.name).observe(seconds)
            self.kv_seconds += seconds
            self.kv_bytes_received += nbytes
            self.handoffs += 1
            if not context.is_active():
                return
            first_lp = request.first_logprob if request.HasField("first_logprob") else None
            first_top = (top_logprobs_from_proto(request.first_top_logprobs)
                         if request.HasField("first_top_logprobs") else None)

            def add(kv=kv) -> None:  # runs on the engine thread, after this handler has moved on
                try:
                    engine.add_prefilled(prompt, generated, params, blocks, kv, request_id=rid,
                                         sampler_state=request.sampler_state,
                                         cached_prompt_tokens=request.cached_prompt_tokens, first_logprob=first_lp,
                                         priority=priority_from_proto(request.priority), first_top_logprobs=first_top,
                                         grammar=grammar, adapter=adapter)
                except BaseException:
                    engine.release_blocks(blocks)
                    raise

            try:
                q = self.loop.add(rid, add, check=lambda: engine.check_prompt(prompt))
            except InvalidRequestError as e:
                rpc.invalid(e)
            owned = False  # the blocks now belong to the request (released on the engine thread if it fails)
            obj = kv = None  # drop the pulled object now, not when the stream ends
        finally:
            if owned:
                self.loop.call(lambda: engine.release_blocks(blocks))
        context.add_callback(lambda: self.loop.abort(rid))
        while True:
            out = rpc.check(q.get(), "decode")
            if out is None:
                return
            if out.finished:
                rpc.finished = True
                self._observe(out, span)
            yield response_from_output(out)
            if out.finished:
                return

    def _observe(self, out: RequestOutput, span) -> None:
        """Metrics and the queue / generate spans of a finished request, from the engine's timeline."""
        now = time.time()
        m, w = self.model, self.name
        if out.scheduled_time is not None and out.arrival_time is not None:
            metrics.QUEUE_TIME.labels(m, w).observe(out.scheduled_time - out.arrival_time)
        if out.first_token_time is not None:
            metrics.DECODE_TIME.labels(m, w).observe(now - out.first_token_time)
        tracer = self.tracing.tracer
        child_span(tracer, "baton.decode.queue", span, out.arrival_time, out.scheduled_time)
        spec = {}  # speculative decoding: how much of what was proposed the model kept
        if out.spec_draft_tokens:
            spec = {"baton.spec.draft_tokens": out.spec_draft_tokens,
                    "baton.spec.accepted_tokens": out.spec_accepted_tokens,
                    "baton.spec.acceptance": round(out.spec_accepted_tokens / out.spec_draft_tokens, 4)}
        child_span(tracer, "baton.decode.generate", span, out.scheduled_time or out.arrival_time, now,
                   {"gen_ai.usage.output_tokens": out.completion_tokens,
                    "gen_ai.response.finish_reasons": [out.finish_reason or ""], **spec})
        for key, value in spec.items():
            span.set_attribute(key, value)
        span.set_attribute("gen_ai.usage.output_tokens", out.completion_tokens)


class DecodeWorker(WorkerBase):
    """A Ray actor (wrapped with ray.remote by the launcher): an engine, a gRPC server."""

    kind = "decode"

    def __init__(self, spec: WorkerSpec, pull_timeout_s: float) -> None:
        """pull_timeout_s: the longest wait for a KV pull (less when the caller's deadline is nearer)."""
        super().__init__(spec)
        self.service = DecodeService(spec.name, self.loop, spec.namespace, pull_timeout_s, self.tracing)
        self._serve(lambda server: wgrpc.add_DecodeWorkerServicer_to_server(self.service, server), 256)

    def stats(self) -> dict:
        pool = self.engine.pool
        s = self.service
        return {"free_blocks": pool.num_free_blocks, "num_blocks": pool.num_blocks,
                "requests": self.engine.num_requests, "handoffs": s.handoffs,
                "kv_bytes_received": s.kv_bytes_received, "kv_seconds": s.kv_seconds,
                "active_streams": s.active.value, "grammar_compiles": self.engine.grammars.compiles,
                "grammar_hits": self.engine.grammars.hits}


__all__ = ["DecodeWorker"]
