"""The prefix-cache index against a real redis-server (and in memory), the worker's publisher, and
the router's choice of prefill worker."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import msgpack
import pytest

from baton.api.prefix import hash_full_blocks
from baton.config import PrefixRoutingConfig
from baton.engine.block_pool import BlockPool
from baton.metrics import PREFIX_INDEX_ERRORS, PREFIX_LOOKUPS, PREFIX_ROUTED, sample
from baton.services.prefix_index import (
    IndexPublisher,
    IndexUnavailable,
    MemoryIndex,
    RedisIndex,
    leading_blocks,
)
from baton.services.redis_server import RedisServer
from baton.services.router.prefix import PrefixRouter


@pytest.fixture()
def redis_server():
    with RedisServer() as server:
        yield server


def _hashes(n: int, first: int = 0) -> list[bytes]:
    return hash_full_blocks(list(range(first, first + 4 * n)), 4)


def test_leading_blocks_counts_only_runs_from_the_first_block():
    assert leading_blocks([]) == {}
    assert leading_blocks([["a", "b"], ["a"], ["a", "b"], []]) == {"a": 3, "b": 1}
    assert leading_blocks([["b"], ["a", "b"], ["a", "b"]]) == {"b": 3}
    assert leading_blocks([[], ["a"]]) == {}  # holding later blocks without the first is no match


@pytest.fixture(params=["memory", "redis"])
def index(request):
    if request.param == "memory":
        yield MemoryIndex(ttl_s=60)
    else:
        with RedisServer() as server:
            yield RedisIndex(server.url, "test", ttl_s=60)


def test_update_lookup_and_removal(index):
    hs = _hashes(4)
    index.update("w1", {h: 1.0 for h in hs}, [])
    index.update("w2", {h: 2.0 for h in hs[:2]}, [])
    assert index.lookup(hs) == {"w1": 4, "w2": 2}
    assert index.lookup(hs[:1]) == {"w1": 1, "w2": 1}
    assert index.lookup(_hashes(4, first=1)) == {}  # the first block differs: nothing matches
    index.update("w1", {}, [hs[1]])  # evicted in the middle: only the run before it counts
    assert index.lookup(hs) == {"w1": 1, "w2": 2}
    index.drop_worker("w2", hs)
    assert index.lookup(hs) == {"w1": 1}


def test_redis_values_are_msgpack_with_last_access_and_keys_expire(redis_server):
    index = RedisIndex(redis_server.url, "ns", ttl_s=30)
    h = _hashes(1)[0]
    index.update("w1", {h: 1234.5}, [])
    assert index.holders(h) == {"w1": {"t": 1234.5}}
    key = index.key(h)
    assert key == f"ns:blk:{h.hex()}"
    assert msgpack.unpackb(index.client.hget(key, "w1")) == {"t": 1234.5}
    assert 0 < index.client.ttl(key) <= 30

    short = RedisIndex(redis_server.url, "short", ttl_s=1)
    short.update("dead-worker", {h: 1.0}, [])
    assert short.lookup([h]) == {"dead-worker": 1}
    time.sleep(2.2)
    assert short.lookup([h]) == {}  # a worker that stopped refreshing its entries disappears


def test_memory_index_entries_expire():
    index = MemoryIndex(ttl_s=0.2)
    hs = _hashes(2)
    index.update("w1", {h: 1.0 for h in hs}, [])
    assert index.lookup(hs) == {"w1": 2}
    time.sleep(0.3)
    assert index.lookup(hs) == {}


def _connections(listener: socket.socket) -> int:
    """Connections made to a listener that never answers (the kernel completes them; nobody accepted yet)."""
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def test_unreachable_redis_fails_fast_and_recovers(redis_server):
    index = RedisIndex(redis_server.url, "ns", ttl_s=30, retry_s=1)
    hs = _hashes(2)
    index.update("w1", {h: 1.0 for h in hs}, [])
    redis_server.kill()
    with pytest.raises(IndexUnavailable):  # connection refused
        index.lookup(hs)
    # A server that accepts connections and never answers (hung) now holds Redis's port.
    with socket.create_server((redis_server.host, redis_server.port)) as hung:
        hung.setblocking(False)
        with pytest.raises(IndexUnavailable, match="down"):  # within retry_s: skipped without touching the network
            index.lookup(hs)
        assert _connections(hung) == 0
        while True:  # skipped until retry_s has passed; then a call tries the network again
            t0 = time.monotonic()
            with pytest.raises(IndexUnavailable) as failed:
                index.lookup(hs)
            if "down" not in str(failed.value):
                break
            assert _connections(hung) == 0
            time.sleep(0.05)
        # Time is the point here: a hung Redis costs a lookup one socket timeout (0.25 s), not a hang. 10 s
        # leaves room for a loaded 2-core machine; without a timeout the call would never return. One
        # connection: the client did not retry on its own.
        assert time.monotonic() - t0 < 10
        assert _connections(hung) == 1
    redis_server.start()
    deadline = time.monotonic() + 30  # skipped until retry_s has passed again
    while True:
        try:
            found = index.lookup(hs)
            break
        except IndexUnavailable as e:
            assert "down" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.05)
    assert found == {}  # a fresh server: empty, but answering
    index.update("w1", {hs[0]: 1.0}, [])
    assert index.lookup(hs) == {"w1": 1}


def _fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    hashes = hash_full_blocks(tokens, pool.block_size)
    ids = pool.allocate(len(hashes))
    for b, h in zip(ids, hashes, strict=True):
        pool.cache_block(b, h)
    return ids


def test_publisher_follows_the_pool_and_republishes_after_redis_restarts(redis_server):
    index = RedisIndex(redis_server.url, "ns", ttl_s=30, retry_s=0.2)
    pool = BlockPool(num_blocks=4, block_size=4)
    pub = IndexPublisher(index, "w1", snapshot=pool.cached_hashes, ttl_s=30, model="publisher-test")
    pool.on_cache, pool.on_evict = pub.cached, pub.evicted
    a = list(range(12))
    ids = _fill(pool, a)
    pub.flush()
    assert index.lookup(hash_full_blocks(a, 4)) == {"w1": 3}
    pool.free(ids)
    pool.allocate(3)  # the never-used block, then the tail of the prompt (freed last) are evicted
    pub.flush()
    assert index.lookup(hash_full_blocks(a, 4)) == {"w1": 1}

    redis_server.kill()
    pool.take(pool.match_prefix(hash_full_blocks(a, 4)))  # a prefix hit: its last access changes
    pub.flush()
    assert not pub.available and pub.failures == 1
    assert sample(PREFIX_INDEX_ERRORS, model="publisher-test", worker="w1") == 1
    redis_server.start()  # empty: the server kept nothing
    time.sleep(0.3)
    pub.flush()
    assert pub.available
    assert index.lookup(hash_full_blocks(a, 4)) == {"w1": 1}  # rebuilt from the worker's own view

    pub.stop()  # a worker that shuts down removes its entries
    assert index.lookup(hash_full_blocks(a, 4)) == {}


def test_publisher_overflow_rebuilds_from_a_snapshot():
    index = MemoryIndex()
    pool = BlockPool(num_blocks=8, block_size=4)
    pub = IndexPublisher(index, "w1", snapshot=pool.cached_hashes, max_events=2)
    pool.on_cache, pool.on_evict = pub.cached, pub.evicted
    tokens = list(range(20))
    _fill(pool, tokens)  # five events, three of them dropped
    pub.flush()
    assert pub.num_held == 5
    assert index.lookup(hash_full_blocks(tokens, 4)) == {"w1": 5}


@dataclass
class _W:  # the fields of the router's Worker record that routing reads
    name: str
    in_flight: int = 0
    pending_tokens: int = 0


def test_routing_prefers_the_holder_until_it_is_overloaded():
    model = "route-test"
    router = PrefixRouter(None, 16, model, PrefixRoutingConfig(load_weight=1.0, max_queue=2))
    a, b = _W("a"), _W("b")
    hits = {"a": 992}
    assert [w.name for w in router.order([b, a], 1020, hits)] == ["a", "b"]
    a.in_flight, a.pending_tokens = 1, 200  # busy but cheaper than computing 992 tokens again
    assert router.order([a, b], 1020, hits)[0] is a
    a.in_flight = 2  # overloaded: skipped whatever it holds
    assert router.order([a, b], 1020, hits)[0] is b
    b.in_flight = 2  # everyone overloaded: back to the cost
    assert router.order([a, b], 1020, hits)[0] is a
    assert sample(PREFIX_ROUTED, model=model, target="a", reason="cache") == 3
    assert sample(PREFIX_ROUTED, model=model, target="b", reason="load") == 1

    a.in_flight = b.in_flight = 0
    a.pending_tokens = 5000  # a long queue outweighs the hit
    assert router.order([a, b], 1020, hits)[0] is b
    by_hit = PrefixRouter(None, 16, model, PrefixRoutingConfig(load_weight=0.0, max_queue=2))
    assert by_hit.order([a, b], 1020, hits)[0] is a  # load_weight 0: the longest hit wins
    assert router.order([a, b], 1020, {})[0] is b  # no hits: least loaded
    with pytest.raises(ValueError):
        PrefixRoutingConfig(max_queue=0)


def test_router_lookup_counts_hits_misses_and_outages(redis_server):
    model = "lookup-test"
    index = RedisIndex(redis_server.url, "ns", ttl_s=30, retry_s=5)
    router = PrefixRouter(index, 4, model)
    prompt = list(range(40))
    index.update("w1", {h: 1.0 for h in hash_full_blocks(prompt, 4)}, [])
    assert router.lookup(prompt) == {"w1": 36}  # the last prompt token is never counted as cached
    other_first_block = [99, 98, 97, 96] + prompt[4:]
    assert router.lookup(other_first_block) == {}
    assert sample(PREFIX_LOOKUPS, model=model, result="hit") == 1
    assert sample(PREFIX_LOOKUPS, model=model, result="miss") == 1
    redis_server.kill()
    assert router.lookup(prompt) == {}  # serving goes on without the index
    assert sample(PREFIX_LOOKUPS, model=model, result="unavailable") == 1


def test_index_choice_flag_then_environment_then_private_server_then_memory():
    from baton.config import ConfigError
    from baton.serve import choose_index

    assert choose_index("redis://a:1/0", "redis://b:2/0", True) == "redis://a:1/0"
    assert choose_index(None, "rediss://b:2/0", True) == "rediss://b:2/0"
    assert choose_index(None, None, True) == "private"
    assert choose_index(None, None, False) == "memory"
    assert choose_index("memory", None, True) == "memory"
    with pytest.raises(ConfigError, match="BATON_REDIS_URL"):
        choose_index(None, "localhost:6379", True)
