"""The workers the router knows: discovery (the registry, polled), health checks, and the requests in
flight on each worker. How a worker is reached and checked is injected, so the router's logic runs in
unit tests against fake workers (tests/test_router_parts.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton import security
from baton.security import TLSConfig
from baton.services.info import WorkerInfo
from baton.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


@dataclass
class Worker:
    name: str
    kind: str  # "prefill" | "decode"
    address: str
    channel: Any = field(repr=False)  # closed when the worker is forgotten and idle
    stub: Any = field(repr=False)  # PrefillWorkerStub / DecodeWorkerStub, or a fake with the same methods
    in_flight: int = 0
    pending_tokens: int = 0  # uncached prompt tokens of the prefills in flight (an estimate of its queue)
    healthy: bool = True
    failed_checks: int = 0  # health checks in a row that got no answer at all (a draining worker answers)
    removed: bool = False
    dropped: bool = False  # removed because it stopped answering: its calls in flight were cancelled
    calls: dict = field(default_factory=dict, repr=False)  # cancel() of each call in flight to it -> last heard


Connect = Callable[[str, str], tuple[Any, Any]]  # (kind, address) -> (channel, stub)
Check = Callable[[Worker], bool]  # True: serving, False: answered but not serving; raises: no answer


def grpc_connect(tls: TLSConfig | None) -> Connect:
    """Channels to real workers: TLS when configured (the router verifies them and shows its certificate)."""
    def connect(kind: str, address: str):
        channel = security.channel(address, tls, options=[("grpc.max_receive_message_length", 64 << 20)])
        stub = wgrpc.PrefillWorkerStub(channel) if kind == "prefill" else wgrpc.DecodeWorkerStub(channel)
        return channel, stub
    return connect


def grpc_check(worker: Worker) -> bool:
    r = health_pb2_grpc.HealthStub(worker.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    return r.status == health_pb2.HealthCheckResponse.SERVING  # NOT_SERVING: draining


class WorkerSet:
    """The workers the router knows, with the requests it has in flight on each."""

    def __init__(self, connect: Connect) -> None:
        self._lock = threading.Lock()
        self.workers: dict[str, Worker] = {}
        self.seen: set[str] = set()  # the kinds of worker this set has ever had
        self.stalled: set = set()  # calls cancel_silent cancelled (their cancel), until unwatched
        self._connect = connect

    def add(self, name: str, kind: str, address: str) -> None:
        channel, stub = self._connect(kind, address)
        with self._lock:
            self.workers[name] = Worker(name, kind, address, channel, stub)
            self.seen.add(kind)

    def remove(self, name: str) -> None:
        """Forget a worker. Its channel closes once the requests in flight on it end (a worker that
        drains before it leaves finishes them)."""
        with self._lock:
            w = self.workers.pop(name, None)
            if w is None:
                return
            w.removed = True
            close = w.in_flight == 0
        if close:
            w.channel.close()

    def drop(self, name: str) -> None:
        """Forget a worker that stopped answering and cancel the calls in flight to it, so that the requests
        on it move to other workers at once instead of waiting on a silent stream."""
        with self._lock:
            w = self.workers.get(name)
            calls = list(w.calls) if w is not None else []
            if w is not None:
                w.dropped = True
        self.remove(name)
        for cancel in calls:
            cancel()

    def watch(self, w: Worker, cancel: Callable[[], object]) -> None:
        """Register a call in flight to ``w`` (its ``cancel``), waited on from now; ``waiting`` says when the caller
        waits on it and when not, ``unwatch`` when it ends."""
        with self._lock:
            w.calls[cancel] = time.monotonic()
            dropped = w.dropped
        if dropped:
            cancel()

    def waiting(self, w: Worker, cancel: Callable[[], object], on: bool = True) -> None:
        """The caller now waits on ``w`` for the call's next message (``on``), or has it and is busy elsewhere (a
        client that reads slowly is not the worker's silence)."""
        w.calls[cancel] = time.monotonic() if on else None  # one store of a key already there

    def unwatch(self, w: Worker, cancel: Callable[[], object]) -> None:
        with self._lock:
            w.calls.pop(cancel, None)
            self.stalled.discard(cancel)

    def cancel_silent(self, after_s: float) -> int:
        """Cancel every watched call whose worker has been waited on for ``after_s`` seconds without a word (it
        lives but its stream stopped: a stuck engine); the request moves. Returns how many."""
        now = time.monotonic()
        with self._lock:
            silent = [c for w in self.workers.values() for c, t in w.calls.items()
                      if t is not None and now - t > after_s and c not in self.stalled]
            self.stalled.update(silent)
        for cancel in silent:
            cancel()
        return len(silent)

    def candidates(self, kind: str, exclude: set[str]) -> list[Worker]:
        """Healthy workers of a kind, least loaded first."""
        with self._lock:
            ws = [w for w in self.workers.values() if w.kind == kind and w.healthy and w.name not in exclude]
        return sorted(ws, key=lambda w: w.in_flight)

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(1 for w in self.workers.values() if w.kind == kind and w.healthy)

    def prefill_queues(self) -> list[int]:
        return [w.pending_tokens for w in self.candidates("prefill", set())]

    def acquire(self, w: Worker, tokens: int = 0) -> None:
        with self._lock:
            w.in_flight += 1
            w.pending_tokens += tokens

    def release(self, w: Worker, tokens: int = 0) -> None:
        with self._lock:
            w.in_flight -= 1
            w.pending_tokens -= tokens
            close = w.removed and w.in_flight == 0
        if close:
            w.channel.close()


class Membership:
    """Discovery and health: ``refresh`` adds registered workers, forgets unregistered ones and checks
    each; a worker whose checks go unanswered ``drop_after`` times in a row is removed from discovery by
    ``forget`` (a crashed worker cannot unregister), then dropped: once the router no longer holds it,
    discovery no longer lists it either (unless ``forget`` failed, which is logged)."""

    def __init__(self, workers: WorkerSet, discover: Callable[[], list[WorkerInfo]] | None = None,
                 forget: Callable[[str], Any] | None = None, check: Check = grpc_check, drop_after: int = 3) -> None:
        self.workers = workers
        self.discover = discover
        self.forget = forget
        self.check = check
        self.drop_after = drop_after

    def refresh(self) -> None:
        """One round of discovery and health checks."""
        if self.discover is not None:
            try:
                infos = {i.name: i for i in self.discover()}
            except Exception as e:  # noqa: BLE001 - keep the last known set
                log.warning("worker discovery failed: %s", e)
            else:
                for name, info in infos.items():
                    known = self.workers.workers.get(name)
                    if known is None or known.address != info.address:
                        self.workers.remove(name)
                        self.workers.add(name, info.kind, info.address)
                        log.info("worker %s (%s) at %s joined", name, info.kind, info.address)
                for name in set(self.workers.workers) - set(infos):
                    self.workers.remove(name)
                    log.info("worker %s left", name)
        for w in list(self.workers.workers.values()):
            try:
                w.healthy = self.check(w)
                w.failed_checks = 0
            except grpc.RpcError:
                w.healthy = False
                w.failed_checks += 1
            if w.failed_checks >= self.drop_after:
                log.warning("worker %s does not answer; dropping it", w.name)
                if self.forget is not None:
                    try:
                        self.forget(w.name)
                    except Exception as e:  # noqa: BLE001 - discovery may be briefly unreachable
                        log.warning("could not unregister %s: %s", w.name, e)
                self.workers.drop(w.name)

    def serving(self) -> bool:
        """At least one healthy prefill and one healthy decode worker."""
        return self.workers.count("prefill") > 0 and self.workers.count("decode") > 0
