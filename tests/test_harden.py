"""Limits and hostile input on the real stack (the session's stack, and a router over its workers with
tight limits): every reject is a status with a message, never a crash or a traceback."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.api.client import Client, client_channel
from baton.config import Limits
from baton.services.router.router import Router
from baton.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

# What a reject may be. Never UNKNOWN or INTERNAL (a bug), never UNAVAILABLE (the stack is up).
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
CASES = {"generate": 0, "raw": 0, "tokenize": 0}


@pytest.fixture(scope="module")
def tight(stack, default_model):
    """A second router over the session stack's workers, with small limits."""
    r = Router(default_model.tokenizer, stack.router.service.model, port=0,
               limits=Limits(max_prompt_tokens=40, max_output_tokens=32, max_streams_per_client=2,
                             max_message_bytes=16 << 10))
    for w in stack.router.workers.workers.values():
        r.workers.add(w.name, w.kind, w.address)
    r.update_health()
    r.start()
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
sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-2, 3)),
    temperature=floats, top_p=floats, top_k=st.integers(-2**31, 2**31 - 1), min_p=floats,
    seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(max_size=30), max_size=5),
    stop_token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=5), ignore_eos=st.booleans(),
    repetition_penalty=floats, presence_penalty=floats, frequency_penalty=floats, logprobs=st.booleans())
inputs = st.one_of(
    st.builds(lambda t: {"prompt": t}, texts),
    st.builds(lambda ms: {"messages": pb.Messages(messages=ms)},
              st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "", "tool",
                                                                       "\x00"]), content=texts), max_size=4)),
    st.builds(lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)},
              st.lists(st.integers(-2**31, 2**31 - 1), max_size=50)),
    st.just({}),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(inp=inputs, sp=st.one_of(st.none(), sampling), rid=st.text(max_size=20), prio=st.integers(-5, 2**31 - 1))
def test_fuzz_generate(stack, inp, sp, rid, prio):
    req = pb.GenerateRequest(request_id=rid, **inp)
    if sp is not None:
        # max_tokens small when valid, so that accepted requests end quickly
        req.sampling.CopyFrom(sp)
    req.priority = prio  # proto3 enums are open: unknown values arrive as numbers
    code, msg = _status(_client(stack).stream(req, timeout=60))
    CASES["generate"] += 1
    assert code == grpc.StatusCode.OK or code in CLEAN, (code, msg)
    assert code == grpc.StatusCode.OK or (msg and "Traceback" not in msg), msg


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(
    st.binary(max_size=200),  # random bytes: mostly not a valid message at all
    st.builds(lambda b: b"\x12" + _varint(len(b)) + b, st.binary(min_size=1, max_size=60)),  # prompt: invalid UTF-8
    st.builds(lambda n: b"\x30" + _varint(n), st.integers(0, 2**63)),  # priority: any enum number
    st.builds(lambda ids: b"\x22" + _varint(len(ids) * 5 + 2) + b"\x0a" + _varint(len(ids) * 5)
              + b"".join(struct.pack("<I", i)[:4] + b"\x00" for i in ids), st.lists(st.integers(0, 2**32 - 1),
                                                                                     max_size=20)),
))
def test_fuzz_raw_bytes(stack, payload):
    """Bytes that may not parse as a GenerateRequest at all, sent as one."""
    call = _channel(stack).unary_stream("/baton.v1.Generation/Generate", request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateResponse.FromString)(payload, timeout=60)
    code, msg = _status(call)
    CASES["raw"] += 1
    assert code == grpc.StatusCode.OK or code in CLEAN, (code, msg)
    assert code == grpc.StatusCode.OK or (msg and "Traceback" not in msg), msg


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=texts, big=st.booleans())
def test_fuzz_tokenize_and_list_models(stack, text, big):
    client = _client(stack)
    try:
        ids = client.tokenize(text * (200 if big else 1), timeout=30)
        assert all(i >= 0 for i in ids)
    except grpc.RpcError as e:
        assert e.code() in CLEAN and e.details() and "Traceback" not in e.details(), (e.code(), e.details())
    assert client.list_models(timeout=30)
    CASES["tokenize"] += 1


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


def test_ten_times_the_sustainable_rate(stack, default_model):
    """About 1 request/s of this workload meets the bench SLO here (TTFT <= 1 s, TPOT <= 100 ms); offer 10/s.
    Excess requests are refused at once with a retry hint; the accepted ones keep the SLO."""
    from baton.bench.report import SLO, summarize
    from baton.bench.runner import BatonClient, open_loop
    from baton.bench.workloads import BenchRequest

    r = Router(default_model.tokenizer, stack.router.service.model, port=0,
               limits=Limits(max_streams_per_decode_worker=4, max_queue_s=0.5))
    for w in stack.router.workers.workers.values():
        r.workers.add(w.name, w.kind, w.address)
    r.update_health()
    r.start()
    client = BatonClient(r.address)
    try:
        reqs = [BenchRequest(f"o{i}", f"Request {i}: name two animals and a color.", 12, 32) for i in range(80)]
        open_loop(client, reqs[:4], rate=1.0, warmup=4)  # the router measures the prefill rate
        rss = _rss_mib()
        records, window = open_loop(client, reqs[4:], rate=10.0, seed=3)
        grown = _rss_mib() - rss
    finally:
        client.close()
        r.stop()
    refused = [x for x in records if x.error == "RESOURCE_EXHAUSTED"]
    accepted = [x for x in records if x.error is None]
    assert {x.error for x in records} <= {None, "RESOURCE_EXHAUSTED"}
    assert refused and len(accepted) >= 8, (len(refused), len(accepted))
    assert max(x.e2e for x in refused) < 0.5  # at once, not after queueing
    stats = summarize(accepted, window, SLO(1.0, 0.1, 95), None)
    print(f"overload at 10/s: {len(records)} sent, {len(accepted)} accepted, {len(refused)} refused "
          f"(slowest refusal {max(x.e2e for x in refused) * 1000:.0f} ms); accepted TTFT p95 "
          f"{stats['ttft_s_p95'] * 1000:.0f} ms, TPOT p95 {stats['tpot_s_p95'] * 1000:.0f} ms; "
          f"router RSS +{grown:.0f} MiB")
    assert stats["ttft_s_p95"] <= 1.0 and stats["tpot_s_p95"] <= 0.1, stats
    assert all(x.output_tokens == 32 for x in accepted)
    assert grown < 100, f"router memory grew by {grown:.0f} MiB"


WORKER_CLEAN = CLEAN | {grpc.StatusCode.UNAVAILABLE}  # a Decode whose KV cannot be pulled says so


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=40), sp=st.one_of(st.none(), sampling),
       rid=st.text(max_size=20), first=st.integers(-2**31, 2**31 - 1), worker=st.text(max_size=12),
       state=st.binary(max_size=64), cached=st.integers(-2**31, 2**31 - 1))
def test_fuzz_worker_methods(stack, ids, sp, rid, first, worker, state, cached):
    """The internal API too: Prefill, Release and Decode with random and extreme fields."""
    from baton.v1 import worker_pb2 as wpb
    from baton.v1 import worker_pb2_grpc as wgrpc

    addrs = {w.kind: w.address for w in stack.router.workers.workers.values()}
    sp = sp or pb.SamplingParams()
    with grpc.insecure_channel(addrs["prefill"]) as ch:
        pre = wgrpc.PrefillWorkerStub(ch)
        for call in (lambda: pre.Prefill(wpb.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sp),
                                         timeout=60),
                     lambda: pre.Release(wpb.ReleaseRequest(request_id=rid), timeout=30)):
            try:
                call()
            except grpc.RpcError as e:
                assert e.code() in WORKER_CLEAN and e.details() and "Traceback" not in e.details(), \
                    (e.code(), e.details())
        pre.Release(wpb.ReleaseRequest(request_id=rid), timeout=30)  # drop an export this made
    with grpc.insecure_channel(addrs["decode"]) as ch:
        code, msg = _status(wgrpc.DecodeWorkerStub(ch).Decode(wpb.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, first_token=first, sampling=sp, prefill_worker=worker,
            sampler_state=state, cached_prompt_tokens=cached), timeout=60))
        assert code == grpc.StatusCode.OK or code in WORKER_CLEAN, (code, msg)
        assert code == grpc.StatusCode.OK or (msg and "Traceback" not in msg), msg
    CASES["worker"] = CASES.get("worker", 0) + 1


def test_fuzz_case_count(stack):
    """Runs last in this module: the fuzzers above did run (the count goes into the closing report)."""
    print(f"fuzz cases: {CASES}")
    assert CASES["generate"] >= 100 and CASES["raw"] >= 100 and CASES["tokenize"] >= 50
    assert CASES.get("worker", 0) >= 50
    import time

    import ray

    deadline = time.monotonic() + 30  # and nothing they did is still held
    while True:
        pre, dec = ray.get([stack.prefill[0].stats.remote(), stack.decode[0].stats.remote()])
        idle = pre["exports"] == 0 and pre["requests"] == 0 and dec["free_blocks"] == dec["num_blocks"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle, (pre, dec)
