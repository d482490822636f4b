"""Router: the public baton.v1.Generation service, put together from its parts:

- ``wire.py``: registration, reading a request (prompt ids, resolved params), statuses;
- ``admission.py``: whether one more request is taken (RESOURCE_EXHAUSTED at once when not);
- ``orchestrator.py``: prefill -> decode, retries, the first-token relay;
- ``membership.py``: the workers, discovery and health;
- ``prefix.py``: which prefill worker (the longest cached prefix unless it is overloaded).

This module keeps the RPC methods, the request's root span and metrics, and the gRPC server.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import SpanKind

from baton import metrics, security
from baton.api import InvalidRequestError
from baton.api.adapters import LoraError
from baton.config import Limits
from baton.security import TLSConfig
from baton.services.info import WorkerInfo
from baton.services.router.adapters import AdapterNotFound, AdapterRefused, AdapterTable, Listed
from baton.services.router.admission import Admission, Overloaded
from baton.services.router.membership import Check, Membership, WorkerSet, grpc_check, grpc_connect
from baton.services.router.orchestrator import Orchestrator
from baton.services.router.prefix import PrefixRouter
from baton.services.router.wire import (
    SERVICE_NAME,
    Malformed,
    ModelInfo,
    RequestReader,
    add_generation_service,
    client_id,
    exhausted,
    refuse_malformed,
)
from baton.tokenizer import Tokenizer
from baton.tracing import Tracing, extract, record_error, record_rpc_error
from baton.v1 import generation_pb2 as pb
from baton.v1 import generation_pb2_grpc as pbgrpc


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

    def finish(self, model: str, adapter: str = "") -> None:
        if not self.finish_reason:
            return
        if adapter:
            metrics.LORA_REQUESTS.labels(model, "router", adapter).inc()
            metrics.LORA_TOKENS.labels(model, "router", adapter).inc(self.tokens)
        metrics.E2E.labels(model, "router").observe(time.monotonic() - self.start)
        metrics.REQUEST_SUCCESS.labels(model, "router", self.finish_reason).inc()
        metrics.GENERATION_TOKENS.labels(model, "router").inc(self.tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", [self.finish_reason])
        self.span.set_attribute("gen_ai.usage.output_tokens", self.tokens)
        if self.usage is not None:
            metrics.PROMPT_TOKENS.labels(model, "router").inc(self.usage.prompt_tokens)


class RouterService(pbgrpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, workers: WorkerSet, limits: Limits,
                 prefix: PrefixRouter | None = None, tracing: Tracing | None = None,
                 gateway_key: str | None = None, adapters: AdapterTable | None = None) -> None:
        self.gateway_key = gateway_key  # shown by gateways that name the HTTP client they speak for
        # LoRA adapters by name (none without a table: the model's shapes are unknown)
        self.adapters = adapters or AdapterTable(None, model.name, 0)
        self.tracing = tracing or Tracing(None, "router")
        self.limits = limits
        self.model = model
        self.workers = workers
        self.tokenizer = tokenizer
        self.reader = RequestReader(tokenizer, model, limits)
        self.reader.grammars.warm()
        self.admission = Admission(limits, lambda: workers.count("decode"), workers.prefill_queues)
        self.prefix = prefix or PrefixRouter(None, 16, model.name)  # without an index: least loaded first
        self.orchestrator = Orchestrator(workers, self.prefix, tokenizer, self.admission, self.tracing,
                                         self.adapters, model.name)
        metrics.start_series(model.name, "router", "router")
        metrics.RUNNING.labels(model.name, "router").set_function(lambda: self.admission.in_flight)

    def _read(self, context, read: Callable):
        try:
            return read()
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.detail())

    def _add_token_bytes(self, msg: pb.GenerateResponse) -> None:
        """Each token's bytes beside its log-prob, so a client can show the tokens without a tokenizer."""
        msg.token_bytes.extend(self.tokenizer.token_bytes(t) for t in msg.token_ids)
        for top in msg.top_logprobs:
            top.token_bytes.extend(self.tokenizer.token_bytes(t) for t in top.token_ids)

    def Tokenize(self, request, context):
        refuse_malformed(request, context)
        return pb.TokenizeResponse(token_ids=self._read(context, lambda: self.reader.prompt_ids(request)))

    def Detokenize(self, request, context):
        refuse_malformed(request, context)
        text, pieces = self._read(context, lambda: self.reader.detokenize(request))
        return pb.DetokenizeResponse(text=text, token_bytes=pieces)

    def ListModels(self, request, context):
        refuse_malformed(request, context)
        base = pb.ModelInfo(id=self.model.name, max_model_len=self.model.max_model_len,
                            vocab_size=self.model.vocab_size, chat_tools=self.tokenizer.chat_tools)
        return pb.ListModelsResponse(models=[base, *map(self._adapter_info, self.adapters.listed())])

    def _adapter_info(self, listed: Listed) -> pb.ModelInfo:
        return pb.ModelInfo(id=listed.ref.name, max_model_len=self.model.max_model_len,
                            vocab_size=self.model.vocab_size, chat_tools=self.tokenizer.chat_tools,
                            base=self.model.name, lora_rank=listed.rank)

    def LoadAdapter(self, request, context):
        refuse_malformed(request, context)
        if len(request.path) > 4096:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path: at most 4096 characters")
        try:
            listed = self.adapters.add(request.name, request.path)
        except AdapterRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except LoraError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        metrics.LORA_ADAPTERS.labels(self.model.name, "router").set(len(self.adapters.listed()))
        return self._adapter_info(listed)

    def UnloadAdapter(self, request, context):
        refuse_malformed(request, context)
        if not self.adapters.remove(request.name):
            context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.name[:64]!r} is not loaded")
        metrics.LORA_ADAPTERS.labels(self.model.name, "router").set(len(self.adapters.listed()))
        return pb.UnloadAdapterResponse(unloaded=True)

    def _compile(self, params, root, context) -> None:
        """Structured output: the constraint compiled once here (cached by content), so that a bad one is
        INVALID_ARGUMENT before any worker sees it; its time on the metrics and the trace."""
        root.set_attribute("baton.constraint.kind", params.constraint.kind)
        try:
            self.reader.grammars.compile_observed(params.constraint, self.model.name, "router", self.tracing.tracer,
                                                  root)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.detail("sampling."))

    def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:
        refuse_malformed(request, context)
        op = "chat" if request.WhichOneof("input") == "messages" else "text_completion"
        sp = request.sampling
        root = self.tracing.tracer.start_span(
            f"{op} {self.model.name}", kind=SpanKind.SERVER,
            context=extract(context.invocation_metadata()) if self.tracing.enabled else None,
            attributes={"gen_ai.operation.name": op, "gen_ai.request.model": self.model.name,
                        "rpc.system": "grpc", "rpc.method": "Generate"})
        for name in ("max_tokens", "temperature", "top_p"):
            if sp.HasField(name):
                root.set_attribute(f"gen_ai.request.{name}", getattr(sp, name))
        run = _Run(time.monotonic(), root)
        try:
            label = self._read(context, lambda: self.reader.label(request))
            ids = self._read(context, lambda: self.reader.prompt_ids(request))
            params = self._read(context, lambda: self.reader.sampling(request))
            try:
                adapter = self.adapters.resolve(request.adapter)
            except AdapterNotFound as e:
                context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            if adapter is not None:
                root.set_attribute("baton.lora.adapter", adapter.name)
            if params.constraint is not None:
                self._compile(params, root, context)
            # Workers, exports, leases, metrics and spans know the request by this id alone: two requests
            # with one client id never meet, and nobody can guess another's.
            rid = f"r-{uuid.uuid4().hex}"
            root.set_attribute("baton.request.id", rid)
            if label:
                root.set_attribute("baton.request.label", label)
            root.set_attribute("gen_ai.usage.input_tokens", len(ids))
            client = client_id(context, self.gateway_key)
            try:
                self.admission.admit(client)
            except Overloaded as e:
                exhausted(context, str(e))
            try:
                first = True
                for msg in self.orchestrator.run(rid, ids, params, context, root, request.priority, adapter):
                    run.observe(msg, self.model.name)
                    if params.logprobs:
                        self._add_token_bytes(msg)
                    # The id goes back once, on the first message: the client's label, else ours.
                    msg.request_id = (label or rid) if first else ""
                    first = False
                    yield msg
            finally:
                self.admission.leave(client)
        except Exception as e:  # an abort (a status for the client) or a bug: both end the span as errors
            if context.is_active():
                record_rpc_error(root, context, e)
            raise
        finally:
            if not run.finish_reason and not context.is_active():
                record_error(root, "the client cancelled", cancelled=True)
            run.finish(self.model.name, request.adapter if not isinstance(request, Malformed) else "")
            root.end()


class Router:
    """The router's gRPC server: Generation, health and reflection, and the thread that keeps the
    worker set current."""

    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, host: str = "127.0.0.1", port: int = 50051,
                 discover: Callable[[], list[WorkerInfo]] | None = None, drop_after_failed_checks: int = 3,
                 prefix: PrefixRouter | None = None, tracing: Tracing | None = None,
                 forget: Callable[[str], object] | None = None, limits: Limits | None = None,
                 tls: TLSConfig | None = None, tokens: security.Tokens | None = None, check: Check = grpc_check,
                 gateway_key: str | None = None, adapters: AdapterTable | None = None) -> None:
        """discover: the registered workers (polled every second); forget(name): unregister a worker that
        stopped answering. See membership.Membership."""
        limits = limits or Limits()
        self.workers = WorkerSet(grpc_connect(tls))
        self.membership = Membership(self.workers, discover, forget, check, drop_after_failed_checks)
        self.service = RouterService(tokenizer, model, self.workers, limits, prefix=prefix, tracing=tracing,
                                     gateway_key=gateway_key, adapters=adapters)
        # Threads bound the streams served at once; beyond max_in_flight requests are refused at once.
        threads = limits.max_in_flight + 16
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="router"),
                                  maximum_concurrent_rpcs=threads,
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
        ok = self.membership.serving()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(SERVICE_NAME, status)

    def refresh(self) -> None:
        """One round of discovery and health checks; streams silent for ``--stall-seconds`` are cancelled (and
        move to another worker)."""
        self.membership.refresh()
        self.update_health()
        self.workers.cancel_silent(self.service.limits.stall_s)

    def _check_workers(self, period: float = 1.0) -> None:
        while not self._stop.wait(period):
            self.refresh()


__all__ = ["Router", "RouterService"]
