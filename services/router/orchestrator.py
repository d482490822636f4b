"""One request's way through the workers: prefill on the cheapest prefill worker (``prefix.py``), the
first token to the client at once, then a decode worker that pulls the KV and streams the rest.

A request outlives the workers it runs on. A prefill worker that fails is replaced by another (when none
is left, the request waits for a replacement within its deadline). A decode worker that fails, drops the
connection or stops answering health checks mid-stream is a migration: the router prefills the prompt and
the tokens the client already has on a prefill worker (its prefix cache holds most of them), a new decode
worker pulls that KV and goes on where the stream stopped. The client sees one stream: the new worker's
echo of the tokens it has is dropped here, nothing is missing or repeated; greedy and seeded requests go on
token for token as they would have (the sampler's draws derive from the seed and the position alone), and
the new worker's detokenizer, fed every earlier token, sees a stop string that straddles the break.
At most ``Limits.max_migrations`` moves per request; one more failure ends it with UNAVAILABLE. A client
that leaves cancels the downstream call, which frees the blocks on both sides, and any KV held for it is
released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from baton import metrics
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
# A decode stream that ends with one of these while the client is still there moves to another worker.
MIGRATABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED)
# The prefill of a migrated request only computes KV: greedy, no stop, a token nobody uses.
CONTINUE = sampling_to_proto(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
WAIT_POLL_S = 0.2
# A failed worker is tried again after this long if the health checks still find it serving: its connection
# dropped but it lives (a dead one stops answering and is dropped within about three seconds).
RETRY_FAILED_AFTER_S = 4.0


def release(worker: Worker, rid: str) -> None:
    """Tell a prefill worker to drop a KV export nobody will pull (best effort: its lease covers the rest)."""
    try:
        worker.stub.Release(wpb.ReleaseRequest(request_id=rid), timeout=5)
    except grpc.RpcError as e:
        log.warning("could not release %s on %s: %s", rid, worker.name, e.details())


class _Dropped(Exception):
    """A call in flight to a worker that membership dropped (it stopped answering), cancelled by the router: read
    like the UNAVAILABLE of a worker that died."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"worker {worker} stopped answering its health checks")

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


@dataclass
class Sent:
    """What the client has of the answer so far: every token and all the text."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""

    def add(self, msg: pb.GenerateResponse) -> None:
        self.tokens.extend(msg.token_ids)
        self.text += msg.text


def after_sent(msg: pb.GenerateResponse, sent: Sent, rid: str) -> pb.GenerateResponse | None:
    """A decode stream's first message without what the client has already (None when nothing is left).
    The decode worker emits the tokens it was given (the first token; a migrated request's every token so
    far) together, before any step, with the text its detokenizer makes of them, which is the text the
    client has; log-probs come only with the first token's echo."""
    n = len(sent.tokens)
    if list(msg.token_ids[:n]) != sent.tokens:
        log.warning("request %s: the decode stream did not start with the tokens sent", rid)
        return msg
    out = pb.GenerateResponse()
    out.CopyFrom(msg)
    if len(msg.logprobs) == len(msg.token_ids):
        del out.logprobs[:n]
    if len(msg.top_logprobs) == len(msg.token_ids):
        del out.top_logprobs[:n]
    del out.token_ids[:n]
    if msg.text.startswith(sent.text):
        out.text = msg.text[len(sent.text):]
    else:  # never expected: the detokenizer's output depends on the tokens alone
        log.warning("request %s: the decode stream's text did not start with the text sent", rid)
        keep = 0
        while keep < min(len(msg.text), len(sent.text)) and msg.text[keep] == sent.text[keep]:
            keep += 1
        out.text = msg.text[keep:]
    if not out.token_ids and not out.text and not out.finish_reason:
        return None
    return out


@dataclass
class Moves:
    """One request's migrations: counted, bounded, measured and traced."""

    limit: int
    model: str
    count: int = 0
    pending: tuple | None = None  # (span, monotonic start) of a migration not yet resumed

    def move(self, cause: str, context, rid: str, why: str, tracer, root, worker: str, tokens: int) -> None:
        """One more move, or UNAVAILABLE when the request has had its share."""
        metrics.MIGRATIONS.labels(self.model, "router", cause).inc()
        self.count += 1
        if self.count > self.limit:
            self.resumed(failed=True)
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"request {rid}: {why} (moved {self.limit} times already, the limit)")
        if self.pending is None:
            span = tracer.start_span("baton.migration", context=trace.set_span_in_context(root),
                                     attributes={"baton.migration.cause": cause, "baton.migration.from": worker,
                                                 "baton.migration.tokens_sent": tokens,
                                                 "baton.migration.count": self.count})
            self.pending = (span, time.monotonic())
        root.set_attribute("baton.migrations", self.count)

    def attempt_id(self, rid: str) -> str:
        """The id the workers know this attempt by: the request's own until it moves, then one per move, so
        that a worker that held an earlier attempt (its cancel still on the way) never sees the id twice."""
        return rid if self.count == 0 else f"{rid}-m{self.count}"

    def resumed(self, failed: bool = False) -> None:
        """The request goes on (or ends): the pending migration's span ends and its time is measured."""
        if self.pending is None:
            return
        span, t0 = self.pending
        self.pending = None
        if failed:
            record_error(span, "the request could not move")
        else:
            metrics.MIGRATION_TIME.labels(self.model, "router").observe(time.monotonic() - t0)
        span.end()


class Orchestrator:
    def __init__(self, workers: WorkerSet, prefix: PrefixRouter, tokenizer: Tokenizer, admission: Admission,
                 tracing: Tracing, adapters: AdapterTable | None = None, model: str = "") -> None:
        self.workers = workers
        self.adapters = adapters
        self.prefix = prefix
        self.tokenizer = tokenizer
        self.admission = admission
        self.tracing = tracing
        self.model = model

    def run(self, rid: str, ids: list[int], params: SamplingParams, context, root,
            priority: int = 0, adapter: AdapterRef | None = None) -> Iterator[pb.GenerateResponse]:
        """The response stream of one admitted request; ends the call with a status on failure. adapter: the
        LoRA adapter both workers run the request under (None: the base model)."""
        tracer = self.tracing.tracer
        route = tracer.start_span("baton.route", context=trace.set_span_in_context(root))
        lookup = tracer.start_span("baton.prefix_lookup", context=trace.set_span_in_context(route))
        root_hash = adapter_root(adapter.content_id) if adapter else None
        hits = self.prefix.lookup(ids, root_hash)
        lookup.set_attribute("baton.prefix.hit_tokens", max(hits.values(), default=0))
        lookup.set_attribute("baton.prefix.holders", len(hits))
        lookup.end()
        route.end()
        sampling = sampling_to_proto(params)  # resolved: the workers apply no defaults of their own
        wire_adapter = (wpb.Adapter(name=adapter.name, path=adapter.path, content_id=adapter.content_id)
                        if adapter else None)
        limits = self.admission.limits
        moves = Moves(limits.max_migrations, self.model)
        tried_decode: set[str] = set()
        decode_full = False  # some decode worker refused for lack of KV blocks: backpressure, not an outage
        sent = Sent()  # what the client has; empty until the first token went out
        first: pb.GenerateResponse | None = None
        seed = b""  # the request's seed, from its first prefill: every later worker draws on from it
        cached = 0  # prompt tokens its first prefill found cached (the usage the client sees)
        try:
            while True:
                if not sent.tokens:
                    pre = self._prefill(rid, ids, sampling, context, hits, root, priority, adapter, wire_adapter,
                                        moves)
                else:  # the decode side failed: the prompt and what was sent but the last token, KV only
                    known = ids + sent.tokens[:-1]
                    pre = self._prefill(rid, known, CONTINUE, context, self.prefix.lookup(known, root_hash), root,
                                        priority, adapter, wire_adapter, moves)
                if pre is None:
                    return  # the client left, or the call was ended with a status
                worker, resp, wid = pre
                root.set_attribute("baton.prefill.worker", worker.name)
                if not context.is_active():  # the client left during prefill: drop the held KV
                    release(worker, wid)
                    return
                if not sent.tokens:
                    root.set_attribute("baton.prefix.cached_tokens", resp.cached_prompt_tokens)
                    seed, cached = resp.sampler_state, resp.cached_prompt_tokens
                    first = self._first(rid, ids, params, resp)
                    sent.add(first)
                    moves.resumed()  # a failed prefill before it moved to this one
                    # The first token goes out now, not after the KV hand-off and the decode worker's next
                    # step: the decode stream repeats it, and after_sent drops it there.
                    try:
                        yield first
                    except GeneratorExit:  # the client left: nobody will pull the KV
                        release(worker, wid)
                        raise
                    if resp.finish_reason:  # the first token ended the request: no decode worker
                        return
                try:
                    dec = self._decode_worker(rid, context, tried_decode, decode_full, adapter)
                except BaseException:  # ended with a status: nobody will pull the KV
                    release(worker, wid)
                    raise
                if dec is None:
                    release(worker, wid)
                    return
                tried_decode.add(dec.name)
                outcome = yield from self._decode(rid, wid, ids, sampling, context, root, priority, sent, first, seed,
                                                  cached, worker, resp.worker, dec, wire_adapter, moves)
                if outcome is None:
                    return
                code, cause, why = outcome
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    decode_full = True
                    continue
                moves.move(cause, context, rid, why, tracer, root, dec.name, len(sent.tokens))
                log.warning("moving %s (%d tokens sent) off %s: %s", rid, len(sent.tokens), dec.name, why)
        finally:
            moves.resumed(failed=True)

    def _wait_for(self, kind: str, exclude: set[str], context) -> list[Worker]:
        """Candidates of ``kind`` not in ``exclude`` (a replacement for failed ones), waited for within the
        request's deadline, or ``replacement_wait_s`` without one. After ``RETRY_FAILED_AFTER_S`` a failed worker
        the health checks still find serving counts again (its connection dropped, it did not die). Empty when
        none came or the client left; at once when this router never had a worker of ``kind`` (nothing will come
        back)."""
        if kind not in self.workers.seen:
            return []
        left = remaining(context)
        limit = self.admission.limits.replacement_wait_s
        began = time.monotonic()
        until = began + (limit if left is None else min(left, limit))
        while context.is_active():
            found = self.workers.candidates(kind, exclude)
            if not found and time.monotonic() - began >= RETRY_FAILED_AFTER_S:
                found = self.workers.candidates(kind, set())
            if found or time.monotonic() >= until:
                return found
            time.sleep(WAIT_POLL_S)
        return []

    def _decode_worker(self, rid: str, context, tried: set[str], full: bool, adapter) -> Worker | None:
        """The decode worker to (re)try: the least loaded one not tried yet, one that holds the adapter among
        equals. None of them left: RESOURCE_EXHAUSTED when some refused for lack of KV blocks, else wait for a
        replacement (UNAVAILABLE when none comes); None when the client left meanwhile."""
        candidates = self.workers.candidates("decode", tried)
        if not candidates and full:
            exhausted(context, f"request {rid}: every decode worker is out of KV blocks; retry later")
        if not candidates:
            candidates = self._wait_for("decode", tried, context)
            if not candidates:
                if not context.is_active():
                    return None
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: no decode worker is available")
        if adapter is not None and self.adapters is not None:  # a worker holding the adapter, at equal load
            candidates = self.adapters.prefers(candidates, adapter, lambda w: w.in_flight)
        return candidates[0]

    def _decode(self, rid, wid, ids, sampling, context, root, priority, sent: Sent, first: pb.GenerateResponse,
                seed: bytes, cached: int, worker: Worker, actor: str, dec: Worker, adapter, moves: Moves):
        """Stream from ``dec`` what the client does not have yet. Returns None when the request is over (done
        or cancelled), else (status, migration cause, why) of a failure that another worker may take over: the
        KV held for this attempt is released; the tokens this attempt streamed are in ``sent``. ``worker``:
        the prefill worker holding the KV (``actor``: its Ray actor, for the pull); ``first``: the first
        token's message (its log-probs go to the worker that echoes it)."""
        tracer = self.tracing.tracer
        self.workers.acquire(dec)
        call_span = tracer.start_span("baton.decode", kind=SpanKind.CLIENT, context=trace.set_span_in_context(root),
                                      attributes={"baton.worker": dec.name, "rpc.system": "grpc"})
        root.set_attribute("baton.decode.worker", dec.name)
        resumed = len(sent.tokens) > 1
        logprobs = {} if resumed else {
            **({"first_logprob": first.logprobs[0]} if first.logprobs else {}),
            **({"first_top_logprobs": first.top_logprobs[0]} if first.top_logprobs else {})}
        call = dec.stub.Decode(wpb.DecodeRequest(
            request_id=wid, prompt_token_ids=ids, first_token=sent.tokens[0], sampling=sampling,
            prefill_worker=actor, sampler_state=seed, cached_prompt_tokens=cached, priority=priority,
            adapter=adapter, generated_token_ids=sent.tokens if resumed else (), **logprobs),
            timeout=remaining(context), metadata=self.tracing.metadata(call_span))
        if not context.add_callback(call.cancel):  # the client is already gone
            call.cancel()
        self.workers.watch(dec, call.cancel)
        if adapter is not None and self.adapters is not None:
            self.adapters.sent(dec.name, AdapterRef(adapter.name, adapter.path, adapter.content_id))
        pulled = False  # the decode worker has answered, so it has pulled the KV
        messages = iter(call)
        try:
            while True:
                self.workers.waiting(dec, call.cancel)  # from here, silence is the worker's
                msg = next(messages, None)
                if msg is None:
                    return None
                self.workers.waiting(dec, call.cancel, False)
                if not pulled:
                    call_span.add_event("first_token")
                    pulled = True
                    msg = after_sent(msg, sent, rid)
                    if msg is None:
                        continue
                moves.resumed()
                sent.add(msg)
                yield msg
                if msg.finish_reason:  # done: whatever the stream does next changes nothing
                    return None
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.CANCELLED and not context.is_active():
                record_error(call_span, e, cancelled=True)
                if not pulled:  # the decode worker may not have pulled the KV yet (a no-op if it has)
                    release(worker, wid)
                return None
            record_error(call_span, f"{code.name}: {e.details()}")
            if code not in MIGRATABLE and code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                context.abort(code, f"request {rid}: decode worker {dec.name} failed: {e.details()}")
            if not pulled:
                release(worker, wid)
            if dec.dropped or call.cancel in self.workers.stalled:
                cause = "decode_unresponsive"
            elif code == grpc.StatusCode.UNAVAILABLE:
                cause = "decode_unavailable"
            else:
                cause = "decode_error"
            return code, cause, f"decode worker {dec.name} failed: {code.name}: {e.details()}"
        finally:
            self.workers.unwatch(dec, call.cancel)
            self.workers.release(dec)
            call.cancel()
            call_span.end()

    def _prefill(self, rid, ids, sampling, context, hits: dict[str, int], root, priority: int = 0,
                 adapter: AdapterRef | None = None, wire_adapter=None, moves: Moves | None = None):
        """Prefill on the cheapest worker that answers; one that fails is a move to the next (waiting for a
        replacement when none is left). Returns (worker, response, the attempt's id on the workers), or None when
        the client left."""
        tracer = self.tracing.tracer
        holds = None
        if adapter is not None and self.adapters is not None:
            holds = lambda name: self.adapters.holds(name, adapter)  # noqa: E731
        failed: set[str] = set()
        while True:
            full = False
            for w in self.prefix.order(self.workers.candidates("prefill", failed), len(ids), hits, holds):
                work = len(ids) - hits.get(w.name, 0)
                self.workers.acquire(w, work)
                span = tracer.start_span("baton.prefill", kind=SpanKind.CLIENT,
                                         context=trace.set_span_in_context(root),
                                         attributes={"baton.worker": w.name, "rpc.system": "grpc",
                                                     "baton.prefix.expected_tokens": hits.get(w.name, 0)})
                t0 = time.monotonic()
                wid = moves.attempt_id(rid) if moves is not None else rid
                call = w.stub.Prefill.future(wpb.PrefillRequest(request_id=wid, prompt_token_ids=ids,
                                                                sampling=sampling, priority=priority,
                                                                adapter=wire_adapter),
                                             timeout=remaining(context), metadata=self.tracing.metadata(span))
                # A client that leaves cancels the prefill; so does the worker's drop (it stopped answering its
                # health checks). A prefill may take long: its silence alone is no sign.
                context.add_callback(call.cancel)
                self.workers.watch(w, call.cancel)
                self.workers.waiting(w, call.cancel, False)
                try:
                    try:
                        resp = call.result()
                    except grpc.FutureCancelledError:
                        if not context.is_active():
                            record_error(span, "the client cancelled", cancelled=True)
                            return None
                        raise _Dropped(w.name) from None
                    if self.adapters is not None:
                        self.adapters.reported(w.name, resp.adapters)
                    self.prefix.record_hit(resp.cached_prompt_tokens)
                    self.admission.measure_prefill(len(ids) - resp.cached_prompt_tokens, time.monotonic() - t0)
                    span.set_attribute("baton.prefix.cached_tokens", resp.cached_prompt_tokens)
                    span.set_attribute("baton.kv.bytes", resp.kv_bytes)
                    return w, resp, wid
                except (grpc.RpcError, _Dropped) as e:
                    code, details = e.code(), e.details()
                    record_error(span, f"{code.name}: {details}", cancelled=not context.is_active())
                    if not context.is_active():
                        return None
                    if code not in RETRYABLE:
                        context.abort(code, details)
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        full = True
                    else:
                        failed.add(w.name)
                        if moves is not None:
                            moves.move("prefill_unavailable", context, rid, f"prefill worker {w.name} failed: "
                                       f"{details}", tracer, root, w.name, 0)
                    log.warning("prefill worker %s failed for %s: %s", w.name, rid, details)
                finally:
                    self.workers.unwatch(w, call.cancel)
                    self.workers.release(w, work)
                    span.end()
            if full:
                exhausted(context, f"request {rid}: every prefill worker is at capacity; retry later")
            back = self._wait_for("prefill", failed, context)
            if not back:
                if not context.is_active():
                    return None
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: no prefill worker is available")
            failed -= {w.name for w in back}  # tried again: the health checks find it serving

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
