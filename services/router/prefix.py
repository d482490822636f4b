"""KV-aware routing: send a prompt to the prefill worker that already holds the longest prefix of it,
unless that worker is overloaded.

Each candidate worker gets a cost, in tokens of prefill work ahead of this prompt's first token::

    cost(w) = (prompt tokens - tokens w holds in cache) + load_weight * (uncached tokens in flight on w)
              (+ ADAPTER_MISS_TOKENS when the request names a LoRA adapter that w does not hold)

and the cheapest wins (ties: fewer requests in flight). A worker with ``max_queue`` or more prefill
requests in flight from this router is overloaded: it is chosen only when every worker is. With
``load_weight`` 0 the longest hit always wins until ``max_queue``; a large ``load_weight`` routes by load
alone. The hit lengths come from the prefix index (``services/prefix_index.py``); when the index is
unavailable every hit is 0 and routing falls back to the least-loaded worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from baton.api.prefix import hash_full_blocks
from baton.config import PrefixRoutingConfig
from baton.metrics import PREFIX_HITS, PREFIX_LOOKUPS, PREFIX_QUERIES, PREFIX_ROUTED
from baton.services.prefix_index import IndexUnavailable, PrefixIndex

log = logging.getLogger(__name__)
# What loading a LoRA adapter costs a worker that does not hold it, in prompt tokens' compute (a few ms).
ADAPTER_MISS_TOKENS = 32


class PrefixRouter:
    def __init__(self, index: PrefixIndex | None, block_size: int, model: str,
                 config: PrefixRoutingConfig | None = None) -> None:
        self.index = index
        self.block_size = block_size
        self.model = model
        self.config = config or PrefixRoutingConfig()
        self._index_down = False

    def lookup(self, ids: Sequence[int], root: bytes | None = None) -> dict[str, int]:
        """worker -> prompt tokens it holds in cache (whole blocks from the start; the last prompt
        token is never counted, its logits must be computed). root: a LoRA adapter's chain root
        (baton/api/prefix.py adapter_root): only KV computed under that adapter counts."""
        PREFIX_QUERIES.labels(self.model, "router").inc(len(ids))
        if self.index is None:
            return {}
        bs = self.block_size
        hashes = hash_full_blocks(ids[: (len(ids) - 1) // bs * bs], bs, root)
        if not hashes:
            PREFIX_LOOKUPS.labels(self.model, "router", "miss").inc()
            return {}
        try:
            blocks = self.index.lookup(hashes)
        except IndexUnavailable as e:
            if not self._index_down:
                log.warning("prefix index unavailable, routing by load until it is back: %s", e)
            self._index_down = True
            PREFIX_LOOKUPS.labels(self.model, "router", "unavailable").inc()
            return {}
        if self._index_down:
            log.info("prefix index is back")
            self._index_down = False
        PREFIX_LOOKUPS.labels(self.model, "router", "hit" if blocks else "miss").inc()
        return {w: n * bs for w, n in blocks.items()}

    def order(self, candidates: list, num_tokens: int, hits: dict[str, int],
              holds: Callable[[str], bool] | None = None) -> list:
        """Candidates (router Worker records), best first, by the cost in the module docstring. holds(name):
        whether a worker holds the request's LoRA adapter; one that does not pays ADAPTER_MISS_TOKENS."""
        c = self.config

        def key(w) -> tuple[float, int]:
            miss = ADAPTER_MISS_TOKENS if holds is not None and not holds(w.name) else 0
            return (num_tokens - hits.get(w.name, 0) + c.load_weight * w.pending_tokens + miss, w.in_flight)

        ok = sorted((w for w in candidates if w.in_flight < c.max_queue), key=key)
        over = sorted((w for w in candidates if w.in_flight >= c.max_queue), key=key)
        ranked = ok + over
        if ranked:
            chosen = ranked[0]
            best = max((hits.get(w.name, 0) for w in candidates), default=0)
            reason = "none" if best == 0 else "cache" if hits.get(chosen.name, 0) == best else "load"
            PREFIX_ROUTED.labels(self.model, "router", chosen.name, reason).inc()
        return ranked

    def record_hit(self, cached_tokens: int) -> None:
        PREFIX_HITS.labels(self.model, "router").inc(cached_tokens)


__all__ = ["PrefixRouter"]
