"""Router: the public baton.v1.Generation service.

Validates and tokenizes, picks a prefill worker (the one holding the longest cached prefix unless
it is overloaded: ``prefix.py``) and then the least-loaded decode worker, drives the hand-off and
relays the token stream. Overload is RESOURCE_EXHAUSTED at once
(a bound on requests in flight), never a queue that grows without limit. A worker that fails before
anything was streamed is retried on another one; after that the request ends with UNAVAILABLE.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from baton import metrics, security
from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.sampling import InvalidRequestError, SamplingParams
from baton.security import TLSConfig
from baton.services.router.prefix import PrefixRouter
from baton.services.worker import sampling_from_proto
from baton.tokenizer import Tokenizer, TokenizerError
from baton.tracing import Tracing, extract, record_error, record_rpc_error
from baton.v1 import generation_pb2 as pb
from baton.v1 import generation_pb2_grpc as pbgrpc
from baton.v1 import worker_pb2 as wpb
from baton.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)
SERVICE_NAME = "baton.v1.Generation"
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass
class Worker:
    name: str
    kind: str  # "prefill" | "decode"
    address: str
    channel: grpc.Channel = field(repr=False)
    stub: object = field(repr=False)
    in_flight: int = 0
    pending_tokens: int = 0  # uncached prompt tokens of the prefills in flight (an estimate of its queue)
    healthy: bool = True
    failed_checks: int = 0  # health checks in a row that got no answer at all (a draining worker answers)
    removed: bool = False


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int


class WorkerSet:
    """The workers the router knows, with the requests it has in flight on each."""

    def __init__(self, tls: TLSConfig | None = None) -> None:
        self._lock = threading.Lock()
        self.workers: dict[str, Worker] = {}
        self.tls = tls  # workers' servers use TLS; the router verifies them and shows its certificate

    def add(self, name: str, kind: str, address: str) -> None:
        channel = security.channel(address, self.tls, options=[("grpc.max_receive_message_length", 64 << 20)])
        stub = wgrpc.PrefillWorkerStub(channel) if kind == "prefill" else wgrpc.DecodeWorkerStub(channel)
        with self._lock:
            self.workers[name] = Worker(name, kind, address, channel, stub)

    def remove(self, name: str) -> None:
        """Forget a worker. Its channel closes once the requests in flight on it end (a worker that
        drains before it leaves finishes them)."""
        with self._lock:
            w = self.workers.pop(name, None)
            if w is None:
                return
            w.removed = True
            close = w.in_flight == 0
        if close:
            w.channel.close()

    def candidates(self, kind: str, exclude: set[str]) -> list[Worker]:
        """Healthy workers of a kind, least loaded first."""
        with self._lock:
            ws = [w for w in self.workers.values() if w.kind == kind and w.healthy and w.name not in exclude]
        return sorted(ws, key=lambda w: w.in_flight)

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(1 for w in self.workers.values() if w.kind == kind and w.healthy)

    def acquire(self, w: Worker, tokens: int = 0) -> None:
        with self._lock:
            w.in_flight += 1
            w.pending_tokens += tokens

    def release(self, w: Worker, tokens: int = 0) -> None:
        with self._lock:
            w.in_flight -= 1
            w.pending_tokens -= tokens
            close = w.removed and w.in_flight == 0
        if close:
            w.channel.close()


def _release(worker: Worker, rid: str) -> None:
    """Tell a prefill worker to drop a KV export nobody will pull (best effort: its lease covers the rest)."""
    try:
        worker.stub.Release(wpb.ReleaseRequest(request_id=rid), timeout=5)
    except grpc.RpcError as e:
        log.warning("could not release %s on %s: %s", rid, worker.name, e.details())


RETRY_PUSHBACK_MS = 500


def _exhausted(context, message: str) -> None:
    """RESOURCE_EXHAUSTED with gRPC's retry hint (``grpc-retry-pushback-ms``): try again after a pause."""
    context.set_trailing_metadata((("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


@dataclass(frozen=True)
class Limits:
    """What one request or one client may ask of the router (flags of ``baton serve``)."""

    max_prompt_tokens: int | None = None  # default: the model's context minus one
    max_output_tokens: int = 4096
    max_streams_per_client: int = 64  # a client is its bearer token when there is one, else its address
    max_message_bytes: int = 4 << 20
    # Admission for an SLO: at most this many requests per healthy decode worker (a decode batch this
    # size keeps TPOT in bounds), and none while the prefill queue is deeper than max_queue_s (an
    # estimate of the wait: queued uncached tokens over the prefill rate measured so far). None: off.
    max_streams_per_decode_worker: int | None = None
    max_queue_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_output_tokens", "max_streams_per_client", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_streams_per_decode_worker is not None and self.max_streams_per_decode_worker < 1:
            raise ValueError("max_streams_per_decode_worker must be >= 1")
        if self.max_queue_s is not None and self.max_queue_s <= 0:
            raise ValueError("max_queue_s must be > 0")


def client_id(context) -> str:
    """Who is asking: its bearer token's name, else the peer's address without its port
    (``ipv4:127.0.0.1:5555`` -> ``ipv4:127.0.0.1``)."""
    token = security.bearer(context.invocation_metadata())
    if token:
        return security.token_client_id(token)
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class Malformed:
    """What a request that does not parse becomes (instead of gRPC's generic INTERNAL error)."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"the request is not a valid {kind}: {error or type(error).__name__}"


def _lenient(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            return Malformed(cls.DESCRIPTOR.full_name, e)
    return parse


def _refuse_malformed(request, context) -> None:
    if isinstance(request, Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def add_generation_service(service: pbgrpc.GenerationServicer, server: grpc.Server) -> None:
    """Like the generated ``add_GenerationServicer_to_server``, but a request that does not parse (bad
    wire format, invalid UTF-8 in a string) reaches the servicer as ``Malformed`` and is refused with
    INVALID_ARGUMENT and the parser's message."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize, request_deserializer=_lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels, request_deserializer=_lenient(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _after_first(msg: pb.GenerateResponse, first: pb.GenerateResponse) -> pb.GenerateResponse | None:
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
    out.text = msg.text[len(first.text):]
    if not out.token_ids and not out.text and not out.finish_reason:
        return None
    return out


def _naming_field(e: InvalidRequestError, prefix: str = "") -> str:
    """'field: message', so that the client sees which field to fix."""
    msg = str(e)
    return f"{prefix}{msg}" if msg.startswith(e.field) else f"{prefix}{e.field}: {msg}"


class _Run:
    """One Generate call's timing, for the metrics and the root span."""

    def __init__(self, start: float, span) -> None:
        self.start = start
        self.span = span
        self.last: float | None = None
        self.tokens = 0
        self.usage = None
        self.finish_reason = ""

    def observe(self, msg: pb.GenerateResponse, model: str) -> None:
        now = time.monotonic()
        n = len(msg.token_ids)
        if n:
            if self.last is None:
                metrics.TTFT.labels(model, "router").observe(now - self.start)
                self.span.add_event("first_token")
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    metrics.ITL.labels(model, "router").observe(gap)
            self.last = now
            self.tokens += n
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.usage = msg.usage

    def finish(self, model: str) -> None:
        if not self.finish_reason:
            return
        metrics.E2E.labels(model, "router").observe(time.monotonic() - self.start)
        metrics.REQUEST_SUCCESS.labels(model, "router", self.finish_reason).inc()
        metrics.GENERATION_TOKENS.labels(model, "router").inc(self.tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", [self.finish_reason])
        self.span.set_attribute("gen_ai.usage.output_tokens", self.tokens)
        if self.usage is not None:
            metrics.PROMPT_TOKENS.labels(model, "router").inc(self.usage.prompt_tokens)


class RouterService(pbgrpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, workers: WorkerSet, max_in_flight: int = 256,
                 max_tokens_default: int = 16, prefix: PrefixRouter | None = None,
                 tracing: Tracing | None = None, limits: Limits = Limits()) -> None:
        self.tracing = tracing or Tracing(None, "router")
        self.limits = limits
        self._per_client: dict[str, int] = {}
        self._prefill_rate: float | None = None  # uncached prompt tokens per second, one prefill at a time
        self.tokenizer = tokenizer
        self.model = model
        self.workers = workers
        self.prefix = prefix or PrefixRouter(None, 16, model.name)  # without an index: least loaded first
        self.max_in_flight = max_in_flight
        self.max_tokens_default = max_tokens_default
        self._in_flight = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()
        metrics.RUNNING.labels(model.name, "router").set_function(lambda: self._in_flight)

    # -- helpers ------------------------------------------------------------------------------------------

    def _prompt_ids(self, request, context) -> list[int]:
        which = request.WhichOneof("input")
        limit = self._max_prompt_tokens
        # A token is rarely more than a few dozen characters: refuse absurd texts before tokenizing them.
        if which == "prompt" and len(request.prompt) > 64 * limit:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {len(request.prompt)} characters is far "
                          f"above this server's limit of {limit} prompt tokens")
        try:
            if which == "prompt":
                if not request.prompt:
                    raise InvalidRequestError("prompt", "prompt is empty")
                ids = self.tokenizer.encode(request.prompt)
            elif which == "messages":
                msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
                if not msgs:
                    raise InvalidRequestError("messages", "messages is empty")
                ids = self.tokenizer.encode_chat(msgs)
            elif which == "prompt_token_ids":
                ids = list(request.prompt_token_ids.ids)
                if not ids:
                    raise InvalidRequestError("prompt_token_ids", "prompt_token_ids is empty")
                bad = next((t for t in ids if not 0 <= t < self.model.vocab_size), None)
                if bad is not None:
                    raise InvalidRequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary "
                                              f"[0, {self.model.vocab_size})")
            else:
                raise InvalidRequestError("input", "set exactly one of prompt, messages or prompt_token_ids")
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _naming_field(e))
        except (TokenizerError, ValueError) as e:
            field_name = "messages" if which == "messages" else "prompt"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field_name}: {e}")
        if len(ids) >= self.model.max_model_len:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt has {len(ids)} tokens but the context holds {self.model.max_model_len} "
                          "(prompt plus at least one new token); shorten the prompt")
        if len(ids) > limit:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt has {len(ids)} tokens; this server accepts at most {limit} (--max-prompt-tokens)")
        return ids

    @property
    def _max_prompt_tokens(self) -> int:
        return self.limits.max_prompt_tokens or self.model.max_model_len - 1

    def _sampling(self, request, context) -> SamplingParams:
        try:
            params = sampling_from_proto(request.sampling, self.max_tokens_default)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _naming_field(e, "sampling."))
        if params.max_tokens > self.limits.max_output_tokens:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"sampling.max_tokens: {params.max_tokens} is above this server's limit of "
                          f"{self.limits.max_output_tokens} (--max-output-tokens)")
        return params

    def _admit(self, context, client: str) -> None:
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                _exhausted(context, f"router at its limit of {self.max_in_flight} requests in flight; retry later")
            per_decode = self.limits.max_streams_per_decode_worker
            if per_decode is not None:
                decoders = self.workers.count("decode")
                if self._in_flight >= per_decode * decoders:
                    _exhausted(context, f"all {decoders} decode workers hold their limit of {per_decode} requests "
                               "(--max-streams-per-decode-worker); retry later")
            wait = self._prefill_wait()
            if self.limits.max_queue_s is not None and wait is not None and wait > self.limits.max_queue_s:
                _exhausted(context, f"the prefill queue is about {wait:.1f} s deep, more than "
                           f"{self.limits.max_queue_s:g} s (--max-queue-seconds); retry later")
            streams = self._per_client.get(client, 0)
            if streams >= self.limits.max_streams_per_client:
                _exhausted(context, f"this client has {streams} streams open, the most one client may "
                           f"(--max-streams-per-client); retry when one ends")
            self._in_flight += 1
            self._per_client[client] = streams + 1

    def _prefill_wait(self) -> float | None:
        """Seconds before a new prompt's prefill could start on the least-loaded prefill worker."""
        if self._prefill_rate is None:
            return None
        queued = [w.pending_tokens for w in self.workers.candidates("prefill", set())]
        return min(queued) / self._prefill_rate if queued else None

    def _measure_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:  # tiny prompts say little about the rate
            rate = tokens / seconds
            self._prefill_rate = rate if self._prefill_rate is None else 0.8 * self._prefill_rate + 0.2 * rate

    def _leave(self, client: str) -> None:
        with self._lock:
            self._in_flight -= 1
            left = self._per_client.get(client, 1) - 1
            if left:
                self._per_client[client] = left
            else:
                self._per_client.pop(client, None)

    @staticmethod
    def _remaining(context) -> float | None:
        """The client's remaining deadline for downstream calls; None when it set none (gRPC then
        reports an enormous value, which must not be passed on as a timeout)."""
        r = context.time_remaining()
        return None if r is None or r > 1e7 else max(r, 0.001)

    # -- RPCs ---------------------------------------------------------------------------------------------

    def Tokenize(self, request, context):
        _refuse_malformed(request, context)
        return pb.TokenizeResponse(token_ids=self._prompt_ids(request, context))

    def ListModels(self, request, context):
        _refuse_malformed(request, context)
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=self.model.name, max_model_len=self.model.max_model_len,
                                                          vocab_size=self.model.vocab_size)])

    def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:
        _refuse_malformed(request, context)
        tracer = self.tracing.tracer
        op = "chat" if request.WhichOneof("input") == "messages" else "text_completion"
        sp = request.sampling
        root = tracer.start_span(f"{op} {self.model.name}", kind=SpanKind.SERVER,
                                 context=extract(context.invocation_metadata()) if self.tracing.enabled else None,
                                 attributes={"gen_ai.operation.name": op, "gen_ai.request.model": self.model.name,
                                             "rpc.system": "grpc", "rpc.method": "Generate"})
        if sp.HasField("max_tokens"):
            root.set_attribute("gen_ai.request.max_tokens", sp.max_tokens)
        if sp.HasField("temperature"):
            root.set_attribute("gen_ai.request.temperature", sp.temperature)
        if sp.HasField("top_p"):
            root.set_attribute("gen_ai.request.top_p", sp.top_p)
        run = _Run(time.monotonic(), root)
        try:
            ids = self._prompt_ids(request, context)
            params = self._sampling(request, context)
            rid = request.request_id or f"r-{uuid.uuid4().hex[:16]}"
            root.set_attribute("baton.request.id", rid)
            root.set_attribute("gen_ai.usage.input_tokens", len(ids))
            client = client_id(context)
            self._admit(context, client)
            try:
                for msg in self._generate(rid, ids, params, request.sampling, context, run, request.priority):
                    run.observe(msg, self.model.name)
                    yield msg
            finally:
                self._leave(client)
        except Exception as e:  # an abort (a status for the client) or a bug: both end the span as errors
            if context.is_active():
                record_rpc_error(root, context, e)
            raise
        finally:
            if not run.finish_reason and not context.is_active():
                record_error(root, "the client cancelled", cancelled=True)
            run.finish(self.model.name)
            root.end()

    def _generate(self, rid: str, ids: list[int], params: SamplingParams, sampling_pb, context, run: _Run,
                  priority: int = 0):
        tracer, root = self.tracing.tracer, run.span
        route = tracer.start_span("baton.route", context=trace.set_span_in_context(root))
        lookup = tracer.start_span("baton.prefix_lookup", context=trace.set_span_in_context(route))
        hits = self.prefix.lookup(ids)
        lookup.set_attribute("baton.prefix.hit_tokens", max(hits.values(), default=0))
        lookup.set_attribute("baton.prefix.holders", len(hits))
        lookup.end()
        route.end()
        tried_decode: set[str] = set()
        decode_full = False  # some decode worker refused for lack of KV blocks: backpressure, not an outage
        last_error = "no prefill worker is available"
        first: pb.GenerateResponse | None = None  # the first token, once the client has it
        while True:
            # A retry after a failed decode prefills again (the held KV was released), on any worker.
            pre = self._prefill(rid, ids, sampling_pb, context, hits, root, priority)
            if pre is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: {last_error}")
            worker, resp = pre
            root.set_attribute("baton.prefill.worker", worker.name)
            root.set_attribute("baton.prefix.cached_tokens", resp.cached_prompt_tokens)
            if not context.is_active():  # the client left during prefill: drop the held KV
                _release(worker, rid)
                return
            if first is None:
                first = self._first(rid, ids, params, resp)
                if resp.finish_reason:  # the first token ended the request: no decode worker
                    yield first
                    return
                # The first token goes out now, not after the KV hand-off and the decode worker's next
                # step: the decode stream repeats it, and _after_first drops it there. A retry keeps
                # this token (its prefill's own first token is not used).
                try:
                    yield first
                except GeneratorExit:  # the client left: nobody will pull the KV
                    _release(worker, rid)
                    raise
            streamed = False
            candidates = self.workers.candidates("decode", tried_decode)
            if not candidates:
                _release(worker, rid)
                if decode_full:
                    _exhausted(context,
                                  f"request {rid}: every decode worker is out of KV blocks; retry later")
                why = f" (last: {last_error})" if tried_decode else ""
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: no decode worker is available{why}")
            dec = candidates[0]
            tried_decode.add(dec.name)
            self.workers.acquire(dec)
            call_span = tracer.start_span("baton.decode", kind=SpanKind.CLIENT, context=trace.set_span_in_context(root),
                                          attributes={"baton.worker": dec.name, "rpc.system": "grpc"})
            root.set_attribute("baton.decode.worker", dec.name)
            call = dec.stub.Decode(wpb.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, first_token=first.token_ids[0], sampling=sampling_pb,
                prefill_worker=resp.worker, sampler_state=resp.sampler_state,
                cached_prompt_tokens=resp.cached_prompt_tokens, priority=priority,
                **({"first_logprob": first.logprobs[0]} if first.logprobs else {})),
                timeout=self._remaining(context), metadata=self.tracing.metadata(call_span))
            if not context.add_callback(call.cancel):  # the client is already gone
                call.cancel()
            try:
                echoed = False
                for msg in call:
                    if not echoed:
                        call_span.add_event("first_token")
                        echoed = True
                        msg = _after_first(msg, first)
                        if msg is None:
                            continue
                    streamed = True
                    yield msg
                return
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.CANCELLED and not context.is_active():
                    record_error(call_span, e, cancelled=True)
                    if not streamed:  # the decode worker may not have pulled the KV yet (a no-op if it has)
                        _release(worker, rid)
                    return
                record_error(call_span, f"{code.name}: {e.details()}")
                if streamed or code not in _RETRYABLE:
                    status = code if code != grpc.StatusCode.CANCELLED else grpc.StatusCode.UNAVAILABLE
                    context.abort(status, f"request {rid}: decode worker {dec.name} failed: {e.details()}")
                decode_full |= code == grpc.StatusCode.RESOURCE_EXHAUSTED
                last_error = f"decode worker {dec.name}: {e.details()}"
                log.warning("retrying %s after %s", rid, last_error)
                _release(worker, rid)
            finally:
                self.workers.release(dec)
                call.cancel()
                call_span.end()

    def _prefill(self, rid, ids, sampling_pb, context, hits: dict[str, int], root, priority: int = 0):
        full = False
        tracer = self.tracing.tracer
        for w in self.prefix.order(self.workers.candidates("prefill", set()), len(ids), hits):
            work = len(ids) - hits.get(w.name, 0)
            self.workers.acquire(w, work)
            span = tracer.start_span("baton.prefill", kind=SpanKind.CLIENT, context=trace.set_span_in_context(root),
                                     attributes={"baton.worker": w.name, "rpc.system": "grpc",
                                                 "baton.prefix.expected_tokens": hits.get(w.name, 0)})
            t0 = time.monotonic()
            try:
                resp = w.stub.Prefill(wpb.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling_pb,
                                                         priority=priority),
                                      timeout=self._remaining(context), metadata=self.tracing.metadata(span))
                self.prefix.record_hit(resp.cached_prompt_tokens)
                self._measure_prefill(len(ids) - resp.cached_prompt_tokens, time.monotonic() - t0)
                span.set_attribute("baton.prefix.cached_tokens", resp.cached_prompt_tokens)
                span.set_attribute("baton.kv.bytes", resp.kv_bytes)
                return w, resp
            except grpc.RpcError as e:
                record_error(span, f"{e.code().name}: {e.details()}", cancelled=not context.is_active())
                if e.code() not in _RETRYABLE:
                    context.abort(e.code(), e.details())
                full |= e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                log.warning("prefill worker %s failed for %s: %s", w.name, rid, e.details())
            finally:
                self.workers.release(w, work)
                span.end()
        if full:
            _exhausted(context,
                          f"request {rid}: every prefill worker is at capacity; retry later")
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
        if resp.finish_reason:
            if not stopped:
                out.text += detok.flush()
            out.finish_reason = resp.finish_reason
            out.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), cached_prompt_tokens=resp.cached_prompt_tokens,
                                        completion_tokens=1))
        return out


class Router:
    """The router's gRPC server: Generation, health and reflection."""

    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, host: str = "127.0.0.1", port: int = 50051,
                 max_in_flight: int = 256, discover=None, drop_after_failed_checks: int = 3,
                 prefix: PrefixRouter | None = None, tracing: Tracing | None = None, forget=None,
                 limits: Limits = Limits(), tls: TLSConfig | None = None, tokens: security.Tokens | None = None
                 ) -> None:
        """discover: a callable returning the registered workers' infos (name, kind, address); the
        router polls it every second, adding new workers and forgetting unregistered ones. A worker
        whose health checks go unanswered ``drop_after_failed_checks`` times in a row is dropped, and
        ``forget(name)`` (if given) removes it from discovery too: a crashed worker cannot unregister."""
        self.forget = forget
        self.workers = WorkerSet(tls)
        self.discover = discover
        self.drop_after_failed_checks = drop_after_failed_checks
        self.service = RouterService(tokenizer, model, self.workers, max_in_flight=max_in_flight, prefix=prefix,
                                     tracing=tracing, limits=limits)
        # Threads bound the streams served at once; beyond max_in_flight requests are refused at once.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_in_flight + 16,
                                                             thread_name_prefix="router"),
                                  maximum_concurrent_rpcs=max_in_flight + 16,
                                  options=[("grpc.max_receive_message_length", limits.max_message_bytes)],
                                  interceptors=[security.AuthInterceptor(tokens)] if tokens else None)
        add_generation_service(self.service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Generation"].full_name, reflection.SERVICE_NAME,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), self.server)
        self.port = security.add_port(self.server, f"{host}:{port}", tls)  # clients: TLS, tokens for auth
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()
        self._checker = threading.Thread(target=self._check_workers, daemon=True, name="router-health")
        self.update_health()

    def start(self) -> None:
        self.server.start()
        self._checker.start()

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()

    def update_health(self) -> None:
        ok = self.workers.count("prefill") > 0 and self.workers.count("decode") > 0
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(SERVICE_NAME, status)

    def refresh(self) -> None:
        """One round of discovery and health checks."""
        if self.discover is not None:
            try:
                infos = {i["name"]: i for i in self.discover()}
            except Exception as e:  # noqa: BLE001 - keep the last known set
                log.warning("worker discovery failed: %s", e)
            else:
                for name, info in infos.items():
                    known = self.workers.workers.get(name)
                    if known is None or known.address != info["address"]:
                        self.workers.remove(name)
                        self.workers.add(name, info["kind"], info["address"])
                        log.info("worker %s (%s) at %s joined", name, info["kind"], info["address"])
                for name in set(self.workers.workers) - set(infos):
                    self.workers.remove(name)
                    log.info("worker %s left", name)
        for w in list(self.workers.workers.values()):
            try:
                r = health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                w.healthy = r.status == health_pb2.HealthCheckResponse.SERVING  # NOT_SERVING: draining
                w.failed_checks = 0
            except grpc.RpcError:
                w.healthy = False
                w.failed_checks += 1
            if w.failed_checks >= self.drop_after_failed_checks:
                log.warning("worker %s does not answer; dropping it", w.name)
                self.workers.remove(w.name)
                if self.forget is not None:
                    try:
                        self.forget(w.name)
                    except Exception as e:  # noqa: BLE001 - discovery may be briefly unreachable
                        log.warning("could not unregister %s: %s", w.name, e)
        self.update_health()

    def _check_workers(self, period: float = 1.0) -> None:
        while not self._stop.wait(period):
            self.refresh()


__all__ = ["Limits", "ModelInfo", "Router", "RouterService", "WorkerSet", "client_id"]
