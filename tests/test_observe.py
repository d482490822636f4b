"""Traces and metrics of the real stack: a real OTLP/gRPC receiver on loopback (the collector's trace
service from opentelemetry-proto), the metrics endpoints over HTTP, the default model."""

from __future__ import annotations

import os
import secrets
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from baton.api.client import Client
from baton.config import EngineConfig, ServeConfig
from baton.serve import Stack
from baton.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

PHASES = {"baton.route", "baton.prefix_lookup", "baton.prefill", "baton.prefill.worker", "baton.prefill.queue",
          "baton.prefill.compute", "baton.kv.export", "baton.decode", "baton.decode.worker", "baton.kv.transfer",
          "baton.kv.pull", "baton.decode.queue", "baton.decode.generate"}


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans as plain dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), None)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "name": s.name, "service": service,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "events": [e.name for e in s.events], "status": s.status.code,
                            "message": s.status.message, "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano})
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


@pytest.fixture(scope="module")
def receiver():
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rec.endpoint = f"http://127.0.0.1:{port}"
    yield rec
    server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver):
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export every 100 ms instead of 5 s (workers get it too)
    try:
        st = Stack(ServeConfig(engine=EngineConfig(kv_cache_memory=256 << 20), port=0, redis_url="memory",
                               otlp_endpoint=receiver.endpoint, metrics_port=0, http_port=None)).start()
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address) as c:
        yield c


def _traceparent() -> tuple[str, str, list[tuple[str, str]]]:
    tid, sid = secrets.token_hex(16), secrets.token_hex(8)
    return tid, sid, [("traceparent", f"00-{tid}-{sid}-01")]


def _wait_for(receiver, stack, tid: str, names: set[str], timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        stack.tracing.force_flush()
        spans = receiver.trace(tid)
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def _check_connected(spans: list[dict], client_span: str) -> dict:
    """One tree under the client's span; returns the root (the router's request span)."""
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent"] == client_span]
    assert len(roots) == 1, [(s["name"], s["parent"]) for s in spans]
    orphans = [s["name"] for s in spans if s["parent"] != client_span and s["parent"] not in ids]
    assert not orphans, orphans
    for s in spans:
        assert s["end"] >= s["start"] > 0, s["name"]
    return roots[0]


def test_one_connected_trace_per_request_with_phases_and_attributes(receiver, stack, client):
    tid, sid, md = _traceparent()
    sp = pb.SamplingParams(max_tokens=12, temperature=0.5, top_p=0.9, seed=3)
    req = pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="Name a fruit.")]),
                             sampling=sp)
    msgs = list(client.stream(req, timeout=120, metadata=md))
    tokens = sum(len(m.token_ids) for m in msgs)
    spans = _wait_for(receiver, stack, tid, PHASES)
    names = {s["name"] for s in spans}
    assert names >= PHASES, PHASES - names
    root = _check_connected(spans, sid)
    by_name = {s["name"]: s for s in spans}
    parent_of = {s["span_id"]: s["name"] for s in spans}
    for child, parent in [("baton.route", root["name"]), ("baton.prefix_lookup", "baton.route"),
                          ("baton.prefill", root["name"]), ("baton.prefill.worker", "baton.prefill"),
                          ("baton.prefill.queue", "baton.prefill.worker"),
                          ("baton.prefill.compute", "baton.prefill.worker"),
                          ("baton.kv.export", "baton.prefill.worker"), ("baton.decode", root["name"]),
                          ("baton.decode.worker", "baton.decode"), ("baton.kv.transfer", "baton.decode.worker"),
                          ("baton.kv.pull", "baton.kv.transfer"), ("baton.decode.generate", "baton.decode.worker")]:
        assert parent_of[by_name[child]["parent"]] == parent, child
    assert {s["service"] for s in spans} == {"baton-router", "baton-prefill", "baton-decode"}

    a = root["attributes"]
    assert root["name"] == f"chat {stack.router.service.model.name}"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == stack.router.service.model.name
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5) and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == msgs[-1].usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == tokens
    assert a["gen_ai.response.finish_reasons"] == [msgs[-1].finish_reason]
    assert a["baton.prefix.cached_tokens"] == msgs[-1].usage.cached_prompt_tokens
    assert "first_token" in root["events"]
    transfer = by_name["baton.kv.transfer"]["attributes"]
    assert transfer["baton.kv.bytes"] > 0 and transfer["baton.kv.seconds"] > 0
    assert by_name["baton.kv.pull"]["attributes"]["baton.kv.bytes"] == transfer["baton.kv.bytes"]
    assert by_name["baton.decode.generate"]["attributes"]["gen_ai.usage.output_tokens"] == tokens
    assert by_name["baton.prefill.worker"]["attributes"]["baton.worker"] == "prefill-0"


def test_cancelled_request_ends_every_span(receiver, stack, client):
    tid, sid, md = _traceparent()
    call = client.stream(pb.GenerateRequest(prompt="Count slowly from one to a thousand:",
                                            sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True)),
                         timeout=120, metadata=md)
    for i, _ in enumerate(call):
        if i == 2:
            break
    call.cancel()
    spans = _wait_for(receiver, stack, tid, {"baton.decode.worker", "baton.decode", "baton.prefill.worker"})
    _check_connected(spans, sid)
    by_name = {s["name"]: s for s in spans}
    root = next(s for s in spans if s["parent"] == sid)
    assert root["attributes"].get("baton.cancelled") is True
    assert by_name["baton.decode.worker"]["attributes"].get("baton.cancelled") is True
    assert "gen_ai.response.finish_reasons" not in root["attributes"]


def test_rejected_request_span_records_the_status(receiver, stack, client):
    tid, sid, md = _traceparent()
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1)),
                           timeout=30, metadata=md))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 10
    while not receiver.trace(tid) and time.monotonic() < deadline:
        stack.tracing.force_flush()
        time.sleep(0.1)
    [root] = receiver.trace(tid)
    assert root["status"] == 2 and "INVALID_ARGUMENT" in root["message"] and "temperature" in root["message"]


def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def test_metrics_endpoints_serve_the_names_and_counts_agree(stack, client):
    addrs = stack.metrics_addresses
    assert set(addrs) == {"router", "prefill-0", "decode-0"}
    before = {k: _scrape(a) for k, a in addrs.items()}
    sent, tokens, prompt = 3, 0, 0
    for i in range(sent):
        msgs = list(client.stream(pb.GenerateRequest(prompt=f"Say hello number {i}.",
                                                     sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True)),
                                  timeout=120))
        tokens += sum(len(m.token_ids) for m in msgs)
        prompt += msgs[-1].usage.prompt_tokens
    time.sleep(0.3)
    after = {k: _scrape(a) for k, a in addrs.items()}

    def delta(who: str, name: str, **labels: str) -> float:
        return _total(after[who], name, **labels) - _total(before[who], name, **labels)

    model = stack.router.service.model.name
    r = "router"
    assert delta(r, "baton_request_success_total", finish_reason="length", model=model, worker="router") == sent
    assert delta(r, "baton_generation_tokens_total") == tokens == 5 * sent
    assert delta(r, "baton_prompt_tokens_total") == prompt
    assert delta(r, "baton_time_to_first_token_seconds_count") == sent
    assert delta(r, "baton_e2e_request_latency_seconds_count") == sent
    assert delta(r, "baton_inter_token_latency_seconds_count") == tokens - sent
    assert delta(r, "baton_prefix_cache_queries_total") == prompt
    assert ("baton_num_requests_running", (("model", model), ("worker", "router"))) in after[r]
    p, d = "prefill-0", "decode-0"
    assert delta(p, "baton_request_queue_time_seconds_count", worker=p) == sent
    assert delta(p, "baton_request_prefill_time_seconds_count", worker=p) == sent
    assert delta(d, "baton_request_decode_time_seconds_count", worker=d) == sent
    assert delta(d, "baton_kv_transfer_seconds_count", worker=d) == sent
    assert delta(d, "baton_kv_transfer_bytes_total", worker=d) > 0
    assert delta(d, "baton_batch_size_count", worker=d) >= 4  # at least 4 decode steps per request, batched or not
    for who in (p, d):
        names = {n for n, _ in after[who]}
        assert {"baton_kv_cache_usage_perc", "baton_num_requests_running", "baton_num_requests_waiting"} <= names
        assert 0 <= _total(after[who], "baton_kv_cache_usage_perc", worker=who) <= 1


@pytest.fixture(scope="module")
def gateway(stack):
    from baton.services.gateway.server import Gateway

    gw = Gateway(stack.address, "127.0.0.1", 0, 4 << 20).start()
    yield gw
    gw.stop()


def test_http_request_is_one_connected_trace_from_the_callers_span(receiver, stack, gateway):
    """The gateway passes the caller's traceparent on: router, prefill, KV transfer and decode join its trace."""
    import openai

    tid, sid, md = _traceparent()
    oai = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)
    model = stack.router.service.model.name
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}],
                                    max_tokens=6, temperature=0, extra_headers=dict(md))
    spans = _wait_for(receiver, stack, tid, PHASES)
    names = {s["name"] for s in spans}
    assert names >= PHASES, PHASES - names
    root = _check_connected(spans, sid)
    assert root["name"] == f"chat {model}" and root["attributes"]["gen_ai.request.max_tokens"] == 6
    assert root["attributes"]["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert {s["service"] for s in spans} == {"baton-router", "baton-prefill", "baton-decode"}


def test_a_migration_is_a_span_of_the_request_and_a_metric(receiver, stack, client):
    """A decode worker killed mid-stream: the request's trace shows the move (cause, from where, how many tokens
    the client had) between the failed decode call and the one that went on, and the router counts it."""
    import ray

    from baton import metrics

    stack.add_worker("decode")
    deadline = time.monotonic() + 30
    while stack.router.workers.count("decode") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.router.workers.count("decode") == 2
    before = sum(metrics.sample(metrics.MIGRATIONS, cause=c) for c in metrics.MIGRATION_CAUSES)
    tid, sid, md = _traceparent()
    req = pb.GenerateRequest(prompt="Count upwards from one.",
                             sampling=pb.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    n, killed = 0, False
    for msg in client.stream(req, timeout=120, metadata=md):
        n += len(msg.token_ids)
        if n >= 4 and not killed:
            busy = [h for h in stack.decode if ray.get(h.stats.remote(), timeout=10)["requests"]]
            assert len(busy) == 1
            ray.kill(busy[0], no_restart=True)
            killed = True
    assert n == 32
    deadline = time.monotonic() + 20
    while True:  # the worker that went on exports its span when the stream ends
        spans = _wait_for(receiver, stack, tid, {"baton.migration"})
        if any(s["attributes"].get("baton.migration.generated_tokens") for s in spans) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # One tree, but for the killed worker's spans: those it had not exported died with it, so what hung below
    # them (its KV transfer, the prefill worker's pull for it) comes without a parent.
    ids = {s["span_id"] for s in spans}
    (root,) = [s for s in spans if s["parent"] == sid]
    orphans = [s for s in spans if s["parent"] != sid and s["parent"] not in ids]
    dead_call = {"baton.kv.transfer", "baton.kv.pull", "baton.decode.queue", "baton.decode.generate"}
    assert {s["name"] for s in orphans} <= dead_call, orphans
    (move,) = [s for s in spans if s["name"] == "baton.migration"]
    assert move["parent"] == root["span_id"] and root["attributes"]["baton.migrations"] == 1
    assert move["attributes"]["baton.migration.cause"] in metrics.MIGRATION_CAUSES
    assert move["attributes"]["baton.migration.tokens_sent"] >= 4
    calls = sorted((s for s in spans if s["name"] == "baton.decode"), key=lambda s: s["start"])
    assert len(calls) == 2 and calls[0]["status"] == 2 and calls[1]["status"] != 2  # 2: ERROR
    assert calls[0]["attributes"]["baton.worker"] == move["attributes"]["baton.migration.from"]
    assert calls[0]["end"] <= move["start"] + 1_000_000_000 and move["end"] <= calls[1]["end"]
    resumed = [s for s in spans if s["name"] == "baton.decode.worker"
               and s["attributes"].get("baton.migration.generated_tokens")]
    assert len(resumed) == 1 and resumed[0]["attributes"]["baton.migration.generated_tokens"] >= 4
    assert sum(metrics.sample(metrics.MIGRATIONS, cause=c) for c in metrics.MIGRATION_CAUSES) == before + 1
