"""Faults injected into a running stack under load from concurrent clients: workers killed, a KV hand-off
that fails, a client that reads slowly. Nothing hangs, nothing leaks; requests on a killed or cut-off worker
move to another and complete."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest
import ray

from baton.api import SamplingParams
from baton.api.client import Client, generate_request
from baton.api.proto import sampling_to_proto
from baton.v1 import worker_pb2 as wpb
from baton.v1 import worker_pb2_grpc as wgrpc
from tests.stack_state import idle, stats

pytestmark = pytest.mark.slow
DEADLINE = 60.0


@pytest.fixture(scope="module")
def faulty(stack):
    """Two prefill and two decode workers in the session's Ray; the autoscaler refills what dies."""
    from baton.config import ServeConfig
    from baton.serve import Stack
    from tests.stack_config import STACK_ENGINE

    st = Stack(ServeConfig(engine=STACK_ENGINE, port=0, prefill=2, decode=2, redis_url="memory",
                           metrics_port=None, http_port=None)).start()
    yield st
    st.stop()


def _one(client: Client, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    t0 = time.monotonic()
    n = 0
    try:
        for msg in client.stream(generate_request(prompt, sampling={
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}), timeout=DEADLINE):
            n += len(msg.token_ids)
        return "OK", n, time.monotonic() - t0
    except grpc.RpcError as e:
        return e.code().name, n, time.monotonic() - t0


@contextlib.contextmanager
def _under_load(client: Client, clients: int, max_tokens: int):
    """Closed-loop clients for the duration of the block; yields the outcomes as they come. On exit the
    clients stop after their current request, and none may still be waiting (a hang)."""
    outcomes: list[tuple[str, int, float]] = []
    stop = threading.Event()

    def user(k: int) -> None:
        i = 0
        while not stop.is_set():
            outcomes.append(_one(client, f"Client {k} request {i}: count upwards.", max_tokens))
            i += 1

    threads = [threading.Thread(target=user, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=DEADLINE + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"


def test_killing_workers_under_load(faulty):
    with Client(faulty.address) as client:
        with _under_load(client, clients=4, max_tokens=24) as outcomes:
            time.sleep(4)
            ray.kill(faulty.prefill[0], no_restart=True)
            time.sleep(6)
            ray.kill(faulty.decode[0], no_restart=True)
            time.sleep(8)
        # Every request lives through the kills (those on a killed worker move to the other one).
        assert {s for s, _, _ in outcomes} == {"OK"}, outcomes
        assert all(n == 24 for _, n, _ in outcomes)
        assert all(t < DEADLINE for _, _, t in outcomes)
        # The autoscaler notices the dead workers and starts replacements.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            added = {e[1] for e in faulty.autoscaler.events if e[2] == "added"}
            if added == {"prefill", "decode"}:
                break
            time.sleep(0.5)
        assert {e[1] for e in faulty.autoscaler.events if e[2] == "dropped"} == {"prefill", "decode"}
        assert added == {"prefill", "decode"}, faulty.autoscaler.events
        later = [_one(client, f"After the faults {i}.", 8) for i in range(4)]
        assert [s for s, _, _ in later] == ["OK"] * 4


def test_failed_handoff_frees_the_reserved_blocks(stack):
    dec = stack.decode[0]
    info = ray.get(dec.info.remote())
    before = ray.get(dec.stats.remote())
    with grpc.insecure_channel(info.address) as ch:
        call = wgrpc.DecodeWorkerStub(ch).Decode(wpb.DecodeRequest(
            request_id="no-such-export", prompt_token_ids=list(range(100, 160)), first_token=5,
            sampling=sampling_to_proto(SamplingParams()), prefill_worker="prefill-0"), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "hand-off" in err.value.details()
    after = ray.get(dec.stats.remote())
    assert after["free_blocks"] == before["free_blocks"] == after["num_blocks"]


def test_slow_reader_does_not_stall_others(stack):
    """A client opens a 200-token stream and then reads nothing. Meanwhile three 16-token requests complete,
    every token, while that stream is still decoding: they ran beside it, not queued behind it (their ~50
    decode steps are a quarter of its 200). It still gets everything, late, and nothing stays held."""
    with Client(stack.address) as client:
        slow = client.stream(generate_request("Tell a long story.", sampling={"max_tokens": 200, "ignore_eos": True}),
                             timeout=DEADLINE)
        it = iter(slow)
        next(it)  # the stream is open; this client now reads nothing for a while
        others = [_one(client, f"Meanwhile {i}.", 16) for i in range(3)]
        assert all(s == "OK" and n == 16 for s, n, _ in others), others
        _, dec = stats(stack)
        assert sum(d["requests"] for d in dec) == 1, dec  # the slow stream, alone
        rest = sum(len(m.token_ids) for m in it)  # it still gets everything, late
        assert rest == 199
    assert idle(stack), stats(stack)


def test_router_connections_cut_under_load(stack, default_model):
    """The network between the router and each worker fails (every connection dropped at once) while
    clients stream: the workers live, so every request goes on over a new connection (a stream cut while
    decoding moves, here back to the same worker once its health checks find it serving) with all its
    tokens; none hangs, the workers free the cut requests' blocks."""
    from baton.services.router.router import Router
    from tests.tcp_proxy import TcpProxy

    proxies = {}
    r = Router(default_model.tokenizer, stack.router.service.model, port=0)
    for w in stack.router.workers.workers.values():
        proxies[w.kind] = TcpProxy(w.address)
        r.workers.add(w.name, w.kind, proxies[w.kind].address)
    r.update_health()
    r.start()
    try:
        with Client(r.address) as client:
            # A stream known to be decoding when the cut comes (one not yet decoding is retried instead).
            decoding, held = threading.Event(), {}

            def long_stream() -> None:
                n = 0
                try:
                    req = generate_request("Write a long story.", sampling={"max_tokens": 160, "ignore_eos": True})
                    for msg in client.stream(req, timeout=DEADLINE):
                        n += len(msg.token_ids)
                        if n >= 5:
                            decoding.set()
                    held["status"] = "OK"
                    held["tokens"] = n
                except grpc.RpcError as e:
                    held["status"] = e.code().name
                decoding.set()

            t = threading.Thread(target=long_stream)
            with _under_load(client, clients=3, max_tokens=32) as outcomes:
                t.start()
                assert decoding.wait(DEADLINE) and "status" not in held
                cut_decode = proxies["decode"].cut()
                t.join(DEADLINE)
                cut_prefill = proxies["prefill"].cut()
                time.sleep(3)
            assert cut_decode and cut_prefill
            assert {s for s, _, _ in outcomes} == {"OK"}, outcomes
            assert held == {"status": "OK", "tokens": 160}  # the stream cut while decoding went on
            assert all(n == 32 for s, n, _ in outcomes)
            assert [_one(client, f"After the cut {i}.", 8)[0] for i in range(3)] == ["OK"] * 3
    finally:
        r.stop()
        for p in proxies.values():
            p.close()
    deadline = time.monotonic() + 30
    while True:
        stats = ray.get([a.stats.remote() for a in stack.prefill + stack.decode])
        if all(s["free_blocks"] == s["num_blocks"] for s in stats) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(s["free_blocks"] == s["num_blocks"] for s in stats), stats
