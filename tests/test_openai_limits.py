"""The router's limits and failures as HTTP clients see them through the gateway (the official `openai`
client and raw HTTP): the real stack's workers, the default model."""

from __future__ import annotations

import time

import openai
import pytest

from baton.config import Limits
from baton.services.gateway.server import Gateway
from baton.services.router.router import Router
from baton.v1 import generation_pb2_grpc as pbgrpc
from tests.stack_state import router_over


def test_overload_is_a_rate_limit_error_with_retry_after(stack):
    """A router that admits one request at a time: the second is a 429 with OpenAI's error body and
    Retry-After, and once the first stream is closed a request is served again."""
    small = router_over(stack, limits=Limits(max_in_flight=1))
    try:
        gateway = Gateway(small.address, "127.0.0.1", 0, 4 << 20).start()
        try:
            oai = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)
            model = oai.models.list().data[0].id
            # 3,000 tokens take this stack minutes: only closing the stream frees its slot in time.
            long_stream = oai.completions.create(model=model, prompt="Write a long poem.", max_tokens=3000,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
            try:
                assert next(iter(long_stream)).choices[0].text is not None
                for stream in (False, True):
                    with pytest.raises(openai.RateLimitError) as e:
                        oai.completions.create(model=model, prompt="hi", max_tokens=2, stream=stream)
                    assert e.value.status_code == 429
                    assert float(e.value.response.headers["retry-after"]) > 0
                    err = e.value.response.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"}, err
                    assert err["type"] == "rate_limit_error" and err["message"]
                    assert e.value.type == "rate_limit_error"
            finally:
                long_stream.close()
            deadline = time.monotonic() + 20
            while True:
                try:
                    r = oai.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
                    break
                except openai.RateLimitError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            assert r.usage.completion_tokens == 2
        finally:
            gateway.stop()
    finally:
        small.stop()


def _stream_from(address: str, source: str, body: dict):
    """A streamed completion from the local address ``source``; returns the open response after its first event."""
    import http.client
    import json

    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120, source_address=(source, 0))
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status == 200:
        assert r.readline().startswith(b"data: {")
    return conn, r


def test_per_client_limits_count_http_clients_apart(stack):
    """Behind one gateway, each HTTP client has its own --max-streams-per-client: one client holding its
    stream does not shut out another; a gRPC caller cannot pose as a new client without the gateway key."""
    import grpc

    from baton.api.client import Client, generate_request
    from baton.security import FORWARDED_FOR, GATEWAY_KEY

    key = "k" * 24
    small = router_over(stack, limits=Limits(max_streams_per_client=1), gateway_key=key)
    gateway = Gateway(small.address, "127.0.0.1", 0, 4 << 20, gateway_key=key).start()
    long = {"prompt": "Write a long poem.", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    held = []
    try:
        held.append(_stream_from(gateway.address, "127.0.0.1", long))
        assert held[-1][1].status == 200
        held.append(_stream_from(gateway.address, "127.0.0.2", long))
        assert held[-1][1].status == 200  # another client: served
        conn, r = _stream_from(gateway.address, "127.0.0.1", long)
        assert r.status == 429 and "--max-streams-per-client" in r.read().decode()  # the first: at its limit
        conn.close()
        with Client(small.address) as c:
            first = c.stream(generate_request(prompt="Write a long poem.",
                                              sampling={"max_tokens": 3000, "ignore_eos": True}))
            next(first)
            forged = [(FORWARDED_FOR, "someone-else"), (GATEWAY_KEY, "not-the-key-0123456789")]
            with pytest.raises(grpc.RpcError) as e:
                c.complete(generate_request(prompt="hi", sampling={"max_tokens": 2}), metadata=forged)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
    finally:
        for conn, _ in held:
            conn.close()
        gateway.stop()
        small.stop()


class _FailingRouter(pbgrpc.GenerationServicer):
    """A Generation service on loopback that serves one model and fails every stream after its first
    message, as a router does when a decode worker dies mid-stream."""

    def ListModels(self, request, context):
        from baton.v1 import generation_pb2 as pb

        return pb.ListModelsResponse(models=[pb.ModelInfo(id="m", max_model_len=64, vocab_size=10)])

    def Generate(self, request, context):
        import grpc

        from baton.v1 import generation_pb2 as pb

        yield pb.GenerateResponse(request_id="r", token_ids=[1], text="Hello")
        context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")


def test_no_worker_is_503_and_a_failure_mid_stream_is_an_sse_error_event(default_model, stack):
    """Without workers: /health and completions answer 503 in OpenAI's shape. After streaming began, a
    failure is an SSE error event and the stream ends."""
    import http.client
    import json
    from concurrent import futures

    import grpc

    empty = Router(default_model.tokenizer, stack.router.service.model, port=0)  # no worker joins it
    empty.start()
    gateway = Gateway(empty.address, "127.0.0.1", 0, 4 << 20).start()
    try:
        oai = openai.OpenAI(base_url=gateway.url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as e:
            oai.completions.create(model=stack.router.service.model.name, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.json()["error"]["type"] == "service_unavailable"
        conn = http.client.HTTPConnection(*gateway.address.rsplit(":", 1), timeout=60)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
        conn.close()
    finally:
        gateway.stop()
        empty.stop()

    server = grpc.server(futures.ThreadPoolExecutor(4))
    pbgrpc.add_GenerationServicer_to_server(_FailingRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    gateway = Gateway(f"127.0.0.1:{port}", "127.0.0.1", 0, 4 << 20).start()
    try:
        conn = http.client.HTTPConnection(*gateway.address.rsplit(":", 1), timeout=60)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200  # the first token had gone out: the status was sent with it
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
        conn.close()
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[1]["choices"][0]["delta"]["content"] == "Hello"
        assert chunks[2]["error"]["code"] == 503 and "decode worker died" in chunks[2]["error"]["message"]
        assert len(chunks) == 3 and events[-1] == "[DONE]"
    finally:
        gateway.stop()
        server.stop(0)
