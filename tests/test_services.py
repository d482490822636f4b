"""The disaggregated stack: real Ray, real gRPC on loopback, the default model."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from baton.api import SamplingParams
from baton.api.client import Client, client_channel
from baton.config import Limits
from baton.engine.engine import LLMEngine
from baton.services.decode.worker import DecodeWorker
from baton.services.router.router import Router
from baton.services.router.wire import ModelInfo
from baton.services.worker import WorkerSpec
from baton.v1 import generation_pb2 as pb
from tests.oracle import assert_same_or_near_tie, hf_from_loaded
from tests.stack_config import STACK_ENGINE as ENGINE
from tests.stack_state import object_store, router_over, stats, wait_idle

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.", "hi",
    "Explain in one sentence why the sky is blue.", "Translate 'good morning' into Spanish.",
    "What is 12 times 7?", "Name a famous painting by Leonardo da Vinci.",
]


@pytest.fixture(scope="session")
def channel(stack):
    with client_channel(stack.address) as ch:
        yield ch


@pytest.fixture(scope="session")
def client(channel):
    return Client(channel=channel)


@pytest.fixture(scope="session")
def local_engine(default_model):
    return LLMEngine(ENGINE, loaded=default_model)


def _chat(q: str) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(role="user", content=q)])


def _generate(client: Client, timeout: float = 120, **kw) -> tuple[list[int], str, pb.GenerateResponse]:
    ids, text, last = [], "", None
    for msg in client.stream(pb.GenerateRequest(**kw), timeout=timeout):
        ids += msg.token_ids
        text += msg.text
        last = msg
    return ids, text, last


def test_answers_paris(client):
    ids, text, last = _generate(client, messages=_chat("What is the capital of France?"),
                                sampling=pb.SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in text
    assert last.finish_reason == "stop"
    assert last.usage.completion_tokens == len(ids)
    assert last.usage.prompt_tokens > 0


def test_greedy_matches_single_process_alone_and_32_concurrent(client, local_engine, default_model):
    tok = default_model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q + f" (variant {i})"}])
               for i, q in enumerate(QUESTIONS * 4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in local_engine.generate(prompts, params)]
    sp = pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(p):
        return _generate(client, prompt_token_ids=pb.TokenIds(ids=p), sampling=sp)[0]

    alone = [run(p) for p in prompts[:2]]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(run, prompts))
    hf = hf_from_loaded(default_model)
    for i, p in enumerate(prompts[:2]):
        assert_same_or_near_tie(alone[i], expected[i], p, hf, f"alone {i}")
    for i, p in enumerate(prompts):
        assert_same_or_near_tie(together[i], expected[i], p, hf, f"concurrent {i}")


def test_64_concurrent_streams_complete(client, stack):
    def run(i):
        n = 4 + i % 7
        ids, _, last = _generate(client, prompt=f"Count to ten, take {i}:",
                                 sampling=pb.SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True))
        return n, len(ids), last.usage.completion_tokens, last.finish_reason

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, range(64)))
    assert all(n == got == usage and reason == "length" for n, got, usage, reason in results), results
    _, dec = wait_idle(stack)
    assert all(d["free_blocks"] == d["num_blocks"] for d in dec)


def test_object_store_holds_no_kv_after_200_requests(client, stack):
    def run(i):
        return _generate(client, prompt=f"Say something about the number {i}.",
                         sampling=pb.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[2].finish_reason

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(run, range(200))) == {"length"}
    pre, dec = wait_idle(stack)
    assert sum(d["handoffs"] for d in dec) >= 200
    assert all(p["exports"] == 0 and p["export_bytes"] == 0 for p in pre)
    objects, summary = object_store(timeout=20)
    assert objects == 0, summary


def test_cancelled_streams_free_blocks_on_both_sides(client, stack):
    """100 streams cancelled at different moments (during prefill, hand-off and decode)."""
    def run(i):
        call = client.stream(pb.GenerateRequest(
            prompt=f"Tell me a long story about dragon number {i}.",
            sampling=pb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)), timeout=120)
        if i % 3 == 0:
            time.sleep(0.01 * (i % 10))
        else:
            next(call)  # something streamed: cancel mid-decode
        call.cancel()

    with ThreadPoolExecutor(25) as pool:
        list(pool.map(run, range(100)))
    pre, dec = wait_idle(stack, timeout=60)
    assert all(p["requests"] == 0 and p["exports"] == 0 for p in pre), pre
    assert all(d["requests"] == 0 and d["free_blocks"] == d["num_blocks"] for d in dec), dec
    # No handler thread is left waiting on a request that was aborted under it.
    assert all(p["active_prefills"] == 0 for p in pre) and all(d["active_streams"] == 0 for d in dec), (pre, dec)


def test_deadline_frees_blocks(client, stack):
    with pytest.raises(grpc.RpcError) as e:
        _generate(client, timeout=1.0, prompt="Write an essay.",
                  sampling=pb.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _, dec = wait_idle(stack)
    assert all(d["free_blocks"] == d["num_blocks"] for d in dec)


@pytest.mark.parametrize("kw,field", [
    ({}, "prompt, messages or prompt_token_ids"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt_token_ids": pb.TokenIds(ids=[1, 10**7])}, "prompt_token_ids"),
    ({"messages": pb.Messages(messages=[pb.ChatMessage(role="wizard", content="hi")])}, "role"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(temperature=-1)}, "sampling.temperature"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(top_p=0)}, "sampling.top_p"),
    ({"prompt": "hi", "sampling": pb.SamplingParams(max_tokens=0)}, "sampling.max_tokens"),
    ({"prompt": "word " * 9000}, "shorten the prompt"),
])
def test_invalid_argument_names_the_field(client, kw, field):
    with pytest.raises(grpc.RpcError) as e:
        _generate(client, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_tokenize_and_list_models(client, default_model):
    token_ids = client.tokenize(messages=[{"role": "user", "content": "hello"}])
    assert list(token_ids) == default_model.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    models = client.list_models()
    assert len(models) == 1 and models[0].vocab_size == default_model.config.vocab_size


def test_reflection_lists_the_service_and_health_serving(channel):
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "baton.v1.Generation" in names
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "baton.v1.Generation"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_health_not_serving_without_workers(default_model):
    router = Router(default_model.tokenizer, ModelInfo("m", 100, default_model.config.vocab_size), port=0)
    router.start()
    try:
        with client_channel(router.address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="baton.v1.Generation"))
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                _generate(Client(channel=ch), prompt="hi")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.stop()


def test_overload_is_resource_exhausted_at_once(stack):
    """A router that admits one request at a time refuses the second at once: while the first one streams,
    within a few of its tokens, not after it (queued, it would wait for all of the first one's 99 tokens)."""
    small = router_over(stack, limits=Limits(max_in_flight=1))
    try:
        with Client(small.address) as s:
            long_call = s.stream(pb.GenerateRequest(
                prompt="Write a long poem.", sampling=pb.SamplingParams(max_tokens=100, ignore_eos=True)), timeout=120)
            next(long_call)
            arrivals: list[tuple[float, int]] = []  # (time, tokens) of each later message of the held stream

            def read():
                with contextlib.suppress(grpc.RpcError):  # cancelled below
                    for msg in long_call:
                        arrivals.append((time.monotonic(), len(msg.token_ids)))

            reader = threading.Thread(target=read)
            reader.start()
            t = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                _generate(s, prompt="hi")
            refused = time.monotonic()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            long_call.cancel()
            reader.join()
        # A refusal costs about a tokenization; 10 tokens leave room for this process losing its core a while.
        during = sum(n for at, n in arrivals if t <= at <= refused)
        assert during < 10, (during, arrivals)
    finally:
        small.stop()


def test_health_answers_while_the_stack_is_busy(stack, channel, client):
    """20 health checks at once answer SERVING while 8 long streams decode (on the decode worker before the
    checks and still after them)."""
    def busy() -> int:
        return sum(d["active_streams"] for d in stats(stack)[1])

    calls = [client.stream(pb.GenerateRequest(prompt=f"Tell me a long story, take {i}.", sampling=pb.SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True)), timeout=120) for i in range(8)]
    try:
        for c in calls:
            next(c)
        deadline = time.monotonic() + 30
        while busy() < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert busy() == 8
        statuses, errors = [], []

        def check():
            try:
                statuses.append(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                          timeout=5).status)
            except grpc.RpcError as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=check) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and statuses == [health_pb2.HealthCheckResponse.SERVING] * 20, (errors, statuses)
        assert busy() == 8  # the streams were decoding all along
    finally:
        for c in calls:
            c.cancel()
    _, dec = wait_idle(stack)
    assert all(d["active_streams"] == 0 and d["free_blocks"] == d["num_blocks"] for d in dec), dec


def _spec(stack, name: str, engine) -> WorkerSpec:
    """A worker outside the stack's pools, registered in its namespace."""
    return WorkerSpec(name=name, engine=engine, host="127.0.0.1", threads=1, admission_wait=0.015,
                      namespace=stack.namespace)


def _router_over(stack, default_model, workers: list[tuple[str, str, str]]) -> Router:
    r = Router(default_model.tokenizer, stack.router.service.model, port=0)
    for name, kind, address in workers:
        r.workers.add(name, kind, address)
    r.update_health()
    r.start()
    return r


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_decode_worker_before_streaming_is_retried_elsewhere(stack, default_model):
    pre = stack.router.workers.candidates("prefill", set())[0]
    dec = stack.router.workers.candidates("decode", set())[0]
    # A decode worker that is gone (nothing listens there) comes first: the request must land on the live one.
    router = _router_over(stack, default_model, [(pre.name, "prefill", pre.address),
                                                 ("decode-gone", "decode", f"127.0.0.1:{_free_port()}"),
                                                 (dec.name, "decode", dec.address)])
    try:
        with Client(router.address) as c:
            ids, text, last = _generate(c, messages=_chat("What is the capital of France?"),
                                        sampling=pb.SamplingParams(temperature=0, max_tokens=16))
        assert "Paris" in text and last.finish_reason == "stop"
    finally:
        router.stop()
    pre_stats, _ = wait_idle(stack)
    assert all(p["exports"] == 0 for p in pre_stats)


def test_first_token_reaches_the_client_before_the_decode_hand_off(stack, default_model, local_engine):
    """The router streams the prefill's first token at once: a decode worker that never answers (a
    socket the kernel accepts connections on, silent) does not hold it back. Cancelling then drops
    the prefill's KV export."""
    import socket

    from baton.api import SamplingParams

    q = "What is the capital of France?"
    ref = local_engine.generate([local_engine.tokenizer.encode_chat([{"role": "user", "content": q}])],
                                SamplingParams(max_tokens=1, temperature=0))[0]
    silent = socket.create_server(("127.0.0.1", 0))
    pre = stack.router.workers.candidates("prefill", set())[0]
    router = _router_over(stack, default_model, [(pre.name, "prefill", pre.address),
                                                 ("decode-silent", "decode", f"127.0.0.1:{silent.getsockname()[1]}")])
    try:
        with Client(router.address) as c:
            call = c.stream(pb.GenerateRequest(
                messages=_chat(q), sampling=pb.SamplingParams(temperature=0, max_tokens=16)), timeout=60)
            first = next(call)
            assert list(first.token_ids) == ref.token_ids and first.text == ref.text and not first.finish_reason
            call.cancel()
    finally:
        router.stop()
        silent.close()
    pre_stats, _ = wait_idle(stack)
    assert all(p["exports"] == 0 for p in pre_stats)


def test_a_first_token_that_ends_the_request_is_the_whole_answer(stack, local_engine):
    """max_tokens 1: the prefill's token is the answer (one message: token, text, finish reason, usage),
    no decode worker takes part and no KV export is left behind."""
    q = "What is the capital of France?"
    prompt = local_engine.tokenizer.encode_chat([{"role": "user", "content": q}])
    ref = local_engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=True))[0]
    _, dec_before = stats(stack)
    with Client(stack.address) as c:
        msgs = list(c.stream(pb.GenerateRequest(
            messages=_chat(q), sampling=pb.SamplingParams(max_tokens=1, temperature=0, logprobs=True)), timeout=60))
    assert len(msgs) == 1
    (m,) = msgs
    assert list(m.token_ids) == ref.token_ids and m.text == ref.text and m.finish_reason == "length"
    assert m.usage.prompt_tokens == len(prompt) and m.usage.completion_tokens == 1
    assert len(m.logprobs) == 1 and abs(m.logprobs[0] - ref.logprobs[0]) < 1e-4
    pre_stats, dec_after = wait_idle(stack)
    assert [d["handoffs"] for d in dec_after] == [d["handoffs"] for d in dec_before]
    assert all(p["exports"] == 0 for p in pre_stats)


def test_workers_run_on_their_own_cores_when_they_fit(stack):
    """A stack on its own local Ray pins each worker to its own cores when the workers' threads fit the
    cores this process may use; otherwise every worker may run anywhere. Either way at normal priority."""
    from baton.serve import assign_cpus

    cores = sorted(os.sched_getaffinity(0))
    infos = ray.get([h.info.remote() for h in stack.prefill + stack.decode])
    threads = stack._threads
    if len(infos) * threads <= len(cores):
        assert stack.pinned
        got = [i.cpus for i in infos]
        assert all(len(c) == threads for c in got) and len({x for c in got for x in c}) == len(infos) * threads
        assert {x for c in got for x in c} <= set(cores)
        assert stack.worker_cpus == {i.name: i.cpus for i in infos}
    else:
        assert not stack.pinned and all(i.cpus == cores for i in infos)
    # Its own local Ray runs the workers at normal priority, not Ray's default niceness of 15.
    assert stack._owns_ray and [i.nice for i in infos] == [0] * len(infos)
    free = [0, 1, 2, 5]
    assert assign_cpus(free, 2) == [0, 1] and assign_cpus(free, 2) == [2, 5] and free == []
    assert assign_cpus(free, 1) is None


def test_worker_dying_mid_stream_moves_the_stream_and_discovery(stack, default_model):
    from baton import metrics

    extra = ray.remote(DecodeWorker).options(name="decode-extra", namespace=stack.namespace, num_cpus=0,
                                             max_concurrency=32).remote(_spec(stack, "decode-extra", ENGINE), 30.0)
    info = ray.get(extra.info.remote())
    # The worker registered itself; the stack's router picks it up without a restart.
    deadline = time.monotonic() + 10
    while "decode-extra" not in stack.router.workers.workers and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "decode-extra" in stack.router.workers.workers

    pre = stack.router.workers.candidates("prefill", set())[0]
    dec = next(w for w in stack.router.workers.candidates("decode", set()) if w.name != "decode-extra")
    # decode-extra first: at equal load the router takes the worker it knew first.
    router = _router_over(stack, default_model, [(pre.name, "prefill", pre.address),
                                                 ("decode-extra", "decode", info.address),
                                                 (dec.name, "decode", dec.address)])
    req = pb.GenerateRequest(prompt="Tell me a very long story.",
                             sampling=pb.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    moved = metrics.sample(metrics.MIGRATIONS, cause="decode_unavailable")
    try:
        with Client(router.address) as c:
            reference = [t for m in c.stream(req, timeout=60) for t in m.token_ids]  # on decode-extra, undisturbed
            call = c.stream(req, timeout=60)
            ids = list(next(call).token_ids)  # the first token (the router's)
            ids += next(call).token_ids  # the second (the decode worker's): mid-stream from here
            ray.kill(extra)
            for msg in call:  # the stream goes on, on the other decode worker
                ids += msg.token_ids
            assert ids == reference
            assert metrics.sample(metrics.MIGRATIONS, cause="decode_unavailable") == moved + 1
    finally:
        router.stop()
    # The main router stops routing to the dead worker: its health checks fail, it is dropped and unregistered.
    deadline = time.monotonic() + 30
    while "decode-extra" in stack.router.workers.workers and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "decode-extra" not in stack.router.workers.workers
    assert "decode-extra" not in {i.name for i in ray.get(stack.registry.workers.remote())}
    # Requests keep succeeding, each handed off to the stack's own decode worker.
    before = sum(d["handoffs"] for d in stats(stack)[1])
    with Client(stack.address) as c:
        for i in range(4):
            ids, _, last = _generate(c, prompt=f"hi {i}", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
            assert len(ids) == 3 and last.finish_reason == "length"
    assert sum(d["handoffs"] for d in stats(stack)[1]) == before + 4


def test_seeded_sampling_stop_strings_and_logprobs_match_single_process(client, local_engine, default_model):
    """The sampler's random state and the detokenizer's stop handling survive the hand-off."""
    tok = default_model.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Write two sentences about the moon."}])
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True, logprobs=True)
    (ref,) = local_engine.generate([prompt], params)
    sp = pb.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True, logprobs=True)
    ids, text, last = _generate(client, prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sp)
    assert ids == ref.token_ids
    assert text == ref.text
    lps = [lp for msg in client.stream(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sp))
           for lp in msg.logprobs]
    assert lps == pytest.approx(ref.logprobs, abs=1e-4)

    stop = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]
    sp.stop.append(stop)
    ids, text, last = _generate(client, prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sp)
    assert last.finish_reason == "stop"
    assert text == ref.text[: ref.text.index(stop)]


def test_decode_pool_full_is_resource_exhausted(stack, default_model):
    """A decode worker without room for the prompt's KV refuses before pulling anything: backpressure."""
    small_cfg = dataclasses.replace(ENGINE, kv_cache_memory=4 << 20)  # about 85 tokens of float32 KV
    small = ray.remote(DecodeWorker).options(name="decode-small", namespace=stack.namespace, num_cpus=0,
                                             max_concurrency=32).remote(_spec(stack, "decode-small", small_cfg), 30.0)
    info = ray.get(small.info.remote())
    pre = stack.router.workers.candidates("prefill", set())[0]
    router = _router_over(stack, default_model, [(pre.name, "prefill", pre.address),
                                                 ("decode-small", "decode", info.address)])
    try:
        with Client(router.address) as s:
            with pytest.raises(grpc.RpcError) as e:
                _generate(s, prompt="word " * 150, sampling=pb.SamplingParams(max_tokens=4))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "KV blocks" in e.value.details()
            assert _generate(s, prompt="hi", sampling=pb.SamplingParams(max_tokens=3))[2].finish_reason
    finally:
        router.stop()
        ray.get(small.shutdown.remote())
        ray.kill(small)
    pre_stats, _ = wait_idle(stack)
    assert all(p["exports"] == 0 for p in pre_stats)
