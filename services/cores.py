"""Cores that follow the load between the pools of a pinned local stack.

Pinned, each worker runs on its own cores, so a long prompt's prefill passes run on the prefill
worker's core while a decode worker with nothing to decode leaves its core idle. The ``CoreBoard``
is a small file of the stack's own (one byte per CPU of the machine, mapped by every worker on the
host): a decode worker writes 1 on its cores while it has no request and 0 while it has one
(``CorePublisher``, from its engine thread, only when that changes). Before each pass, a prefill
worker (``CoreBorrower``) with at least ``min_tokens`` prompt tokens still to compute takes the
cores marked idle: its engine thread may run on them and its kernels use that many more threads.
A pass with fewer tokens left, or a core marked busy again, gives them back at the next pass, so a
decode worker that gets a request shares its core for at most the rest of one prefill pass (a chunk
of at most ``--max-batched-tokens`` tokens).

Measured on 2 cores (one prefill and one decode worker, the default model, one request at a time):
see the README's long-prompt figures.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

IDLE, BUSY = 1, 0


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
    """A decode worker's side: marks its cores IDLE while its engine has no request, BUSY otherwise."""

    def __init__(self, board: CoreBoard, cpus: list[int]) -> None:
        self.board, self.cpus = board, list(cpus)
        self._state: int | None = None

    def update(self, busy: bool) -> None:
        state = BUSY if busy else IDLE
        if state != self._state:
            self.board.publish(self.cpus, state)
            self._state = state

    def before_step(self, engine) -> None:
        """The engine loop's hook (on its thread): idle while the engine has no request."""
        self.update(engine.has_unfinished())

    def state(self) -> dict:
        return {"cpus": self.cpus, "idle": self.board.idle(self.cpus) == self.cpus}

    def close(self) -> None:
        self.board.publish(self.cpus, BUSY)  # a worker that stops lends nothing
        self.board.close()


class CoreBorrower:
    """A prefill worker's side, called on its engine thread before each pass: with at least
    ``min_tokens`` prompt tokens left to compute, run on its own cores plus the idle ones among
    ``others`` (with one more kernel thread per borrowed core); else on its own cores alone."""

    def __init__(self, board: CoreBoard, own: list[int], others: list[int], threads: int,
                 min_tokens: int = 256) -> None:
        self.board, self.own, self.others = board, list(own), [c for c in others if c not in own]
        self.threads, self.min_tokens = threads, min_tokens
        self.borrowed: list[int] = []
        self.passes_borrowed = 0  # passes that ran on borrowed cores (for tests and the log)

    def before_pass(self, tokens_left: int) -> list[int]:
        """Borrow or give back for the next pass; returns the borrowed cores."""
        want = self.board.idle(self.others) if tokens_left >= self.min_tokens else []
        if want != self.borrowed:
            os.sched_setaffinity(0, self.own + want)  # 0: the calling (engine) thread only
            torch.set_num_threads(self.threads + len(want))
            self.borrowed = want
        if want:
            self.passes_borrowed += 1
        return want

    def before_step(self, engine) -> None:
        """The engine loop's hook (on its thread): borrow or give back for the engine's next pass."""
        self.before_pass(tokens_left(engine))

    def state(self) -> dict:
        return {"cpus": self.own, "borrowed": list(self.borrowed), "passes_borrowed": self.passes_borrowed,
                "share": self.others}

    def close(self) -> None:
        self.board.close()


def tokens_left(engine) -> int:
    """Prompt tokens the engine has still to compute (its waiting and running sequences)."""
    s = engine.scheduler
    return sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in (*s.waiting, *s.running))
