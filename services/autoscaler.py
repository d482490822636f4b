"""Pools that follow the load: placement of each pool's workers on the cluster and a controller that
adds a worker when the pool stays busy and drains an idle one after a cool-down.

Load of a worker = the requests its engine holds (running or waiting). A pool is busy when the mean
over its workers stays at or above ``scale_up_load`` for ``scale_up_after_s``; then one worker is added
(up to ``max``). A worker that held no request for ``scale_down_after_s`` is drained (no new requests,
the ones in flight finish, it leaves discovery) and stopped, newest first, down to the pool's minimum
(its starting count). A worker that died is dropped and, below the minimum, replaced.

This decides how many Baton workers run. On a real cluster Ray's own autoscaler then adds nodes for
actors that wait for resources (and removes idle nodes): ask for the pool's resources or labels here
and give the node types those resources in the cluster config (deploy/README.md).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import ray

log = logging.getLogger(__name__)


@dataclass
class _PoolState:
    busy_since: float | None = None
    last_busy: dict[str, float] = field(default_factory=dict)  # worker name -> last time it held a request


class Autoscaler:
    """Runs in the launcher's process; ``events`` records every change (time, pool, action, worker, why)."""

    def __init__(self, stack, period_s: float = 1.0) -> None:
        self.stack = stack
        self.period_s = period_s
        self.events: list[tuple[float, str, str, str, str]] = []
        self._state = {"prefill": _PoolState(), "decode": _PoolState()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="autoscaler")

    def start(self) -> Autoscaler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for kind in ("prefill", "decode"):
                try:
                    self.step(kind)
                except Exception:  # noqa: BLE001 - the controller must outlive one bad round
                    log.exception("autoscaler round for the %s pool failed", kind)

    def _record(self, kind: str, action: str, worker: str, why: str) -> None:
        self.events.append((time.time(), kind, action, worker, why))
        log.info("%s pool: %s %s (%s)", kind, action, worker, why)

    def step(self, kind: str) -> None:
        c = self.stack.config
        pool_cfg = c.prefill_pool if kind == "prefill" else c.decode_pool
        minimum = c.prefill if kind == "prefill" else c.decode
        maximum = max(minimum, pool_cfg.max or minimum)
        state = self._state[kind]
        handles = list(self.stack.prefill if kind == "prefill" else self.stack.decode)
        now = time.monotonic()
        loads: dict = {}
        refs = {h: h.stats.remote() for h in handles}
        for h, ref in refs.items():
            name = self.stack.names.get(h, "?")
            try:
                loads[h] = ray.get(ref, timeout=10)["requests"]
            except ray.exceptions.RayActorError:
                self.stack._forget(h)
                self._record(kind, "dropped", name, "the worker died")
            except ray.exceptions.GetTimeoutError:
                loads[h] = 0  # busy in a long pass; counted as neither busy nor idle
                state.last_busy[name] = now
        alive = [h for h in handles if h in loads]
        if len(alive) < minimum:
            name = self.stack.add_worker(kind)
            self._record(kind, "added", name, f"below the minimum of {minimum}")
            return
        for h, load in loads.items():
            name = self.stack.names.get(h)
            if load > 0 or name not in state.last_busy:
                state.last_busy[name] = now
        mean = sum(loads.values()) / max(1, len(loads))
        if mean >= pool_cfg.scale_up_load:
            state.busy_since = state.busy_since or now
            if now - state.busy_since >= pool_cfg.scale_up_after_s and len(alive) < maximum:
                name = self.stack.add_worker(kind)
                self._record(kind, "added", name, f"{mean:.1f} requests per worker for "
                             f"{now - state.busy_since:.0f} s")
                state.busy_since = None
                state.last_busy[name] = time.monotonic()
            return
        state.busy_since = None
        if len(alive) <= minimum:
            return
        wait = pool_cfg.scale_down_after_s
        idle = [h for h in reversed(alive)  # newest first
                if loads[h] == 0 and now - state.last_busy.get(self.stack.names.get(h), now) >= wait]
        if idle:
            h = idle[0]
            name = self.stack.names.get(h, "?")
            drained = self.stack.remove_worker(h)
            state.last_busy.pop(name, None)
            self._record(kind, "removed", name, f"idle for {pool_cfg.scale_down_after_s:.0f} s"
                         + ("" if drained else "; did not drain in time"))

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": len(self.stack.prefill), "decode": len(self.stack.decode)}


__all__ = ["Autoscaler"]
