"""Limits and hostile input on the real stack (the session's stack, and a router over its workers with
tight limits): every reject is a status with a message, never a crash or a traceback."""

from __future__ import annotations

import struct
import threading
from collections import Counter
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.api.client import Client, client_channel
from baton.config import Limits
from baton.v1 import generation_pb2 as pb
from tests.stack_state import idle, router_over, stats

pytestmark = pytest.mark.slow

# What a reject may be. Never UNKNOWN or INTERNAL (a bug), never UNAVAILABLE (the stack is up).
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}


@pytest.fixture(scope="module")
def tight(stack):
    """A second router over the session stack's workers, with small limits."""
    r = router_over(stack, limits=Limits(max_prompt_tokens=40, max_output_tokens=32, max_streams_per_client=2,
                                         max_message_bytes=16 << 10))
    with Client(r.address) as client:
        yield client
    r.stop()


def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in call:
            break
        call.cancel()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def test_limits_reject_with_the_flag_to_change(tight):
    code, msg = _status(tight.stream(pb.GenerateRequest(prompt="word " * 60), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-tokens" in msg
    code, msg = _status(tight.stream(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=33)),
                                     timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-output-tokens" in msg and "sampling.max_tokens" in msg
    code, msg = _status(tight.stream(pb.GenerateRequest(prompt="x" * (20 << 10)), timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # larger than the message limit: gRPC refuses it


def test_streams_per_client_are_bounded_with_a_retry_hint(tight):
    slow = pb.SamplingParams(max_tokens=32, ignore_eos=True)
    open_calls = [tight.stream(pb.GenerateRequest(prompt=f"Count to ten, take {i}.", sampling=slow), timeout=60)
                  for i in range(2)]
    for c in open_calls:
        next(iter(c))  # both streams are open
    with pytest.raises(grpc.RpcError) as err:
        list(tight.stream(pb.GenerateRequest(prompt="one more"), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams-per-client" in err.value.details()
    assert ("grpc-retry-pushback-ms", "500") in (err.value.trailing_metadata() or ())
    for c in open_calls:
        list(c)
    assert _status(tight.stream(pb.GenerateRequest(prompt="now there is room"), timeout=60))[0] == grpc.StatusCode.OK


texts = st.one_of(st.text(max_size=40), st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=400),
                  st.just(""), st.just("\x00" * 10), st.just("\ud7ff\ue000\U0010ffff"))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-45, 1e38]))
extreme_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-2, 3)),
    temperature=floats, top_p=floats, top_k=st.integers(-2**31, 2**31 - 1), min_p=floats,
    seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(max_size=30), max_size=5),
    stop_token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=5), ignore_eos=st.booleans(),
    repetition_penalty=floats, presence_penalty=floats, frequency_penalty=floats, logprobs=st.booleans())
# Mostly valid, with few tokens: requests that are accepted (and end quickly), so that answers get checked too.
valid_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.integers(1, 6), temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(0, 50),
    min_p=st.floats(0, 1), seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3), ignore_eos=st.booleans(),
    repetition_penalty=st.floats(0.5, 2), presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    logprobs=st.booleans(), top_logprobs=st.integers(0, 5))
sampling = st.one_of(extreme_sampling, valid_sampling)
inputs = st.one_of(
    st.builds(lambda t: {"prompt": t}, texts),
    st.builds(lambda ms: {"messages": pb.Messages(messages=ms)},
              st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "", "tool",
                                                                       "\x00"]), content=texts), max_size=4)),
    st.builds(lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)},
              st.lists(st.integers(-2**31, 2**31 - 1), max_size=50)),
    st.builds(lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)},  # ids in any model's vocabulary
              st.lists(st.integers(0, 1000), min_size=1, max_size=50)),
    st.just({}),
)


def _answer(call, max_tokens: int, model, prompt_tokens: int | None = None) -> tuple[grpc.StatusCode, str]:
    """Read the whole answer. An accepted one must be sane: at most max_tokens tokens from the vocabulary (exactly
    that many when it ends for length, short of a full context), stop or length on the last message only, usage
    that counts the tokens streamed and a prompt, UTF-8 text."""
    msgs = []
    try:
        for msg in call:
            msgs.append(msg)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    ids = [t for m in msgs for t in m.token_ids]
    last = msgs[-1] if msgs else None
    assert last is not None and last.finish_reason in ("stop", "length"), msgs
    assert not any(m.finish_reason for m in msgs[:-1]), msgs
    assert last.usage.completion_tokens == len(ids) <= max_tokens, (len(ids), max_tokens, last.usage)
    assert last.usage.prompt_tokens > 0 and prompt_tokens in (None, last.usage.prompt_tokens), last.usage
    if last.finish_reason == "length":
        assert len(ids) == max_tokens or last.usage.prompt_tokens + len(ids) >= model.max_model_len, last.usage
    assert all(0 <= t < model.vocab_size for t in ids), ids
    "".join(m.text for m in msgs).encode("utf-8")  # raises on a lone surrogate (half a character)
    return grpc.StatusCode.OK, ""


def _max_tokens(req: pb.GenerateRequest, limits: Limits) -> int:
    """What the router resolves the request's max_tokens to."""
    asked = req.HasField("sampling") and req.sampling.HasField("max_tokens")
    return req.sampling.max_tokens if asked else limits.default_max_tokens


def _clean(code: grpc.StatusCode, msg: str, allowed: set = CLEAN) -> None:
    assert code == grpc.StatusCode.OK or code in allowed, (code, msg)
    assert code == grpc.StatusCode.OK or (msg and "Traceback" not in msg), msg


def test_fuzz_generate(stack):
    """150 random requests: each is answered sanely or refused cleanly; then the stack holds nothing."""
    service = stack.router.service
    seen: Counter = Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(inp=inputs, sp=st.one_of(st.none(), sampling), rid=st.text(max_size=20), prio=st.integers(-5, 2**31 - 1))
    def case(inp, sp, rid, prio):
        req = pb.GenerateRequest(request_id=rid, **inp)
        if sp is not None:
            req.sampling.CopyFrom(sp)
        req.priority = prio  # proto3 enums are open: unknown values arrive as numbers
        given_ids = len(inp["prompt_token_ids"].ids) if "prompt_token_ids" in inp else None
        code, msg = _answer(_client(stack).stream(req, timeout=60), _max_tokens(req, service.limits),
                            service.model, given_ids)
        _clean(code, msg)
        seen[code.name] += 1

    case()
    print(f"fuzz generate: {dict(seen)}")
    # Hypothesis ran its examples, and enough were accepted that the answer checks above mean something.
    assert seen.total() >= 100 and seen["OK"] >= 20, seen
    assert idle(stack), stats(stack)


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


# Ends every payload: sampling {max_tokens: 2} (of a field given twice the last wins), so that the payloads that
# parse and are accepted end quickly.
TWO_TOKENS = b"\x2a\x02\x08\x02"


def test_fuzz_raw_bytes(stack):
    """Bytes that may not parse as a GenerateRequest at all, sent as one: a sane answer or a clean refusal."""
    service = stack.router.service
    seen: Counter = Counter()

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=st.one_of(
        st.binary(max_size=200),  # random bytes: mostly not a valid message at all
        st.builds(lambda b: b"\x12" + _varint(len(b)) + b, st.binary(min_size=1, max_size=60)),  # prompt: bad UTF-8
        st.builds(lambda n: b"\x30" + _varint(n), st.integers(0, 2**63)),  # priority: any enum number
        st.builds(lambda ids: b"\x22" + _varint(len(ids) * 5 + 2) + b"\x0a" + _varint(len(ids) * 5)
                  + b"".join(struct.pack("<I", i)[:4] + b"\x00" for i in ids), st.lists(st.integers(0, 2**32 - 1),
                                                                                         max_size=20)),
    ))
    def case(payload):
        payload += TWO_TOKENS
        call = _channel(stack).unary_stream("/baton.v1.Generation/Generate", request_serializer=lambda b: b,
                                            response_deserializer=pb.GenerateResponse.FromString)(payload, timeout=60)
        try:
            limit = _max_tokens(pb.GenerateRequest.FromString(payload), service.limits)
        except Exception:  # noqa: BLE001 - it does not parse: the router must refuse it, never answer
            limit = 0
        code, msg = _answer(call, limit, service.model)
        _clean(code, msg)
        seen[code.name] += 1

    case()
    print(f"fuzz raw bytes: {dict(seen)}")
    assert seen.total() >= 100, seen
    assert idle(stack), stats(stack)


def test_fuzz_tokenize_and_list_models(stack):
    seen: Counter = Counter()

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=texts, big=st.booleans())
    def case(text, big):
        client = _client(stack)
        try:
            ids = client.tokenize(text * (200 if big else 1), timeout=30)
            assert all(0 <= i < stack.router.service.model.vocab_size for i in ids)
            seen["OK"] += 1
        except grpc.RpcError as e:
            _clean(e.code(), e.details())
            seen[e.code().name] += 1
        assert client.list_models(timeout=30)

    case()
    print(f"fuzz tokenize: {dict(seen)}")
    assert seen.total() >= 50 and seen["OK"] >= 10, seen


_channels: dict = {}
_lock = threading.Lock()


def _channel(stack) -> grpc.Channel:
    """One channel to the stack for the fuzzers: the raw-bytes one calls on it directly."""
    with _lock:
        if stack.address not in _channels:
            _channels[stack.address] = client_channel(stack.address)
        return _channels[stack.address]


def _client(stack) -> Client:
    return Client(channel=_channel(stack))


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _mean_in_flight(records, until: float) -> float:
    """Requests in flight on average from 0 to ``until`` (client side: send to last message)."""
    return sum(max(0.0, min(r.done, until) - r.sent) for r in records) / until


def test_ten_times_the_sustainable_rate(stack):
    """A router that admits 4 streams per decode worker. Baseline: 4 closed-loop clients, the most it admits, so
    none is refused. Then Poisson arrivals at 10/s: the excess is refused at once, the 4 slots stay busy but
    never overfull, and the accepted requests' latency stays near the baseline's."""
    from baton.bench.report import SLO, percentile, summarize
    from baton.bench.runner import BatonClient, closed_loop, open_loop
    from baton.bench.workloads import BenchRequest

    slots = 4
    r = router_over(stack, limits=Limits(max_streams_per_decode_worker=slots, max_queue_s=0.5))
    client = BatonClient(r.address)
    try:
        reqs = [BenchRequest(f"o{i}", f"Request {i}: name two animals and a color.", 12, 32) for i in range(96)]
        open_loop(client, reqs[:4], rate=1.0, warmup=4)  # the router measures the prefill rate
        base, base_window = closed_loop(client, reqs[4:16], concurrency=slots)
        rss = _rss_mib()
        records, window = open_loop(client, reqs[16:], rate=10.0, seed=3)
        grown = _rss_mib() - rss
    finally:
        client.close()
        r.stop()
    assert all(x.error is None and x.output_tokens == 32 for x in base), [x.error for x in base]
    capacity = len(base) / base_window  # requests/s the 4 slots serve
    refused = [x for x in records if x.error == "RESOURCE_EXHAUSTED"]
    accepted = [x for x in records if x.error is None]
    assert {x.error for x in records} <= {None, "RESOURCE_EXHAUSTED"}
    assert all(x.output_tokens == 32 for x in accepted)
    b = summarize(base, base_window, SLO(), None)
    o = summarize(accepted, window, SLO(), None)
    arrivals = max(x.sent for x in records)
    in_flight = _mean_in_flight(accepted, arrivals)
    print(f"baseline ({slots} clients): {capacity:.2f} req/s, TTFT p95 {b['ttft_s_p95'] * 1000:.0f} ms, TPOT p95 "
          f"{b['tpot_s_p95'] * 1000:.0f} ms; at 10/s: {len(records)} sent, {len(accepted)} accepted, {len(refused)} "
          f"refused (slowest refusal {max((x.e2e for x in refused), default=0) * 1000:.0f} ms), {in_flight:.2f} in "
          f"flight, TTFT p95 {o['ttft_s_p95'] * 1000:.0f} ms, TPOT p95 {o['tpot_s_p95'] * 1000:.0f} ms; "
          f"router RSS +{grown:.0f} MiB")
    # 10/s is an overload (at least twice what the slots serve), so the limit must refuse at least half.
    assert capacity < 5, capacity
    assert len(refused) >= len(records) / 2, (len(refused), len(accepted))
    # Accepted ones keep the slots busy while requests arrive (a slot that frees is refilled within about
    # 0.1 s), and never more than 4 are held (a few ms more seen from the client: its send and last message).
    assert 2 <= in_flight <= slots + 0.5, in_flight
    # Refused at once: faster than an accepted request's first token, and far faster than a queued
    # request would be (it would wait at least for a slot, i.e. a whole accepted request).
    assert percentile([x.e2e for x in refused], 90) < o["ttft_s_p50"], o
    assert max(x.e2e for x in refused) < min(x.e2e for x in accepted)
    # Same batch size as the baseline: latency stays near it (2x and 0.25 s for a box other jobs share).
    # Without the limit about 35 streams pile up here: TTFT p95 over 20 s, TPOT p95 ~5x.
    assert o["tpot_s_p95"] <= 2 * b["tpot_s_p95"], (o, b)
    assert o["ttft_s_p95"] <= 2 * b["ttft_s_p95"] + 0.25, (o, b)
    assert grown < 100, f"router memory grew by {grown:.0f} MiB"


WORKER_CLEAN = CLEAN | {grpc.StatusCode.UNAVAILABLE}  # a Decode whose KV cannot be pulled says so


def test_fuzz_worker_methods(stack):
    """The internal API too: Prefill, Release and Decode with random and extreme fields. A first token the
    prefill worker gives is sane; nothing is held afterwards."""
    from baton.v1 import worker_pb2 as wpb
    from baton.v1 import worker_pb2_grpc as wgrpc

    addrs = {w.kind: w.address for w in stack.router.workers.workers.values()}
    model = stack.router.service.model
    seen: Counter = Counter()

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=40), sp=st.one_of(st.none(), sampling),
           rid=st.text(max_size=20), first=st.integers(-2**31, 2**31 - 1), worker=st.text(max_size=12),
           state=st.binary(max_size=64), cached=st.integers(-2**31, 2**31 - 1))
    def case(ids, sp, rid, first, worker, state, cached):
        sp = sp or pb.SamplingParams()
        with grpc.insecure_channel(addrs["prefill"]) as ch:
            pre = wgrpc.PrefillWorkerStub(ch)
            try:
                resp = pre.Prefill(wpb.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sp), timeout=60)
                assert 0 <= resp.first_token < model.vocab_size and resp.finish_reason in ("", "stop", "length"), resp
                # It holds the KV for a pull unless the first token ended the request.
                assert (resp.kv_bytes == 0) == bool(resp.finish_reason), resp
                seen["prefill OK"] += 1
            except grpc.RpcError as e:
                _clean(e.code(), e.details(), WORKER_CLEAN)
            try:
                pre.Release(wpb.ReleaseRequest(request_id=rid), timeout=30)  # drop an export this made
            except grpc.RpcError as e:
                _clean(e.code(), e.details(), WORKER_CLEAN)
        with grpc.insecure_channel(addrs["decode"]) as ch:
            call = wgrpc.DecodeWorkerStub(ch).Decode(wpb.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, first_token=first, sampling=sp, prefill_worker=worker,
                sampler_state=state, cached_prompt_tokens=cached), timeout=60)
            code, msg = _answer(call, sp.max_tokens, model, len(ids))
            _clean(code, msg, WORKER_CLEAN)
        seen[f"decode {code.name}"] += 1

    case()
    print(f"fuzz worker methods: {dict(seen)}")
    assert seen.total() - seen["prefill OK"] >= 50, seen
    assert idle(stack), stats(stack)
