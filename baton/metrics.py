"""Prometheus metrics, named like vLLM's under ``baton:``. One set per process (prometheus_client's
default registry); labels say which model and which worker."""

from __future__ import annotations

from prometheus_client import Counter

PREFIX_QUERIES = Counter(
    "baton:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at the router).", ["model"])
PREFIX_HITS = Counter(
    "baton:prefix_cache_hits", "Prompt tokens served from a prefill worker's prefix cache.", ["model"])
PREFIX_LOOKUPS = Counter(
    "baton:prefix_index_lookups",
    "Router lookups in the prefix index by result: hit (some worker holds the first block), miss, unavailable.",
    ["model", "result"])
PREFIX_ROUTED = Counter(
    "baton:prefix_routed", "Prefill requests by the worker chosen and why: cache (holds the longest prefix), "
    "load (the best holder was overloaded or costlier), none (no holder).", ["model", "worker", "reason"])


def sample(metric: Counter, **labels: str) -> float:
    """The sum of a counter over the label sets that match ``labels`` (0 when never touched)."""
    return sum(s.value for m in metric.collect() for s in m.samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


__all__ = ["PREFIX_HITS", "PREFIX_LOOKUPS", "PREFIX_QUERIES", "PREFIX_ROUTED", "sample"]
