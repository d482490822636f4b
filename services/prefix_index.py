"""The prefix-cache index: which prefill workers hold which KV blocks, so the router can send a
prompt to the worker that already computed its prefix.

A block is named by its chained hash (``baton.engine.block_pool.hash_block``): equal hashes mean
equal tokens from the start of the prompt, so holding block *i* of a prompt implies the worker
computed blocks 0..i with it. The index maps block hash -> {worker: last access}.

Redis layout (one namespace per model and block size)::

    {namespace}:blk:{hash hex}   a Redis hash; field = worker name, value = msgpack {"t": unix seconds}

Every write refreshes the key's TTL, and each worker re-publishes all it holds every third of the
TTL, so the entries of a worker that died without a word expire on their own. A worker that evicts
a block deletes its field; one that shuts down deletes all of its fields.

Failures: every call to an unreachable index raises ``IndexUnavailable`` at once (after the first
failure the index is skipped for ``retry_s``), so serving never waits on it; the worker's publisher
re-publishes everything once the index answers again, which rebuilds an index that lost its data.

``MemoryIndex`` is the same index in one process's memory; ``IndexActor`` hosts it as a Ray actor for
a stack without Redis. ``IndexSpec`` says which one a process should connect to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgpack

from baton import metrics

log = logging.getLogger(__name__)

BlockHash = bytes


class IndexUnavailable(Exception):
    """The index cannot be reached now; callers go on without it."""


class PrefixIndex(Protocol):
    def update(self, worker: str, added: Mapping[BlockHash, float], removed: Iterable[BlockHash]) -> None:
        """Record that ``worker`` holds ``added`` (hash -> last access) and no longer holds ``removed``."""

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each worker holding the first of ``hashes``: how many leading blocks it holds."""

    def drop_worker(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        """Remove ``worker`` from the entries of ``hashes`` (all it published)."""


def leading_blocks(holders: Sequence[Iterable[str]]) -> dict[str, int]:
    """holders[i] = the workers holding block i -> worker: length of the run of blocks it holds from 0."""
    if not holders:
        return {}
    counts = dict.fromkeys(holders[0], 1)
    alive = set(counts)
    for i, hs in enumerate(holders[1:], start=2):
        alive &= set(hs)
        if not alive:
            break
        for w in alive:
            counts[w] = i
    return counts


# -- in memory -------------------------------------------------------------------------------------------


class MemoryIndex:
    """The index in this process's memory, with the same TTL rule as Redis (per block, refreshed by
    every write to it)."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[BlockHash, dict[str, float]] = {}
        self._expires: dict[BlockHash, float] = {}
        self._lock = threading.Lock()

    def update(self, worker: str, added: Mapping[BlockHash, float], removed: Iterable[BlockHash]) -> None:
        now = time.monotonic()
        with self._lock:
            for h, t in added.items():
                self._entries.setdefault(h, {})[worker] = t
                self._expires[h] = now + self.ttl_s
            for h in removed:
                self._remove(h, worker)

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            holders = []
            for h in hashes:
                if self._expires.get(h, 0.0) < now:
                    self._entries.pop(h, None)
                    self._expires.pop(h, None)
                    break
                holders.append(list(self._entries[h]))
        return leading_blocks(holders)

    def drop_worker(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                self._remove(h, worker)

    def entries(self) -> dict[BlockHash, dict[str, float]]:
        with self._lock:
            return {h: dict(ws) for h, ws in self._entries.items()}

    def _remove(self, h: BlockHash, worker: str) -> None:
        ws = self._entries.get(h)
        if ws is not None:
            ws.pop(worker, None)
            if not ws:
                del self._entries[h]
                self._expires.pop(h, None)


class IndexActor(MemoryIndex):
    """A MemoryIndex as a Ray actor (wrapped with ray.remote by the launcher)."""


class ActorIndex:
    """Client of an IndexActor, with the PrefixIndex interface."""

    def __init__(self, name: str, namespace: str | None, timeout_s: float = 1.0) -> None:
        import ray

        self._ray = ray
        self._actor = ray.get_actor(name, namespace=namespace)
        self.timeout_s = timeout_s

    def _call(self, method: str, *args):
        try:
            return self._ray.get(getattr(self._actor, method).remote(*args), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead or slow actor is an unavailable index
            raise IndexUnavailable(f"in-memory prefix index: {e}") from e

    def update(self, worker: str, added: Mapping[BlockHash, float], removed: Iterable[BlockHash]) -> None:
        self._call("update", worker, dict(added), list(removed))

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._call("lookup", list(hashes))

    def drop_worker(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        self._call("drop_worker", worker, list(hashes))


# -- Redis -----------------------------------------------------------------------------------------------


class RedisIndex:
    def __init__(self, url: str, namespace: str, ttl_s: float = 60.0, timeout_s: float = 0.25,
                 retry_s: float = 1.0) -> None:
        import redis

        self._errors = redis.exceptions.RedisError
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._down_until = 0.0

    def key(self, h: BlockHash) -> str:
        return f"{self.namespace}:blk:{h.hex()}"

    def _run(self, fill: Callable) -> list:
        if time.monotonic() < self._down_until:
            raise IndexUnavailable(f"Redis at {self.url} is down; next try in "
                                   f"{self._down_until - time.monotonic():.1f} s")
        pipe = self.client.pipeline(transaction=False)
        fill(pipe)
        try:
            return pipe.execute()
        except self._errors as e:
            self._down_until = time.monotonic() + self.retry_s
            raise IndexUnavailable(f"Redis at {self.url}: {e}") from e

    def update(self, worker: str, added: Mapping[BlockHash, float], removed: Iterable[BlockHash]) -> None:
        ttl = max(1, round(self.ttl_s))

        def fill(pipe) -> None:
            for h, t in added.items():
                k = self.key(h)
                pipe.hset(k, worker, msgpack.packb({"t": t}))
                pipe.expire(k, ttl)
            for h in removed:
                pipe.hdel(self.key(h), worker)

        self._run(fill)

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not hashes:
            return {}
        res = self._run(lambda pipe: [pipe.hkeys(self.key(h)) for h in hashes])
        return leading_blocks([[w.decode() for w in ws] for ws in res])

    def drop_worker(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        self.update(worker, {}, hashes)

    def holders(self, h: BlockHash) -> dict[str, dict]:
        """worker -> its decoded value, for one block (inspection and tests)."""
        raw = self._run(lambda pipe: pipe.hgetall(self.key(h)))[0]
        return {w.decode(): msgpack.unpackb(v) for w, v in raw.items()}


# -- which index ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexSpec:
    """How a process reaches the stack's index: ``url`` is a redis:// or rediss:// URL, or
    ``actor:NAME`` for an IndexActor in ``ray_namespace``."""

    url: str
    namespace: str
    ttl_s: float = 60.0
    ray_namespace: str | None = None

    def connect(self) -> PrefixIndex:
        if self.url.startswith("actor:"):
            return ActorIndex(self.url.removeprefix("actor:"), self.ray_namespace)
        return RedisIndex(self.url, self.namespace, self.ttl_s)


# -- the worker side -----------------------------------------------------------------------------------


class IndexPublisher:
    """Keeps the index in step with one worker's block pool.

    The pool's hooks (``cached`` and ``evicted``, called on the engine thread) only append to a queue;
    a thread of its own sends the changes every ``period_s``, re-publishes everything the worker
    holds every ``ttl_s / 3`` (the TTL's heartbeat) and after the index was unavailable, and removes
    the worker's entries on ``stop``. ``snapshot`` returns the hashes the pool holds now (the caller
    runs it on the engine thread); it rebuilds the local view when the queue overflowed.
    """

    def __init__(self, index: PrefixIndex, worker: str, snapshot: Callable[[], list[BlockHash]],
                 ttl_s: float = 60.0, period_s: float = 0.05, max_events: int = 200_000, model: str = "") -> None:
        self.index = index
        self.worker = worker
        self.snapshot = snapshot
        self.refresh_s = max(0.5, ttl_s / 3)
        self.period_s = period_s
        self.max_events = max_events
        self._events: deque[tuple[BlockHash, float | None]] = deque()
        self._held: dict[BlockHash, float] = {}
        self._unsent_removals: set[BlockHash] = set()
        self._overflow = False
        self._resync = True  # publish everything on the first round
        self._next_refresh = 0.0
        self.failures = 0
        self._errors = metrics.PREFIX_INDEX_ERRORS.labels(model, worker)
        self.available = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="prefix-index")

    # engine-thread hooks
    def cached(self, h: BlockHash) -> None:
        if len(self._events) < self.max_events:
            self._events.append((h, time.time()))
        else:
            self._overflow = True

    def evicted(self, h: BlockHash) -> None:
        if len(self._events) < self.max_events:
            self._events.append((h, None))
        else:
            self._overflow = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._apply_events()
        try:
            self.index.drop_worker(self.worker, list(self._held) + list(self._unsent_removals))
        except IndexUnavailable as e:
            log.warning("could not remove %s from the prefix index (its entries expire by TTL): %s", self.worker, e)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the publisher must outlive any one bad round
                log.exception("prefix index publisher round failed")

    def _apply_events(self) -> dict[BlockHash, float]:
        """Queued pool events -> the local view; returns what was added (hash -> last access)."""
        added: dict[BlockHash, float] = {}
        while self._events:
            h, t = self._events.popleft()
            if t is None:
                if self._held.pop(h, None) is not None:
                    self._unsent_removals.add(h)
                added.pop(h, None)
            else:
                self._held[h] = t
                added[h] = t
                self._unsent_removals.discard(h)
        return added

    def flush(self) -> None:
        """One round: apply queued pool events, then send what changed (or everything, when due)."""
        if self._overflow:
            self._overflow = False
            now = time.time()
            self._held = {h: self._held.get(h, now) for h in self.snapshot()}
            self._resync = True
        added = self._apply_events()
        now = time.monotonic()
        full = self._resync or now >= self._next_refresh
        if full:
            added = dict(self._held)
        if not added and not self._unsent_removals:
            if full:
                self._resync, self._next_refresh = False, now + self.refresh_s
            return
        try:
            self.index.update(self.worker, added, list(self._unsent_removals))
        except IndexUnavailable as e:
            if self.available:
                log.warning("prefix index unavailable, %s keeps serving and re-publishes later: %s", self.worker, e)
            self.available = False
            self.failures += 1
            self._errors.inc()
            self._resync = True
            return
        if not self.available:
            log.info("prefix index is back; %s re-published %d blocks", self.worker, len(added))
        self.available = True
        self._unsent_removals.clear()
        if full:
            self._resync = False
            self._next_refresh = now + self.refresh_s


__all__ = ["ActorIndex", "IndexActor", "IndexPublisher", "IndexSpec", "IndexUnavailable", "MemoryIndex",
           "PrefixIndex", "RedisIndex", "leading_blocks"]
