"""A client's request id is a label, not a key; every string a client sends is bounded (the session's
stack, the default model)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.api.client import Client, Completion, generate_request
from baton.api.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from baton.api.prompts import MAX_MESSAGES, MAX_REQUEST_ID_CHARS
from baton.v1 import generation_pb2 as pb
from tests.oracle import assert_same_or_near_tie, hf_from_loaded
from tests.stack_state import idle, stats

GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address) as c:
        yield c


@pytest.fixture(scope="module")
def hf(default_model):
    return hf_from_loaded(default_model)


@pytest.fixture(scope="module")
def alone(client, hf):
    """check(got, prompt, label): ``got`` has all its tokens and the greedy answer ``prompt`` gets alone,
    without an id (or first differs from it at a near tie of the float32 reference)."""
    answers = {p: client.complete(generate_request(p, sampling=GREEDY)) for p in PROMPTS}

    def check(got: Completion, prompt: str, label: str) -> None:
        assert len(got.token_ids) == GREEDY["max_tokens"] and got.finish_reason == "length", label
        assert_same_or_near_tie(got.token_ids, answers[prompt].token_ids, client.tokenize(prompt), hf, label)

    return check


@pytest.mark.parametrize("n", [2, 16])
def test_one_client_id_on_concurrent_requests(stack, client, alone, n):
    """n requests with the same request_id at once: each gets all its tokens and the answer it gets alone,
    and reads its id back on the first message only."""
    seen: list[list[str]] = []

    def run(prompt: str) -> Completion:
        out = Completion()
        ids = []
        for msg in client.stream(generate_request(prompt, request_id="order-1001", sampling=GREEDY), timeout=300):
            ids.append(msg.request_id)
            out.add(msg)
        seen.append(ids)
        return out

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(run, PROMPTS[:n]))
    for i, (g, p) in enumerate(zip(got, PROMPTS)):
        alone(g, p, f"request {i} of {n}")
    assert all(ids[0] == "order-1001" and not any(ids[1:]) for ids in seen), seen
    assert idle(stack), "a worker still holds blocks or exports"


def _in_prefill(stack) -> bool:
    pre, _ = stats(stack)
    return any(p["active_prefills"] for p in pre)


@pytest.mark.parametrize("moment", ["prefill", "hand-off", "decode"])
def test_a_duplicate_id_arriving_at_each_moment_of_the_first(stack, client, alone, moment):
    """A second request with the first one's id, sent while the first is being prefilled, when its first
    token reaches the client (the router has just started the KV hand-off), and while it decodes: both
    run to the end with their own answers."""
    long_prompt = "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 120
    first_token, fourth_token = threading.Event(), threading.Event()
    result: dict = {}

    def first() -> None:
        out = Completion()
        req = generate_request(long_prompt, request_id="dup", sampling={**GREEDY, "max_tokens": 48})
        for msg in client.stream(req, timeout=300):
            out.add(msg)
            first_token.set()
            if len(out.token_ids) >= 4:
                fourth_token.set()
        result["first"] = out

    t = threading.Thread(target=first)
    t.start()
    try:
        if moment == "prefill":
            deadline = time.monotonic() + 60
            while not _in_prefill(stack) and not first_token.is_set() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not first_token.is_set(), "the long prompt was prefilled before it could be caught"
        elif moment == "hand-off":
            assert first_token.wait(120)
        else:
            assert fourth_token.wait(120)
        prompt = PROMPTS[0]
        second = client.complete(generate_request(prompt, request_id="dup", sampling=GREEDY), timeout=300)
    finally:
        t.join(300)
    alone(second, prompt, f"duplicate during {moment}")
    assert len(result["first"].token_ids) == 48 and result["first"].finish_reason == "length"
    assert result["first"].request_id == second.request_id == "dup"
    assert idle(stack), "a worker still holds blocks or exports"


def _code(fn) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_each_bound_at_its_limit_and_one_past(client):
    short = {"max_tokens": 1}

    def gen(**kw):
        sampling = {**short, **kw.pop("sampling", {})}
        return lambda: client.complete(generate_request("Hi", sampling=sampling, **kw), timeout=120)

    cases = [
        ("request_id", gen(request_id="x" * MAX_REQUEST_ID_CHARS), gen(request_id="x" * (MAX_REQUEST_ID_CHARS + 1))),
        ("request_id", gen(request_id="plain label"), gen(request_id="line\nbreak")),
        ("stop", gen(sampling={"stop": ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}),
         gen(sampling={"stop": ["s"] * (MAX_STOP_STRINGS + 1)})),
        ("stop", gen(sampling={"stop": ["s" * MAX_STOP_CHARS]}), gen(sampling={"stop": ["s" * (MAX_STOP_CHARS + 1)]})),
        ("stop_token_ids", gen(sampling={"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}),
         gen(sampling={"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))})),
        ("messages", lambda: client.tokenize(messages=[{"role": "user", "content": "hi"}] * MAX_MESSAGES),
         lambda: client.tokenize(messages=[{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1))),
    ]
    for field, at_limit, past in cases:
        assert _code(at_limit)[0] == grpc.StatusCode.OK, field
        code, details = _code(past)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (field, details)
    code, details = _code(gen(request_id="r" * 1_000_000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 200  # the error does not echo the id
    code, details = _code(lambda: client.tokenize(messages=[{"role": "x" * 100_000, "content": "hi"}]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 300


def test_the_id_is_sent_once_not_per_token(client):
    """The streamed bytes with the longest allowed id stay within the id's length of those with a short one."""
    def streamed_bytes(rid: str) -> int:
        req = generate_request("Count to twenty.", request_id=rid, sampling={**GREEDY, "max_tokens": 32})
        return sum(m.ByteSize() for m in client.stream(req, timeout=120))

    short, longest = streamed_bytes("a"), streamed_bytes("a" * MAX_REQUEST_ID_CHARS)
    assert 0 <= longest - short <= MAX_REQUEST_ID_CHARS + 8, (short, longest)


def test_http_bounds_are_400s_naming_the_field(stack):
    import openai

    oai = openai.OpenAI(base_url=stack.gateway.url, api_key="x", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Hi"}]
    assert oai.chat.completions.create(messages=msgs, model=stack.router.service.model.name, max_tokens=1,
                                       user="u" * 256).choices
    for kwargs, param in (({"user": "u" * 257}, "user"), ({"stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop"),
                          ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"), ({"model": "m" * 100_000}, "model")):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            oai.chat.completions.create(**{"messages": msgs, "model": stack.router.service.model.name,
                                           "max_tokens": 1, **kwargs})
        assert e.value.body["param"] == param and len(json.dumps(e.value.body)) < 1000, kwargs


ids = st.one_of(st.text(max_size=20), st.text(min_size=MAX_REQUEST_ID_CHARS - 2, max_size=MAX_REQUEST_ID_CHARS + 2),
                st.sampled_from(["", "\x00", "tab\there", "é" * MAX_REQUEST_ID_CHARS]))
stops = st.lists(st.one_of(st.text(max_size=5), st.text(min_size=MAX_STOP_CHARS - 1, max_size=MAX_STOP_CHARS + 1)),
                 max_size=MAX_STOP_STRINGS + 2)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(rid=ids, stop=stops)
def test_fuzz_ids_and_stop_strings_at_their_bounds(client, rid, stop):
    req = pb.GenerateRequest(request_id=rid, prompt="Hi", sampling=pb.SamplingParams(max_tokens=2, stop=stop))
    code, details = _code(lambda: client.complete(req, timeout=120))
    valid = (len(rid) <= MAX_REQUEST_ID_CHARS and rid.isprintable() and len(stop) <= MAX_STOP_STRINGS
             and all(0 < len(s) <= MAX_STOP_CHARS for s in stop))
    assert code == (grpc.StatusCode.OK if valid else grpc.StatusCode.INVALID_ARGUMENT), (code, details)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(count=st.integers(MAX_MESSAGES - 2, MAX_MESSAGES + 2), role=st.sampled_from(["user", "assistant", "bad"]))
def test_fuzz_message_count_at_its_bound(client, count, role):
    code, details = _code(lambda: client.tokenize(messages=[{"role": role, "content": "hi"}] * count))
    valid = count <= MAX_MESSAGES and role != "bad"
    assert code == (grpc.StatusCode.OK if valid else grpc.StatusCode.INVALID_ARGUMENT), (code, details)
