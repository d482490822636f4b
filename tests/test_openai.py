"""The OpenAI-compatible HTTP API, driven by the official `openai` client and by raw HTTP, over the
session's stack (its gateway listens on a free port)."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from baton.api.client import Client, generate_request
from tests.stack_state import idle

QUESTION = "What is the capital of France?"


def _raw(stack, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, port = stack.gateway.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_models_and_health(stack, oai, model):
    assert model == stack.router.service.model.name
    status, _, _ = _raw(stack, "GET", "/health")
    assert status == 200


def test_chat_is_token_identical_to_grpc(stack, oai, model):
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
                                    temperature=0)
    with Client(stack.address) as c:
        want = c.complete(generate_request(messages=[{"role": "user", "content": QUESTION}],
                                           sampling={"max_tokens": 24, "temperature": 0}))
    assert r.choices[0].message.content == want.text and "Paris" in want.text
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == want.usage.prompt_tokens


def test_chat_stream_with_usage(oai, model):
    msgs = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]  # content parts
    whole = oai.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    chunks = list(oai.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_with_stop_and_seed(oai, model):
    greedy = oai.completions.create(model=model, prompt="One, two, three, four,", max_tokens=12, temperature=0)
    assert greedy.object == "text_completion" and greedy.choices[0].text
    word = greedy.choices[0].text.split(",")[0]
    stopped = oai.completions.create(model=model, prompt="One, two, three, four,", max_tokens=12, temperature=0,
                                     stop=[","])
    assert stopped.choices[0].text == word and stopped.choices[0].finish_reason == "stop"
    a, b = (oai.completions.create(model=model, prompt="Tell me a word:", max_tokens=8, temperature=1.0, seed=5)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_n_choices_streamed_and_not(oai, model):
    msgs = [{"role": "user", "content": "Name a color."}]
    one = oai.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    two = oai.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content == one.choices[0].message.content for c in two.choices)  # greedy: the same
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    sampled = oai.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=1.0, seed=3, n=3)
    again = oai.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in again.choices]
    chunks = list(oai.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, n=2,
                                              stream=True, stream_options={"include_usage": True}))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == one.choices[0].message.content
        assert sum(1 for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].finish_reason) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == two.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs, n=17)
    assert e.value.body["param"] == "n"


def test_chat_logprobs_match_grpc_streamed_and_not(stack, oai, model):
    msgs = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                    top_logprobs=3)
    with Client(stack.address) as c:
        want = c.complete(generate_request(messages=msgs, sampling={"max_tokens": 10, "temperature": 0,
                                                                    "logprobs": True, "top_logprobs": 3}))
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == len(want.top_logprobs) == r.usage.completion_tokens
    assert [t.logprob for t in content] == pytest.approx(want.logprobs, abs=1e-5)
    assert [t.bytes for t in content] == [list(b) for b in want.token_bytes]
    # The tokens spell the answer, then (finish_reason stop) the end-of-turn token, which it does not show.
    assert b"".join(bytes(t.bytes) for t in content).decode().startswith(r.choices[0].message.content)
    for t, top in zip(content, want.top_logprobs):
        assert len(t.top_logprobs) == 3 and [a.logprob for a in t.top_logprobs] == pytest.approx(top.logprobs, abs=1e-5)
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    chunks = list(oai.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = oai.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    assert plain.choices[0].logprobs.content[0].top_logprobs == []
    assert oai.chat.completions.create(model=model, messages=msgs, max_tokens=4).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


def test_completion_logprobs_and_several_prompts(oai, model):
    r = oai.completions.create(model=model, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                         lp.token_logprobs))
    prompts = ["One, two, three,", "The capital of France is"]
    both = oai.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    alone = [oai.completions.create(model=model, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = oai.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=["x"] * 5, n=16)
    assert e.value.body["param"] == "prompt"


def test_tokenize_and_detokenize(stack, model):
    status, _, raw = _raw(stack, "POST", "/tokenize", json.dumps({"model": model, "prompt": "Hello world"}).encode())
    assert status == 200
    body = json.loads(raw)
    with Client(stack.address) as c:
        assert body["tokens"] == c.tokenize("Hello world") and body["count"] == len(body["tokens"])
        chat = c.tokenize(messages=[{"role": "user", "content": "Hi"}])
    assert body["max_model_len"] == stack.router.service.model.max_model_len
    status, _, raw = _raw(stack, "POST", "/tokenize", json.dumps({"messages": [{"role": "user", "content": "Hi"}]}
                                                                 ).encode())
    assert status == 200 and json.loads(raw)["tokens"] == chat
    status, _, raw = _raw(stack, "POST", "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
    assert status == 200 and json.loads(raw)["prompt"] == "Hello world"
    for path, payload, param in (("/detokenize", {"tokens": [10**9]}, "token_ids"),
                                 ("/detokenize", {"tokens": "12"}, "tokens"), ("/tokenize", {"prompt": 3}, "prompt")):
        status, _, raw = _raw(stack, "POST", path, json.dumps(payload).encode())
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_cached_tokens_are_reported(oai, model):
    system = "You are a careful assistant. " * 20
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    oai.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    again = oai.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_errors_arrive_as_the_clients_exceptions(oai, model):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=msgs)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs,
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert e.value.body["param"] == "tools"  # refused by name, never dropped
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="hi", max_tokens=10**6)
    assert e.value.body["param"] == "max_tokens"


def test_sse_framing_and_error_bodies(stack, model):
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True})
    status, headers, raw = _raw(stack, "POST", "/v1/completions", body.encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[0].removeprefix("data: "))["object"] == "text_completion"
    for payload, param in ((b"{not json", None), (b"[1, 2]", None), (json.dumps({"prompt": 5}).encode(), "prompt"),
                           (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), "temperature"),
                           (json.dumps({"prompt": "x", "stream_options": {}}).encode(), "stream_options")):
        status, _, raw = _raw(stack, "POST", "/v1/completions", payload)
        err = json.loads(raw)["error"]
        assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param, err
        assert err["message"]


def test_client_disconnect_mid_stream_frees_everything(stack, model):
    import socket

    host, port = stack.gateway.address.rsplit(":", 1)
    # 3,000 tokens take this stack minutes; the cancelled request must be gone in seconds.
    body = json.dumps({"model": model, "prompt": "Write a very long story.", "max_tokens": 3000, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while seen.count(b"data: {") < 3:  # a few tokens streamed: the request is decoding
        seen += s.recv(65536)
    s.close()
    assert idle(stack, timeout=10), "a worker still holds the cancelled request's blocks or KV"


def _check_error_body(status: int, raw: bytes) -> None:
    assert 400 <= status < 500, (status, raw[:200])
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


def test_oversized_and_non_utf8_bodies(stack):
    status, _, raw = _raw(stack, "POST", "/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert status == 413
    _check_error_body(status, raw)
    status, _, raw = _raw(stack, "POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}')
    _check_error_body(status, raw)
    status, _, raw = _raw(stack, "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    _check_error_body(status, raw)


def test_fuzzed_bodies_get_4xx_with_an_error_body_or_an_answer(stack):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.text(max_size=20))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=8), inner, max_size=3), max_leaves=8)
    fields = st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
                              "top_p", "n", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs",
                              "top_k", "min_p", "repetition_penalty", "ignore_eos", "priority", "user", "tools",
                              "presence_penalty", "frequency_penalty", "other"])

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=st.dictionaries(fields, values, max_size=6), chat=st.booleans())
    def check(body, chat):
        body.setdefault("max_tokens", 2)  # an accepted body answers quickly
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, _, raw = _raw(stack, "POST", path, json.dumps(body).encode())
        if status != 200:
            _check_error_body(status, raw)

    check()


def test_http_metrics_by_endpoint_and_status(stack, oai, model):
    from baton.metrics import HTTP_DURATION, HTTP_REQUESTS, sample

    ok = sample(HTTP_REQUESTS, endpoint="/v1/completions", status="200")
    bad = sample(HTTP_REQUESTS, endpoint="/v1/completions", status="400")
    timed = sample(HTTP_DURATION, "_count", endpoint="/v1/completions")
    oai.completions.create(model=model, prompt="Hi", max_tokens=2)
    list(oai.completions.create(model=model, prompt="Hi", max_tokens=2, stream=True))
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt="Hi", max_tokens=-1)
    assert sample(HTTP_REQUESTS, endpoint="/v1/completions", status="200") == ok + 2
    assert sample(HTTP_REQUESTS, endpoint="/v1/completions", status="400") == bad + 1
    # A stream's duration is observed as its body ends, which may be just after the client has read it.
    import time

    deadline = time.monotonic() + 10
    while sample(HTTP_DURATION, "_count", endpoint="/v1/completions") < timed + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sample(HTTP_DURATION, "_count", endpoint="/v1/completions") == timed + 3


def test_gateway_runs_on_its_own(stack):
    """`baton gateway --router HOST:PORT` in its own process, in front of the stack's router."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "gateway", "--router", stack.address,
                             "--http-port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "OpenAI-compatible API at" in proc.stdout.readline()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=3,
                                      temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
