"""What a running stack's workers hold, read from the workers themselves (Ray actor stats)."""

from __future__ import annotations

import time

import ray


def stats(stack) -> tuple[list[dict], list[dict]]:
    """(prefill workers' stats, decode workers' stats)."""
    return (ray.get([h.stats.remote() for h in stack.prefill]), ray.get([h.stats.remote() for h in stack.decode]))


def idle(stack, timeout: float = 30.0) -> bool:
    """Every worker holds no request, no KV export and no block (polled: cancellation is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        pre, dec = stats(stack)
        done = all(p["requests"] == 0 and p["exports"] == 0 and p["active_prefills"] == 0 for p in pre) and all(
            d["requests"] == 0 and d["free_blocks"] == d["num_blocks"] and d["active_streams"] == 0 for d in dec)
        if done or time.monotonic() > deadline:
            return done
        time.sleep(0.2)
