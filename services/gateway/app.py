"""OpenAI-compatible HTTP front end: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, vLLM's ``/tokenize`` and ``/detokenize`` and its LoRA admin endpoints (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``; a request's ``model`` may name an adapter), over the router's gRPC API. An OpenAI body
becomes ``GenerateRequest``s (``translate.py``); the router's streams come back as OpenAI's JSON or its
SSE chunks. It speaks to
the router with grpc.aio, so a stream holds no thread; the router keeps admission, limits, auth
(the bearer token is passed on) and tracing (``traceparent`` is passed on)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton import metrics
from baton.security import FORWARDED_FOR, GATEWAY_KEY, TLSConfig
from baton.services.gateway import translate as tr
from baton.services.gateway.translate import BadRequest
from baton.v1 import generation_pb2 as pb
from baton.v1 import generation_pb2_grpc as pbgrpc

log = logging.getLogger(__name__)
# gRPC status -> HTTP status and OpenAI error type.
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_PASSED_HEADERS = ("authorization", "traceparent", "tracestate")
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/tokenize", "/detokenize",
              "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
RETRY_AFTER_S = "1"


def error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None
          ) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _rpc_error(e: grpc.aio.AioRpcError, opts: tr.Options | None = None) -> JSONResponse:
    """A router status as OpenAI's error; an INVALID_ARGUMENT names the field in the client's terms (the
    request's ``opts`` say which HTTP field a refused constraint came from)."""
    status, kind = _STATUS.get(e.code(), (500, "server_error"))
    details = e.details() or e.code().name
    headers = {"Retry-After": RETRY_AFTER_S} if status == 429 else None
    param = None
    if status == 400:
        details, param = tr.client_error(details, opts)
    return error(status, details, kind, param, headers)


def _model_entry(m: pb.ModelInfo) -> dict:
    """One model of /v1/models; a LoRA adapter names its base model as its parent (as vLLM does)."""
    entry = {"id": m.id, "object": "model", "created": 0, "owned_by": "baton", "max_model_len": m.max_model_len}
    if m.base:
        entry.update(parent=m.base, root=m.base)
    return entry


def create_app(router_address: str, max_body_bytes: int = 4 << 20, tls: TLSConfig | None = None,
               gateway_key: str | None = None) -> FastAPI:
    """The gateway over the router at ``router_address`` (host:port; over TLS when ``tls`` is given, trusting
    its CA, else its certificate, as the router's workers do). With the router's ``gateway_key`` each call
    names the HTTP client's address, so the router's per-client limits count HTTP clients apart."""
    metrics.start_http_series((*_ENDPOINTS, "other"))
    app = FastAPI(title="Baton OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    state: dict = {}

    def stub() -> pbgrpc.GenerationStub:
        if "stub" not in state:  # made on the server's event loop, where grpc.aio needs it
            if tls is None:
                state["channel"] = grpc.aio.insecure_channel(router_address)
            else:
                options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else None
                state["channel"] = grpc.aio.secure_channel(router_address, tls.channel_credentials(), options)
            state["stub"] = pbgrpc.GenerationStub(state["channel"])
        return state["stub"]

    def metadata(request: Request) -> list[tuple[str, str]]:
        md = [(h, request.headers[h]) for h in _PASSED_HEADERS if h in request.headers]
        if gateway_key and request.client is not None:
            md += [(GATEWAY_KEY, gateway_key), (FORWARDED_FOR, request.client.host)]
        return md

    async def models(request: Request) -> list[pb.ModelInfo]:
        # Asked each time with the caller's token (a cached answer would skip the router's auth).
        return list((await stub().ListModels(pb.ListModelsRequest(), timeout=10, metadata=metadata(request))).models)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise BadRequest(f"the body is {len(raw)} bytes, above this server's limit of {max_body_bytes}", None,
                             status=413)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}", None) from e
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object", None)
        return body

    @app.middleware("http")
    async def count(request: Request, call_next):
        """baton_http_requests by endpoint and status; the duration to the response's end."""
        t0 = time.monotonic()
        endpoint = request.url.path if request.url.path in _ENDPOINTS else "other"
        response = await call_next(request)
        metrics.HTTP_REQUESTS.labels(endpoint, str(response.status_code)).inc()
        if isinstance(response, StreamingResponse) or hasattr(response, "body_iterator"):
            inner = response.body_iterator

            async def timed():
                try:
                    async for part in inner:
                        yield part
                finally:
                    metrics.HTTP_DURATION.labels(endpoint).observe(time.monotonic() - t0)

            response.body_iterator = timed()
        else:
            metrics.HTTP_DURATION.labels(endpoint).observe(time.monotonic() - t0)
        return response

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, e: BadRequest) -> JSONResponse:
        return error(e.status, str(e), "invalid_request_error" if e.status == 400 else
                     "not_found_error" if e.status == 404 else "request_too_large", e.param)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def rpc_failed(request: Request, e: grpc.aio.AioRpcError) -> JSONResponse:
        return _rpc_error(e)

    @app.get("/health")
    async def health() -> Response:
        """200 once the router is SERVING (a prefill and a decode worker are up), else 503."""
        stub()
        try:
            r = await health_pb2_grpc.HealthStub(state["channel"]).Check(
                health_pb2.HealthCheckRequest(service="baton.v1.Generation"), timeout=5)
        except grpc.aio.AioRpcError:
            return Response(status_code=503)
        return Response(status_code=200 if r.status == health_pb2.HealthCheckResponse.SERVING else 503)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_entry(m) for m in await models(request)]})

    def lora_field(body: dict, name: str) -> str:
        value = body.get(name)
        if not isinstance(value, str) or not value or len(value) > 4096:
            raise BadRequest(f"{name} must be a non-empty string of at most 4096 characters", name)
        return value

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        """vLLM's shape: {"lora_name", "lora_path"} -> the adapter as /v1/models lists it."""
        body = await body_of(request)
        req = pb.LoadAdapterRequest(name=lora_field(body, "lora_name"), path=lora_field(body, "lora_path"))
        return JSONResponse(_model_entry(await stub().LoadAdapter(req, timeout=60, metadata=metadata(request))))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        """vLLM's shape: {"lora_name"}."""
        body = await body_of(request)
        req = pb.UnloadAdapterRequest(name=lora_field(body, "lora_name"))
        await stub().UnloadAdapter(req, timeout=30, metadata=metadata(request))
        return JSONResponse({"id": req.name, "object": "model", "deleted": True})

    async def generate(request: Request, chat: bool) -> Response:
        body = await body_of(request)
        infos = await models(request)
        served = [m.id for m in infos]
        reqs, opts = tr.to_generate(body, chat, served, tool_models={m.id for m in infos if m.chat_tools})
        if opts.model is not None and any(m.id == opts.model and m.base for m in infos):  # a LoRA adapter
            for r in reqs:
                r.adapter = opts.model
        md = metadata(request)
        calls = [stub().Generate(r, metadata=md) for r in tr.choice_requests(reqs, opts.n)]
        iters = [c.__aiter__() for c in calls]

        async def first_of(it) -> pb.GenerateResponse | None:
            try:
                return await it.__anext__()
            except StopAsyncIteration:
                return None

        try:  # errors before the first token are an HTTP status
            firsts = await asyncio.gather(*(first_of(it) for it in iters))
        except grpc.aio.AioRpcError as e:
            for c in calls:
                c.cancel()
            return _rpc_error(e, opts)
        except BaseException:
            for c in calls:
                c.cancel()
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = opts.model or served[0]
        if not opts.stream:
            async def collect(first, it) -> tr.Collected:
                out = tr.Collected()
                if first is not None:
                    out.add(first)
                    async for msg in it:
                        out.add(msg)
                return out

            try:
                outs = await asyncio.gather(*(collect(f, it) for f, it in zip(firsts, iters)))
            except grpc.aio.AioRpcError as e:
                return _rpc_error(e, opts)
            finally:
                for c in calls:
                    c.cancel()
            return JSONResponse(tr.whole_response(outs, rid, created, model, chat, opts))

        async def events() -> AsyncIterator[str]:
            chunk = tr.Chunker(rid, created, model, chat, opts)
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, first, it) -> None:
                try:
                    if first is not None:
                        await queue.put((i, first))
                        async for msg in it:
                            await queue.put((i, msg))
                except grpc.aio.AioRpcError as e:
                    await queue.put((i, e))
                await queue.put((i, None))

            tasks = [asyncio.create_task(pump(i, f, it)) for i, (f, it) in enumerate(zip(firsts, iters))]
            try:
                if chat:
                    for i in range(len(calls)):
                        yield tr.sse(chunk.role(i))
                open_choices = len(calls)
                while open_choices:
                    i, item = await queue.get()
                    if item is None:
                        open_choices -= 1
                    elif isinstance(item, grpc.aio.AioRpcError):  # after streaming began: an SSE error event
                        status, kind = _STATUS.get(item.code(), (500, "server_error"))
                        message, param = item.details() or item.code().name, None
                        if status == 400:
                            message, param = tr.client_error(message, opts)
                        yield tr.sse({"error": {"message": message, "type": kind, "param": param,
                                                "code": status}})
                        break
                    else:
                        for c in chunk.add(i, item):
                            yield tr.sse(c)
                else:
                    if opts.include_usage:
                        yield tr.sse(chunk.usage(len(calls)))
            finally:
                for c in calls:  # a client that left cancels its requests
                    c.cancel()
                for t in tasks:
                    t.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's shape: {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens"}."""
        body = await body_of(request)
        served = await models(request)
        req = tr.to_tokenize(body, [m.id for m in served])
        ids = list((await stub().Tokenize(req, timeout=30, metadata=metadata(request))).token_ids)
        return JSONResponse({"count": len(ids), "max_model_len": served[0].max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's shape: {"tokens"} -> {"prompt"}."""
        body = await body_of(request)
        req = tr.to_detokenize(body, [m.id for m in await models(request)])
        return JSONResponse({"prompt": (await stub().Detokenize(req, timeout=30, metadata=metadata(request))).text})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    return app
