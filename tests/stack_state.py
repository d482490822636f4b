"""What a running stack's workers hold, read from the workers themselves (Ray actor stats)."""

from __future__ import annotations

import time

import ray


def stats(stack) -> tuple[list[dict], list[dict]]:
    """(prefill workers' stats, decode workers' stats)."""
    return (ray.get([h.stats.remote() for h in stack.prefill]), ray.get([h.stats.remote() for h in stack.decode]))


def _idle(pre: list[dict], dec: list[dict]) -> bool:
    return all(p["requests"] == 0 and p["exports"] == 0 and p["active_prefills"] == 0 for p in pre) and all(
        d["requests"] == 0 and d["free_blocks"] == d["num_blocks"] and d["active_streams"] == 0 for d in dec)


def wait_idle(stack, timeout: float = 30.0) -> tuple[list[dict], list[dict]]:
    """Poll until no worker holds a request, a KV export or a block (cancellation is asynchronous); the
    last stats read, idle or not when the time ran out."""
    deadline = time.monotonic() + timeout
    while True:
        pre, dec = stats(stack)
        if _idle(pre, dec) or time.monotonic() > deadline:
            return pre, dec
        time.sleep(0.2)


def object_store(timeout: float = 20.0) -> tuple[int, str]:
    """Poll until the session's object store holds no object: (objects left, Ray's summary) when that happens or
    the time runs out. Only this cluster is asked (its address), never another Ray on the machine."""
    import re

    from ray._private.internal_api import memory_summary

    deadline = time.monotonic() + timeout
    while True:
        summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
        objects = int(re.search(r"(\d+) objects", summary).group(1))
        if objects == 0 or time.monotonic() > deadline:
            return objects, summary
        time.sleep(0.5)


def idle(stack, timeout: float = 30.0) -> bool:
    """Every worker holds no request, no KV export and no block, within ``timeout``."""
    return _idle(*wait_idle(stack, timeout))


def router_over(stack, tokenizer=None, **kwargs):
    """A second router, started on a free loopback port, over the stack's workers (its own limits,
    tokenizer or gateway key in ``kwargs``); the caller stops it."""
    from baton.services.router.router import Router

    router = Router(tokenizer or stack.router.service.tokenizer, stack.router.service.model, port=0, **kwargs)
    for w in stack.router.workers.workers.values():
        router.workers.add(w.name, w.kind, w.address)
    router.update_health()
    router.start()
    return router
