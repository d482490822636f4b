"""Cores that follow the load between the pools of a pinned local stack.

Pinned, each worker runs on its own cores, so a long prompt's prefill passes run on the prefill
worker's core while a decode worker with nothing to decode leaves its core idle, and a decode worker
streams one request on its core while the prefill worker, with no prompt to compute, leaves its own
idle. The ``CoreBoard`` is a small file of the stack's own (one byte per CPU of the machine, mapped
by every worker on the host): every worker writes 1 on its cores while its engine has no request and
0 while it has one (``CorePublisher``, from its engine thread, only when that changes). Before each
pass, a worker's ``CoreBorrower`` takes the cores marked idle when its pass is worth it: its engine
thread may run on them and its kernels use that many more threads. A worker borrows only while its
own cores are marked busy, and lends only while it borrows nothing, so two workers never hold each
other's cores.

- A prefill worker borrows for a pass with at least ``min_tokens`` prompt tokens still to compute
  (``PREFILL_MIN_TOKENS``): a decode worker that gets a request shares its core for at most the rest
  of one layer of a prefill pass (the model calls ``between_layers`` after each).
- A decode worker may borrow for every step (a step reads all the weights; two cores read them about
  1.5x as fast as one): a prefill worker that gets a prompt shares its core for at most the rest of one
  decode step (tens of milliseconds). An idle prefill worker's core is not always a free one: the router
  and the clients' streams run there too, and a kernel that splits a step between a free core and a busy
  one waits for the busy one at every barrier. So the decode worker times its steps on its own cores and
  on borrowed ones, for each number of requests, and borrows only where that measured faster
  (``StepTimes``; on 2 cores of a Xeon at 16 streams, borrowing every step made steps 15% slower).

The kernels give the same bits on any number of threads, so borrowing changes no output.

Measured on 2 cores (one prefill and one decode worker, the default model): see the README's
long-prompt figures and its figures for one client.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable

import torch

IDLE, BUSY = 1, 0
# A prefill pass borrows idle cores from this many prompt tokens (capped at a pass): on 2 cores two threads
# computed a 16- to 180-token prefill 1.4-1.9x as fast as one, and a pass gives a borrowed core back between
# its layers once the owner has work (``between_layers``), so the owner waits one layer, not one pass.
PREFILL_MIN_TOKENS = 32


class CoreBoard:
    """One byte per CPU in a shared file: IDLE while the decode worker pinned there has nothing to do."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)

    @staticmethod
    def create(path: str) -> str:
        """A board for every CPU of this machine, all BUSY (a core no decode worker publishes is never lent)."""
        with open(path, "wb") as f:
            f.write(bytes([BUSY]) * (os.cpu_count() or 1))
        return path

    def publish(self, cpus: list[int], state: int) -> None:
        for c in cpus:
            if c < len(self._map):
                self._map[c] = state

    def idle(self, cpus: list[int]) -> list[int]:
        return [c for c in cpus if c < len(self._map) and self._map[c] == IDLE]

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()


class CorePublisher:
    """A worker's own cores: IDLE while its engine has no request, BUSY otherwise."""

    def __init__(self, board: CoreBoard, cpus: list[int]) -> None:
        self.board, self.cpus = board, list(cpus)
        self._state: int | None = None

    def update(self, busy: bool) -> None:
        state = BUSY if busy else IDLE
        if state != self._state:
            self.board.publish(self.cpus, state)
            self._state = state

    def state(self) -> dict:
        return {"cpus": self.cpus, "idle": self.board.idle(self.cpus) == self.cpus}

    def close(self) -> None:
        self.board.publish(self.cpus, BUSY)  # a worker that stops lends nothing
        self.board.close()


class StepTimes:
    """A decode worker's choice, step by step, between its own cores and its own plus the idle ones: for each
    number of requests (the key) it keeps a moving average of the step's seconds either way, tries each way
    ``tries`` times first, then takes the faster one, and the slower one every ``recheck`` steps of that
    key (the load on the other cores changes)."""

    def __init__(self, tries: int = 2, recheck: int = 16, weight: float = 0.25) -> None:
        self.tries, self.recheck, self.weight = tries, recheck, weight
        self._mean: dict[tuple[int, bool], float] = {}
        self._count: dict[tuple[int, bool], int] = {}
        self._steps: dict[int, int] = {}

    def borrow(self, key: int) -> bool:
        """Whether the next step with ``key`` requests should borrow."""
        for way in (True, False):
            if self._count.get((key, way), 0) < self.tries:
                return way
        faster = self._mean[(key, True)] < self._mean[(key, False)]
        n = self._steps[key] = self._steps.get(key, 0) + 1
        return faster if n % self.recheck else not faster

    def record(self, key: int, borrowed: bool, seconds: float) -> None:
        k = (key, borrowed)
        n = self._count[k] = self._count.get(k, 0) + 1
        self._mean[k] = seconds if n == 1 else self._mean[k] + self.weight * (seconds - self._mean[k])

    def state(self) -> dict[int, dict[str, float]]:
        """key -> the mean step seconds on own and on borrowed cores, where measured."""
        out: dict[int, dict[str, float]] = {}
        for (key, way), mean in sorted(dict(self._mean).items()):  # a copy: the engine thread adds keys
            out.setdefault(key, {})["borrowed" if way else "own"] = mean
        return out


class CoreBorrower:
    """A worker's side, called on its engine thread before each pass: publishes its own cores' state
    (``publisher``), then, when the pass is worth it, runs on its own cores plus the idle ones among
    ``others`` (with one more kernel thread per borrowed core); else on its own cores alone.

    Prefill (``per_step=False``): worth it for a pass with at least ``min_tokens`` prompt tokens left.
    Decode (``per_step=True``): for a step while the engine has a request, where ``StepTimes`` found it
    faster (its timings come from ``after_step``; until a step is timed, every step borrows)."""

    def __init__(self, board: CoreBoard, own: list[int], others: list[int], threads: int,
                 min_tokens: int = 256, publisher: CorePublisher | None = None, per_step: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.board, self.own, self.others = board, list(own), [c for c in others if c not in own]
        self.threads, self.min_tokens = threads, min_tokens
        self.publisher = publisher
        self.borrowed: list[int] = []
        self.passes_borrowed = 0  # passes that ran on borrowed cores (for tests and the log)
        self.times = StepTimes() if per_step else None
        self.clock = clock
        self._step: tuple[int, bool, float] | None = None  # the step under way: key, borrowed, start

    def borrow(self, worth_it: bool) -> list[int]:
        """Borrow the idle cores for the next pass, or give them back; returns the borrowed cores."""
        want = self.board.idle(self.others) if worth_it else []
        self._hold(want)
        if want:
            self.passes_borrowed += 1
        return want

    def between_layers(self) -> None:
        """The model's hook between two layers of a pass: gives back at once the borrowed cores that are no
        longer idle (their owner got a request), so it waits one layer, not the rest of a prefill pass."""
        if self.borrowed:
            self._hold(self.board.idle(self.borrowed))

    def _hold(self, cores: list[int]) -> None:
        """Run the engine thread on its own cores plus ``cores``, one more kernel thread each."""
        if cores != self.borrowed:
            os.sched_setaffinity(0, self.own + cores)  # 0: the calling (engine) thread only
            torch.set_num_threads(self.threads + len(cores))
            self.borrowed = cores

    def before_pass(self, tokens_left: int) -> list[int]:
        """A prefill pass with ``tokens_left`` prompt tokens still to compute."""
        return self.borrow(tokens_left >= self.min_tokens)

    def before_step(self, engine) -> None:
        """The engine loop's hook (on its thread): say whether this worker is idle, then borrow or give
        back for the engine's next pass."""
        busy = engine.has_unfinished()
        if not busy:  # gives back before it lends
            self.borrow(False)
        if self.publisher is not None:
            self.publisher.update(busy)
        if not busy:
            self._step = None
        elif self.times is not None:  # marked busy before it borrows
            key = engine.num_requests
            borrowed = bool(self.borrow(self.times.borrow(key)))
            self._step = (key, borrowed, self.clock())
        else:
            self.borrow(tokens_left(engine) >= self.min_tokens)

    def after_step(self) -> None:
        """The engine loop's hook after a step (on its thread): times a decode step the way it ran."""
        if self.times is not None and self._step is not None:
            key, borrowed, start = self._step
            self.times.record(key, borrowed, self.clock() - start)
            self._step = None

    def state(self) -> dict:
        s = {"cpus": self.own, "borrowed": list(self.borrowed), "passes_borrowed": self.passes_borrowed,
             "share": self.others}
        if self.times is not None:
            s["step_seconds"] = self.times.state()
        if self.publisher is not None:
            s["idle"] = self.publisher.state()["idle"]
        return s

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.board.close()


def tokens_left(engine) -> int:
    """Prompt tokens the engine has still to compute (its waiting and running sequences)."""
    s = engine.scheduler
    return sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in (*s.waiting, *s.running))
