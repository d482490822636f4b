"""One request's way through the workers: prefill on the cheapest prefill worker (``prefix.py``), the
first token to the client at once, then a decode worker that pulls the KV and streams the rest.

A worker that fails before anything was streamed is retried on another one (a failed decode prefills
again: the held KV was released); after tokens were streamed the request ends with UNAVAILABLE. A
client that leaves cancels the downstream call, which frees the blocks on both sides, and any KV held
for it is released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from baton.api import SamplingParams
from baton.api.adapters import AdapterRef
from baton.api.prefix import adapter_root
from baton.api.proto import sampling_to_proto
from baton.detokenizer import IncrementalDetokenizer
from baton.services.router.adapters import AdapterTable
from baton.services.router.admission import Admission
from baton.services.router.membership import Worker, WorkerSet
from baton.services.router.prefix import PrefixRouter
from baton.services.router.wire import exhausted, remaining
from baton.tokenizer import Tokenizer
from baton.tracing import Tracing, record_error
from baton.v1 import generation_pb2 as pb
from baton.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def release(worker: Worker, rid: str) -> None:
    """Tell a prefill worker to drop a KV export nobody will pull (best effort: its lease covers the rest)."""
    try:
        worker.stub.Release(wpb.ReleaseRequest(request_id=rid), timeout=5)
    except grpc.RpcError as e:
        log.warning("could not release %s on %s: %s", rid, worker.name, e.details())


def after_first(msg: pb.GenerateResponse, first: pb.GenerateResponse) -> pb.GenerateResponse | None:
    """The decode stream's first message without the first token, which the router sent already (None
    when nothing is left). The decode worker emits that token alone, before any step, with the text
    the router computed; anything else passes through unchanged."""
    if not msg.token_ids or msg.token_ids[0] != first.token_ids[0] or not msg.text.startswith(first.text):
        log.warning("request %s: the decode stream did not start with the first token", first.request_id)
        return msg
    out = pb.GenerateResponse()
    out.CopyFrom(msg)
    del out.token_ids[0]
    if first.logprobs and out.logprobs:
        del out.logprobs[0]
    if first.top_logprobs and out.top_logprobs:
        del out.top_logprobs[0]
    out.text = msg.text[len(first.text):]
    if not out.token_ids and not out.text and not out.finish_reason:
        return None
    return out


class Orchestrator:
    def __init__(self, workers: WorkerSet, prefix: PrefixRouter, tokenizer: Tokenizer, admission: Admission,
                 tracing: Tracing, adapters: AdapterTable | None = None) -> None:
        self.workers = workers
        self.adapters = adapters
        self.prefix = prefix
        self.tokenizer = tokenizer
        self.admission = admission
        self.tracing = tracing

    def run(self, rid: str, ids: list[int], params: SamplingParams, context, root,
            priority: int = 0, adapter: AdapterRef | None = None) -> Iterator[pb.GenerateResponse]:
        """The response stream of one admitted request; ends the call with a status on failure. adapter: the
        LoRA adapter both workers run the request under (None: the base model)."""
        tracer = self.tracing.tracer
        route = tracer.start_span("baton.route", context=trace.set_span_in_context(root))
        lookup = tracer.start_span("baton.prefix_lookup", context=trace.set_span_in_context(route))
        hits = self.prefix.lookup(ids, adapter_root(adapter.content_id) if adapter else None)
        lookup.set_attribute("baton.prefix.hit_tokens", max(hits.values(), default=0))
        lookup.set_attribute("baton.prefix.holders", len(hits))
        lookup.end()
        route.end()
        sampling = sampling_to_proto(params)  # resolved: the workers apply no defaults of their own
        wire_adapter = (wpb.Adapter(name=adapter.name, path=adapter.path, content_id=adapter.content_id)
                        if adapter else None)
        tried_decode: set[str] = set()
        decode_full = False  # some decode worker refused for lack of KV blocks: backpressure, not an outage
        last_error = "no prefill worker is available"
        first: pb.GenerateResponse | None = None  # the first token, once the client has it
        while True:
            # A retry after a failed decode prefills again (the held KV was released), on any worker.
            pre = self._prefill(rid, ids, sampling, context, hits, root, priority, adapter, wire_adapter)
            if pre is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: {last_error}")
            worker, resp = pre
            root.set_attribute("baton.prefill.worker", worker.name)
            root.set_attribute("baton.prefix.cached_tokens", resp.cached_prompt_tokens)
            if not context.is_active():  # the client left during prefill: drop the held KV
                release(worker, rid)
                return
            if first is None:
                first = self._first(rid, ids, params, resp)
                if resp.finish_reason:  # the first token ended the request: no decode worker
                    yield first
                    return
                # The first token goes out now, not after the KV hand-off and the decode worker's next
                # step: the decode stream repeats it, and after_first drops it there. A retry keeps
                # this token (its prefill's own first token is not used).
                try:
                    yield first
                except GeneratorExit:  # the client left: nobody will pull the KV
                    release(worker, rid)
                    raise
            candidates = self.workers.candidates("decode", tried_decode)
            if adapter is not None and self.adapters is not None:  # a worker holding the adapter, at equal load
                candidates = self.adapters.prefers(candidates, adapter, lambda w: w.in_flight)
            if not candidates:
                release(worker, rid)
                if decode_full:
                    exhausted(context, f"request {rid}: every decode worker is out of KV blocks; retry later")
                why = f" (last: {last_error})" if tried_decode else ""
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: no decode worker is available{why}")
            dec = candidates[0]
            tried_decode.add(dec.name)
            outcome = yield from self._decode(rid, ids, sampling, context, root, priority, first, worker, resp, dec,
                                              wire_adapter)
            if outcome is None:
                return
            decode_full |= outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            last_error = f"decode worker {dec.name}: {outcome.details()}"

    def _decode(self, rid, ids, sampling, context, root, priority, first, worker, resp, dec, adapter=None):
        """Stream from ``dec``. Returns None when the request is over (done or cancelled), else the
        retryable error it failed with before streaming anything (its KV was released)."""
        tracer = self.tracing.tracer
        self.workers.acquire(dec)
        call_span = tracer.start_span("baton.decode", kind=SpanKind.CLIENT, context=trace.set_span_in_context(root),
                                      attributes={"baton.worker": dec.name, "rpc.system": "grpc"})
        root.set_attribute("baton.decode.worker", dec.name)
        call = dec.stub.Decode(wpb.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, first_token=first.token_ids[0], sampling=sampling,
            prefill_worker=resp.worker, sampler_state=resp.sampler_state,
            cached_prompt_tokens=resp.cached_prompt_tokens, priority=priority, adapter=adapter,
            **({"first_logprob": first.logprobs[0]} if first.logprobs else {}),
            **({"first_top_logprobs": first.top_logprobs[0]} if first.top_logprobs else {})),
            timeout=remaining(context), metadata=self.tracing.metadata(call_span))
        if not context.add_callback(call.cancel):  # the client is already gone
            call.cancel()
        if adapter is not None and self.adapters is not None:
            self.adapters.sent(dec.name, AdapterRef(adapter.name, adapter.path, adapter.content_id))
        streamed = False
        try:
            echoed = False
            for msg in call:
                if not echoed:
                    call_span.add_event("first_token")
                    echoed = True
                    msg = after_first(msg, first)
                    if msg is None:
                        continue
                streamed = True
                yield msg
            return None
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.CANCELLED and not context.is_active():
                record_error(call_span, e, cancelled=True)
                if not streamed:  # the decode worker may not have pulled the KV yet (a no-op if it has)
                    release(worker, rid)
                return None
            record_error(call_span, f"{code.name}: {e.details()}")
            if streamed or code not in RETRYABLE:
                status = code if code != grpc.StatusCode.CANCELLED else grpc.StatusCode.UNAVAILABLE
                context.abort(status, f"request {rid}: decode worker {dec.name} failed: {e.details()}")
            log.warning("retrying %s after decode worker %s: %s", rid, dec.name, e.details())
            release(worker, rid)
            return e
        finally:
            self.workers.release(dec)
            call.cancel()
            call_span.end()

    def _prefill(self, rid, ids, sampling, context, hits: dict[str, int], root, priority: int = 0,
                 adapter: AdapterRef | None = None, wire_adapter=None):
        full = False
        tracer = self.tracing.tracer
        holds = None
        if adapter is not None and self.adapters is not None:
            holds = lambda name: self.adapters.holds(name, adapter)  # noqa: E731
        for w in self.prefix.order(self.workers.candidates("prefill", set()), len(ids), hits, holds):
            work = len(ids) - hits.get(w.name, 0)
            self.workers.acquire(w, work)
            span = tracer.start_span("baton.prefill", kind=SpanKind.CLIENT, context=trace.set_span_in_context(root),
                                     attributes={"baton.worker": w.name, "rpc.system": "grpc",
                                                 "baton.prefix.expected_tokens": hits.get(w.name, 0)})
            t0 = time.monotonic()
            try:
                resp = w.stub.Prefill(wpb.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                                         priority=priority, adapter=wire_adapter),
                                      timeout=remaining(context), metadata=self.tracing.metadata(span))
                if self.adapters is not None:
                    self.adapters.reported(w.name, resp.adapters)
                self.prefix.record_hit(resp.cached_prompt_tokens)
                self.admission.measure_prefill(len(ids) - resp.cached_prompt_tokens, time.monotonic() - t0)
                span.set_attribute("baton.prefix.cached_tokens", resp.cached_prompt_tokens)
                span.set_attribute("baton.kv.bytes", resp.kv_bytes)
                return w, resp
            except grpc.RpcError as e:
                record_error(span, f"{e.code().name}: {e.details()}", cancelled=not context.is_active())
                if e.code() not in RETRYABLE:
                    context.abort(e.code(), e.details())
                full |= e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                log.warning("prefill worker %s failed for %s: %s", w.name, rid, e.details())
            finally:
                self.workers.release(w, work)
                span.end()
        if full:
            exhausted(context, f"request {rid}: every prefill worker is at capacity; retry later")
        return None

    def _first(self, rid: str, ids: list[int], params: SamplingParams, resp) -> pb.GenerateResponse:
        """The prefill's first token as the stream's first message, its text as the decode worker's
        detokenizer will give it (same prompt, same stop strings). When that token ended the request
        (resp.finish_reason), the whole answer: the rest of the text, the finish reason and usage."""
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        text, stopped = detok.add([resp.first_token])
        out = pb.GenerateResponse(request_id=rid, token_ids=[resp.first_token], text=text)
        if resp.HasField("first_logprob"):
            out.logprobs.append(resp.first_logprob)
        if resp.HasField("first_top_logprobs"):
            out.top_logprobs.append(resp.first_top_logprobs)
        if resp.finish_reason:
            if not stopped:
                out.text += detok.flush()
            out.finish_reason = resp.finish_reason
            out.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), cached_prompt_tokens=resp.cached_prompt_tokens,
                                        completion_tokens=1))
        return out
