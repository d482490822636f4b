"""Migration on a real stack (TLS everywhere, mutual TLS inside, a bearer token on the public API): a decode worker
killed mid-stream, and the only prefill worker killed mid-prefill. The client sees one stream with every token once,
identical to an undisturbed run (greedy and seeded sampling); afterwards no worker holds a block or an export and
the object store is empty."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from baton import metrics
from baton.api.client import Client
from baton.v1 import generation_pb2 as pb
from tests.certs import make_certs
from tests.stack_state import object_store, wait_idle

pytestmark = pytest.mark.slow
TOKEN = "migration-token-0123456789"
DEADLINE = 180.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def moving(stack, certs, tmp_path_factory):
    """One prefill and two decode workers in the session's Ray, behind TLS and a token."""
    from baton.config import ServeConfig
    from baton.security import TLSConfig
    from baton.serve import Stack
    from tests.stack_config import STACK_ENGINE

    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    st = Stack(ServeConfig(engine=STACK_ENGINE, port=0, prefill=1, decode=2, redis_url="memory", metrics_port=None,
                           http_port=None, tls=TLSConfig(certs["cert"], certs["key"], certs["ca"]),
                           auth_tokens_file=str(tokens)))
    st.start()
    yield st
    st.stop()


@pytest.fixture
def client(moving, certs):
    with Client(moving.address, tls_ca=certs["ca"], token=TOKEN) as c:
        yield c


def _request(prompt: str, max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                        **sampling))


def _whole(client: Client, req: pb.GenerateRequest) -> tuple[list[int], str, str]:
    ids, text, reason = [], "", ""
    for msg in client.stream(req, timeout=DEADLINE):
        ids += msg.token_ids
        text += msg.text
        reason = msg.finish_reason or reason
    return ids, text, reason


def _holder(stack, kind: str):
    """The worker of ``kind`` that holds a request now (the only request in flight)."""
    for h in list(stack.prefill if kind == "prefill" else stack.decode):
        try:
            s = ray.get(h.stats.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a worker just killed or still starting
            continue
        if s["requests"] or s.get("active_prefills") or s.get("active_streams"):
            return h
    return None


def _moves() -> float:
    return sum(metrics.sample(metrics.MIGRATIONS, cause=c) for c in metrics.MIGRATION_CAUSES)


def _wait_for_pool(stack, kind: str, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stack.router.workers.count(kind) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"the {kind} pool did not get back to {count} workers")


def _quiet(stack) -> None:
    """No block, no export, no request anywhere, and nothing left in the object store."""
    pre, dec = wait_idle(stack, timeout=60)
    assert all(p["exports"] == 0 and p["requests"] == 0 for p in pre), pre
    assert all(d["free_blocks"] == d["num_blocks"] and d["requests"] == 0 for d in dec), dec
    objects, summary = object_store(timeout=30)
    assert objects == 0, summary


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 1234},
                                      {"temperature": 0, "stop": ["twelve"]}], ids=["greedy", "seeded", "stop"])
def test_a_decode_worker_killed_mid_stream_loses_nothing(moving, client, sampling):
    prompt = "Count from one to twenty in words: one, two,"
    req = _request(prompt, 48, **sampling)
    reference = _whole(client, req)
    assert len(reference[0]) >= 8
    before = _moves()
    ids, text, reason = [], "", ""
    stream = client.stream(req, timeout=DEADLINE)
    killed = None
    for msg in stream:
        ids += msg.token_ids
        text += msg.text
        reason = msg.finish_reason or reason
        if killed is None and len(ids) >= 5:
            killed = _holder(moving, "decode")
            assert killed is not None
            ray.kill(killed, no_restart=True)
    assert (ids, text, reason) == reference  # one stream: nothing missing, nothing repeated, nothing different
    assert _moves() >= before + 1
    _wait_for_pool(moving, "decode", 2)
    _quiet(moving)


def test_the_only_prefill_worker_killed_mid_prefill(moving, client):
    """The prompt is long enough that its prefill is still running when its worker is killed; the request waits
    for the replacement and completes as it would have."""
    prompt = " ".join(f"Item {i}: the {i}th line of a long list." for i in range(150))
    req = _request(prompt + "\nThe last item was", 12, temperature=0)
    reference = _whole(client, req)
    before = _moves()
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(out=_whole(client, _request(prompt + "\nThe last item is", 12,
                                                                                temperature=0))))
    t.start()
    deadline = time.monotonic() + 60
    victim = None
    while victim is None and time.monotonic() < deadline:
        h = moving.prefill[0] if moving.prefill else None
        if h is not None and ray.get(h.stats.remote(), timeout=10).get("active_prefills"):
            victim = h
        time.sleep(0.02)
    assert victim is not None, "the prefill never started"
    ray.kill(victim, no_restart=True)
    t.join(timeout=DEADLINE)
    assert not t.is_alive()
    ids, _, reason = got["out"]
    assert len(ids) == 12 and reason == "length"
    assert _moves() >= before + 1
    # The same prompt as the reference, now on the replacement: identical.
    assert _whole(client, req) == reference
    _quiet(moving)
