"""Admission: whether the router takes one more request. Bounds on requests in flight, streams per
client and per decode worker, and an estimate of the prefill queue's depth in seconds (for a TTFT
SLO). A refusal is ``Overloaded``, which the router answers with RESOURCE_EXHAUSTED at once: overload
never becomes a queue that grows without limit."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from baton.config import Limits

# Prefills this small say little about the rate (their fixed cost dominates).
MIN_RATE_TOKENS = 16


class Overloaded(Exception):
    """The router is at a limit; the message says which and that the client may retry later."""


class Admission:
    def __init__(self, limits: Limits, decode_workers: Callable[[], int],
                 prefill_queues: Callable[[], Sequence[int]]) -> None:
        """decode_workers: how many healthy decode workers there are; prefill_queues: the uncached prompt
        tokens in flight on each healthy prefill worker."""
        self.limits = limits
        self._decode_workers = decode_workers
        self._prefill_queues = prefill_queues
        self._lock = threading.Lock()
        self._in_flight = 0
        self._per_client: dict[str, int] = {}
        self._prefill_rate: float | None = None  # uncached prompt tokens per second, one prefill at a time

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self, client: str) -> None:
        """Count one more request of ``client``, or raise Overloaded (nothing counted)."""
        lim = self.limits
        with self._lock:
            if self._in_flight >= lim.max_in_flight:
                raise Overloaded(f"router at its limit of {lim.max_in_flight} requests in flight; retry later")
            per_decode = lim.max_streams_per_decode_worker
            if per_decode is not None:
                decoders = self._decode_workers()
                if self._in_flight >= per_decode * decoders:
                    raise Overloaded(f"all {decoders} decode workers hold their limit of {per_decode} requests "
                                     "(--max-streams-per-decode-worker); retry later")
            wait = self.prefill_wait()
            if lim.max_queue_s is not None and wait is not None and wait > lim.max_queue_s:
                raise Overloaded(f"the prefill queue is about {wait:.1f} s deep, more than {lim.max_queue_s:g} s "
                                 "(--max-queue-seconds); retry later")
            streams = self._per_client.get(client, 0)
            if streams >= lim.max_streams_per_client:
                raise Overloaded(f"this client has {streams} streams open, the most one client may "
                                 "(--max-streams-per-client); retry when one ends")
            self._in_flight += 1
            self._per_client[client] = streams + 1

    def leave(self, client: str) -> None:
        with self._lock:
            self._in_flight -= 1
            left = self._per_client.get(client, 1) - 1
            if left:
                self._per_client[client] = left
            else:
                self._per_client.pop(client, None)

    def prefill_wait(self) -> float | None:
        """Seconds before a new prompt's prefill could start on the least-loaded prefill worker."""
        if self._prefill_rate is None:
            return None
        queued = self._prefill_queues()
        return min(queued) / self._prefill_rate if queued else None

    def measure_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` uncached tokens took ``seconds``: update the rate (moving average)."""
        if tokens >= MIN_RATE_TOKENS and seconds > 0:
            rate = tokens / seconds
            self._prefill_rate = rate if self._prefill_rate is None else 0.8 * self._prefill_rate + 0.2 * rate
