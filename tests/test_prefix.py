"""Prefix caching across workers on the real stack: two prefill workers, one decode worker, a real
redis-server on a free port, the default model."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from baton.api.client import Client, Completion, generate_request
from baton.config import EngineConfig, PrefixRoutingConfig, ServeConfig
from baton.metrics import PREFIX_HITS, PREFIX_LOOKUPS, PREFIX_ROUTED, sample
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


def _until(done, what: str, timeout: float = 120.0) -> None:
    """Poll ``done()``; the deadline only turns a hang into a failure (generous: a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _wait_indexed(stack, prompt: str) -> None:
    """Until the router's own index lookup finds every full block of ``prompt`` on one worker: the state the
    next request on the same prefix is routed by (the workers publish their blocks in the background)."""
    router = stack.router.service
    ids = router.tokenizer.encode(prompt)
    bs = router.prefix.block_size
    want = (len(ids) - 1) // bs * bs  # the last prompt token is never counted as cached
    _until(lambda: max(router.prefix.lookup(ids).values(), default=0) == want,
           f"the index never held the {want} cached tokens of the prompt")


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
    _wait_indexed(stack, system + "First question?")
    for q in ("Second question?", "Third one, a little longer than the others?", "Fourth?"):
        before = _prefills(stack)
        _, usage = _gen(client, system + q)
        assert _served_by(stack, before) == holder
        assert usage.cached_prompt_tokens >= 300  # the system prompt came from the cache
    assert ray.get(stack.prefill[holder].stats.remote())["cached_tokens"] >= 900


def _question_while_busy(stack, client, tag: str, tail_words: int
                         ) -> tuple[int, list[int], list[int], Completion] | None:
    """Cache a prefix on one worker (the holder), start a long prompt on it there, and ask a question on the
    same prefix while that runs. Returns the holder, both workers' prefill counts before and after the
    question, and the question's answer; None when the long prompt was not seen still being prefilled once
    the router had routed the question (then the attempt shows nothing)."""
    system = _system(tag)
    before = _prefills(stack)
    _gen(client, system + "Warm the cache.")
    holder = _served_by(stack, before)
    _wait_indexed(stack, system + "Warm the cache.")
    model = stack.router.service.model.name
    # A long prompt on the same prefix keeps the holder busy (it still goes there: cheaper).
    long_prompt = system + " ".join(f"tail{i}" for i in range(tail_words))
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(client.complete, generate_request(long_prompt, sampling={"max_tokens": 2}), timeout=600)
        _until(lambda: ray.get(stack.prefill[holder].stats.remote())["active_prefills"] > 0 or busy.done(),
               "the long prompt never started on the holder")
        if busy.done():  # over before it was seen running
            busy.result()
            return None
        before = _prefills(stack)
        routed = sample(PREFIX_ROUTED, model=model)
        question = client.stream(generate_request(system + "Now, while it is busy?",
                                                  sampling={"max_tokens": 6, "temperature": 0.0}), timeout=600)
        _until(lambda: sample(PREFIX_ROUTED, model=model) > routed, "the question was never routed")
        # The holder has not answered the long prompt yet (it counts a prefill when it answers): it was in
        # flight, from the router's view too, when the question was routed.
        held = ray.get(stack.prefill[holder].stats.remote())["prefills"] == before[holder]
        answer = Completion()
        for msg in question:
            answer.add(msg)
        busy.result(timeout=600)
    return (holder, before, _prefills(stack), answer) if held else None


def test_saturated_holder_sends_shared_prefix_elsewhere(stack, client):
    """A question on a cached prefix goes to the other worker while the holder is busy prefilling a long
    prompt on the same prefix (max_queue 1: one prefill in flight overloads a worker).

    That the holder is still busy when the question is routed is checked, not assumed: right after the
    router counts the question's routing, the holder has not yet answered the long prompt. If it had (a fast
    machine), the attempt shows nothing and runs again, on a prefix of its own and with a longer prompt."""
    model = stack.router.service.model.name
    for attempt, tail_words in enumerate((400, 800, 1200)):
        load_routed = sample(PREFIX_ROUTED, model=model, reason="load")
        seen = _question_while_busy(stack, client, f"busy{attempt}", tail_words)
        if seen is not None:
            break
    else:
        pytest.fail("the long prompt finished before the question was routed in every attempt: nothing checked")
    holder, before, after, answer = seen
    other = 1 - holder
    # The holder answered the long prompt alone, the other worker the question (holder +2 had it gone there),
    # and the router says why: the worker holding the longest prefix was passed over for its load.
    assert (after[holder] - before[holder], after[other] - before[other]) == (1, 1), (before, after)
    assert sample(PREFIX_ROUTED, model=model, reason="load") == load_routed + 1
    assert len(answer.token_ids) == 6 and answer.usage.cached_prompt_tokens == 0  # the other computed it all


def test_different_first_block_is_a_miss(stack, client):
    system = _system("miss")
    _gen(client, system + "Cache this.")
    _wait_indexed(stack, system + "Cache this.")  # else the miss below would prove nothing
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
    try:
        # Phases by requests served, not by the clock: some with the index up, some while Redis is down (and
        # the router found it down), some after it came back.
        _until(lambda: len(results) >= 3, "no request finished before the outage")
        redis_server.kill()
        n = len(results)
        _until(lambda: len(results) >= n + 3
               and sample(PREFIX_LOOKUPS, model=model, result="unavailable") > unavailable,
               "requests stopped, or the router never found the index down")
        redis_server.start()  # same port, empty
        n = len(results)
        _until(lambda: len(results) >= n + 3, "requests stopped after Redis came back")
    finally:
        if redis_server.proc is None:
            redis_server.start()  # the module's later tests need it
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert results and all(r == "ok" for r in results), results
    # The workers re-publish what they hold: the index rebuilds by itself.
    ids = stack.router.service.tokenizer.encode(system + "Client 0 asks question 0.")
    _until(lambda: stack.router.service.prefix.lookup(ids), "the index did not rebuild after Redis came back")
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
