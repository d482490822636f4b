"""Prefix caching across workers on the real stack: two prefill workers, one decode worker, a real
redis-server on a free port, the default model."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from baton.api.client import Client, generate_request
from baton.config import EngineConfig, PrefixRoutingConfig, ServeConfig
from baton.metrics import PREFIX_HITS, PREFIX_LOOKUPS, sample
from baton.serve import Stack
from baton.services.redis_server import RedisServer
from baton.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

ENGINE = EngineConfig(kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def stack(redis_server):
    # max_queue 1: one prefill in flight makes a worker overloaded, so saturation is easy to arrange.
    cfg = ServeConfig(engine=ENGINE, prefill=2, decode=1, port=0, redis_url=redis_server.url,
                      prefix_routing=PrefixRoutingConfig(max_queue=1), metrics_port=None, http_port=None)
    st = Stack(cfg).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address) as c:
        yield c


def _system(tag: str, words: int = 300) -> str:
    """A long shared prefix, different per test so that tests do not share cache entries."""
    return f"System {tag}: " + " ".join(f"{tag}{i}" for i in range(words)) + "\n"


def _gen(client: Client, prompt: str, **sampling) -> tuple[list[int], pb.Usage]:
    out = client.complete(generate_request(prompt, sampling={"max_tokens": 6, "temperature": 0.0, **sampling}),
                          timeout=120)
    return out.token_ids, out.usage


def _prefills(stack) -> list[int]:
    return [s["prefills"] for s in ray.get([a.stats.remote() for a in stack.prefill])]


def _served_by(stack, before: list[int]) -> int:
    after = _prefills(stack)
    changed = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
    assert len(changed) == 1 and after[changed[0]] == before[changed[0]] + 1, (before, after)
    return changed[0]


def _wait_published(stack, worker: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.get(stack.prefill[worker].stats.remote())["index_blocks"] == 0:
        assert time.monotonic() < deadline, "the worker never published its blocks"
        time.sleep(0.05)
    time.sleep(0.2)  # one more publisher round for the latest blocks


def test_output_is_identical_with_and_without_a_cache_hit(client):
    prompt = _system("same") + "Question: what is two plus two?"
    cold, u1 = _gen(client, prompt)
    warm, u2 = _gen(client, prompt)
    assert u1.cached_prompt_tokens == 0
    assert u2.cached_prompt_tokens >= u2.prompt_tokens - 16
    assert warm == cold
    seeded = {"temperature": 0.9, "seed": 11, "max_tokens": 8}  # the sampler state survives the hit too
    prompt2 = _system("seeded") + "Tell me a story."
    assert _gen(client, prompt2, **seeded)[0] == _gen(client, prompt2, **seeded)[0]


def test_shared_prefix_goes_to_the_worker_holding_it(stack, client):
    system = _system("affinity")
    before = _prefills(stack)
    _, usage = _gen(client, system + "First question?")
    holder = _served_by(stack, before)
    assert usage.cached_prompt_tokens == 0
    _wait_published(stack, holder)
    for q in ("Second question?", "Third one, a little longer than the others?", "Fourth?"):
        before = _prefills(stack)
        _, usage = _gen(client, system + q)
        assert _served_by(stack, before) == holder
        assert usage.cached_prompt_tokens >= 300  # the system prompt came from the cache
    assert ray.get(stack.prefill[holder].stats.remote())["cached_tokens"] >= 900


def test_saturated_holder_sends_shared_prefix_elsewhere(stack, client):
    system = _system("busy")
    before = _prefills(stack)
    _gen(client, system + "Warm the cache.")
    holder = _served_by(stack, before)
    other = 1 - holder
    _wait_published(stack, holder)
    # A long prompt on the same prefix keeps the holder busy for seconds (it still goes there: cheaper).
    long_tail = " ".join(f"tail{i}" for i in range(1200))
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(_gen, client, system + long_tail)
        deadline = time.monotonic() + 30
        while ray.get(stack.prefill[holder].stats.remote())["active_prefills"] == 0:
            assert time.monotonic() < deadline and not busy.done()
            time.sleep(0.05)
        before = _prefills(stack)
        _, usage = _gen(client, system + "Now, while it is busy?")
        assert _served_by(stack, before) == other
        assert usage.cached_prompt_tokens == 0  # the other worker computed it all
        busy.result(timeout=120)


def test_different_first_block_is_a_miss(stack, client):
    system = _system("miss")
    _gen(client, system + "Cache this.")
    time.sleep(0.3)
    model = stack.router.service.model.name
    misses, hits = sample(PREFIX_LOOKUPS, model=model, result="miss"), sample(PREFIX_HITS, model=model)
    # The same text after a different opening: every later block hashes differently too.
    _, usage = _gen(client, "Different opening words here. " + system + "Cache this.")
    assert usage.cached_prompt_tokens == 0
    assert sample(PREFIX_LOOKUPS, model=model, result="miss") == misses + 1
    assert sample(PREFIX_HITS, model=model) == hits


def test_redis_killed_and_restarted_under_load_loses_no_request(stack, client, redis_server):
    system = _system("outage", words=150)
    model = stack.router.service.model.name
    unavailable = sample(PREFIX_LOOKUPS, model=model, result="unavailable")
    stop = threading.Event()
    results: list[str] = []

    def user(k: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                _, usage = _gen(client, system + f"Client {k} asks question {i}.", max_tokens=4)
                results.append("ok" if usage is not None else "no usage")
            except grpc.RpcError as e:
                results.append(f"{e.code().name}: {e.details()}")
            i += 1

    threads = [threading.Thread(target=user, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(3)
    redis_server.kill()
    time.sleep(4)
    redis_server.start()  # same port, empty
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert results and all(r == "ok" for r in results), results
    assert sample(PREFIX_LOOKUPS, model=model, result="unavailable") > unavailable
    # The workers re-publish what they hold: the index rebuilds by itself.
    ids = stack.router.service.tokenizer.encode(system + "Client 0 asks question 0.")
    deadline = time.monotonic() + 10
    while not stack.router.service.prefix.lookup(ids):
        assert time.monotonic() < deadline, "the index did not rebuild after Redis came back"
        time.sleep(0.2)
    _, usage = _gen(client, system + "After the outage.")
    assert usage.cached_prompt_tokens > 0


def test_in_memory_index_as_a_ray_actor(stack):
    """The fallback when no Redis is available: the same index in a Ray actor, as the stack starts it."""
    spec = stack._start_index("memory")
    assert spec.url.startswith("actor:") and stack.index_actor is not None
    client = spec.connect()
    client.update("w1", {b"a" * 16: 1.0, b"b" * 16: 2.0}, [])
    assert client.lookup([b"a" * 16, b"b" * 16, b"c" * 16]) == {"w1": 2}
    client.drop_worker("w1", [b"a" * 16])
    assert client.lookup([b"a" * 16]) == {}
