"""Prometheus metrics, named like vLLM's with ``baton_`` in place of ``vllm:``. One set per process
(prometheus_client's default registry), served over HTTP by ``serve_metrics``. Every metric carries ``model``
and ``worker`` labels (``worker="router"`` for the router's), except the HTTP gateway's.

Why ``baton_`` and not ``baton:``: a scraper that negotiates OpenMetrics (Prometheus does) gets sample names
with the colon escaped to an underscore, a plain text scrape keeps it, so one name would be stored under two
spellings. Names of letters, digits and underscores read the same in every format. Counters are stored with
``_total``, histograms as ``_bucket``/``_sum``/``_count``.

Each process creates its series at start (``start_series``), at zero, so that a dashboard or a ``rate()``
finds every documented series before the first request and a counter's first increment is not lost.

Where each is measured:

- router: ``time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``
  (as the client sees them, minus the network), ``prompt_tokens``, ``generation_tokens``,
  ``request_success`` by finish reason, ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens),
  ``prefix_index_lookups`` by result, ``prefix_routed``, ``num_requests_running`` (requests in flight),
  ``migrations`` by cause (a request moved to another worker after its worker failed) and
  ``migration_seconds`` (the failure to the first token from the new worker: the latency a migration adds).
- prefill and decode workers: ``request_queue_time_seconds`` (arrival -> first pass),
  ``request_prefill_time_seconds`` (first pass -> first token), ``request_decode_time_seconds``
  (first token -> last), ``num_requests_running`` / ``num_requests_waiting`` (the scheduler's),
  ``kv_cache_usage_perc``, ``batch_size`` and ``batch_tokens`` per forward pass (occupancy).
- router and workers: ``grammar_compile_seconds`` by ``cached`` (structured output: each process compiles
  a request's constraint once, cached by content), ``constrained_requests`` by constraint kind.
- prefill and decode workers: ``grammar_mask_seconds`` per forward pass with constrained rows (the token
  masks, computed while the forward pass runs; the part that did not overlap it is ``grammar_mask_wait_seconds``).
- decode workers: ``kv_transfer_bytes`` and ``kv_transfer_seconds`` (the pull of each hand-off).
- decode workers with speculative decoding (vLLM's ``spec_decode_*``): ``spec_decode_num_drafts`` (a sequence's
  pass with proposed tokens), ``spec_decode_num_draft_tokens`` (proposed tokens computed),
  ``spec_decode_num_accepted_tokens`` (of them kept) and ``spec_decode_num_accepted_tokens_per_pos`` by
  ``position`` (0-based in the draft). Mean accepted length = 1 + accepted / drafts; acceptance = accepted /
  draft tokens.
- prefill and decode workers: ``memory_bytes`` by ``part``: ``weights`` (the prepared weights; ``weights_shared``
  the same bytes when they are mapped from a weight image that the node's workers share, else 0), ``kv_pool``
  (reserved) and ``kv_resident`` (of it in memory), the process's ``rss``, ``pss`` and ``uss``, and ``runtime``
  (the resident set less weights and KV: Python, torch, Ray, buffers). Summed over a stack's processes, PSS
  counts a shared page once.
- the HTTP gateway: ``http_requests`` by endpoint and status, ``http_request_duration_seconds`` by endpoint
  (to the end of the response, the whole stream for a streamed one).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from baton.api.params import CONSTRAINT_KINDS, FinishReason

# No `_created` series beside each counter and histogram: one series per metric to store, not two.
disable_created_metrics()

L = ["model", "worker"]
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LONG = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.6)

TTFT = Histogram("baton_time_to_first_token_seconds", "Time to first token.", L, buckets=_LATENCY)
ITL = Histogram("baton_inter_token_latency_seconds", "Time between consecutive streamed tokens.", L, buckets=_ITL)
E2E = Histogram("baton_e2e_request_latency_seconds", "End-to-end request latency.", L, buckets=_LONG)
QUEUE_TIME = Histogram("baton_request_queue_time_seconds", "Time in a worker's queue before the first pass.", L,
                       buckets=_LONG)
PREFILL_TIME = Histogram("baton_request_prefill_time_seconds", "First pass to first token (prefill).", L,
                         buckets=_LONG)
DECODE_TIME = Histogram("baton_request_decode_time_seconds", "First token to last token (decode).", L,
                        buckets=_LONG)
PROMPT_TOKENS = Counter("baton_prompt_tokens", "Prompt tokens of requests served.", L)
GENERATION_TOKENS = Counter("baton_generation_tokens", "Generated tokens.", L)
REQUEST_SUCCESS = Counter("baton_request_success", "Requests that finished, by finish reason.",
                          [*L, "finish_reason"])
RUNNING = Gauge("baton_num_requests_running", "Requests running (router: in flight).", L)
WAITING = Gauge("baton_num_requests_waiting", "Requests waiting for their first pass.", L)
KV_USAGE = Gauge("baton_kv_cache_usage_perc", "Share of KV blocks in use (0 to 1).", L)
BATCH_SIZE = Histogram("baton_batch_size", "Sequences per forward pass.", L,
                       buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256))
BATCH_TOKENS = Histogram("baton_batch_tokens", "Tokens per forward pass.", L,
                         buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
KV_TRANSFER_BYTES = Counter("baton_kv_transfer_bytes", "KV bytes pulled from prefill workers.", L)
KV_TRANSFER_SECONDS = Histogram("baton_kv_transfer_seconds", "Duration of each KV pull.", L,
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
SPEC_DRAFTS = Counter("baton_spec_decode_num_drafts", "Sequence passes with speculative proposals.", L)
SPEC_DRAFT_TOKENS = Counter("baton_spec_decode_num_draft_tokens", "Proposed tokens computed.", L)
SPEC_ACCEPTED_TOKENS = Counter("baton_spec_decode_num_accepted_tokens", "Proposed tokens kept.", L)
SPEC_ACCEPTED_PER_POS = Counter("baton_spec_decode_num_accepted_tokens_per_pos",
                                "Proposed tokens kept, by position in the draft (0-based).", [*L, "position"])
_GRAMMAR = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GRAMMAR_COMPILE = Histogram("baton_grammar_compile_seconds", "Compiling a structured-output constraint.",
                            [*L, "cached"], buckets=_GRAMMAR)
GRAMMAR_MASK = Histogram("baton_grammar_mask_seconds", "Token masks of the constrained rows of one forward pass.",
                         L, buckets=_GRAMMAR)
GRAMMAR_MASK_WAIT = Histogram("baton_grammar_mask_wait_seconds",
                              "Time the sampler waited for token masks after the forward pass.", L, buckets=_GRAMMAR)
CONSTRAINED = Counter("baton_constrained_requests", "Requests with a structured-output constraint, by kind.",
                      [*L, "kind"])
PREFIX_QUERIES = Counter("baton_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", L)
PREFIX_HITS = Counter("baton_prefix_cache_hits", "Prompt tokens served from a prefill worker's prefix cache.", L)
PREFIX_LOOKUPS = Counter(
    "baton_prefix_index_lookups",
    "Router lookups in the prefix index by result: hit (some worker holds the first block), miss, unavailable.",
    [*L, "result"])
PREFIX_INDEX_ERRORS = Counter(
    "baton_prefix_index_errors", "A prefill worker's failed writes to the prefix index (it re-publishes later).", L)
PREFIX_ROUTED = Counter(
    "baton_prefix_routed", "Prefill requests by the worker chosen and why: cache (holds the longest prefix), "
    "load (the best holder was overloaded or costlier), none (no holder).", [*L, "target", "reason"])


def engine_gauges(model: str, worker: str, running: Callable[[], float], waiting: Callable[[], float],
                  kv_usage: Callable[[], float]) -> None:
    """Gauges read from a worker's engine at scrape time."""
    RUNNING.labels(model, worker).set_function(running)
    WAITING.labels(model, worker).set_function(waiting)
    KV_USAGE.labels(model, worker).set_function(kv_usage)


MEMORY = Gauge("baton_memory_bytes", "A worker's memory by part (baton/memory.py): weights, weights_shared, kv_pool, "
               "kv_resident, rss, pss, uss, runtime.", [*L, "part"])


def memory_gauges(model: str, worker: str, report: Callable[[], dict[str, int]]) -> None:
    """A worker's memory, one series per part that ``report`` (which caches the measurement) names, read at scrape
    time."""
    for part in report():
        MEMORY.labels(model, worker, part).set_function(lambda part=part: report()[part])


LORA_REQUESTS = Counter("baton_lora_requests", "Requests finished under each LoRA adapter (router).",
                        [*L, "adapter"])
LORA_TOKENS = Counter("baton_lora_generation_tokens", "Tokens generated under each LoRA adapter (router).",
                      [*L, "adapter"])
LORA_ADAPTERS = Gauge("baton_lora_adapters", "LoRA adapters listed (router) or held in memory (workers).", L)
LORA_LOADS = Counter("baton_lora_loads", "LoRA adapters read from their folder by a worker.", L)
LORA_LOAD_TIME = Histogram("baton_lora_load_seconds", "Reading and checking one LoRA adapter's folder.", L,
                           buckets=_LATENCY)
LORA_EVICTIONS = Counter("baton_lora_evictions", "LoRA adapters whose model slot was given to another adapter.", L)

MIGRATIONS = Counter("baton_migrations", "Requests moved to another worker after theirs failed, by cause: "
                     "decode_unavailable (died or dropped the connection), decode_unresponsive (stopped answering "
                     "health checks, or a stream went silent), decode_error (failed otherwise), "
                     "prefill_unavailable (a prefill failed).",
                     [*L, "cause"])
MIGRATION_TIME = Histogram("baton_migration_seconds", "A worker's failure to the request's next token from another "
                           "worker (the time a migration adds).", L, buckets=_LONG)
MIGRATION_CAUSES = ("decode_unavailable", "decode_unresponsive", "decode_error", "prefill_unavailable")


HTTP_REQUESTS = Counter("baton_http_requests", "HTTP requests to the OpenAI-compatible API, by endpoint and status.",
                        ["endpoint", "status"])
HTTP_DURATION = Histogram("baton_http_request_duration_seconds", "HTTP request time to the end of the response.",
                          ["endpoint"], buckets=_LONG)


ROUTER = (TTFT, ITL, E2E, PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS, LORA_ADAPTERS,
          MIGRATION_TIME)
PREFILL = (QUEUE_TIME, PREFILL_TIME, BATCH_SIZE, BATCH_TOKENS, GRAMMAR_MASK, GRAMMAR_MASK_WAIT,
           PREFIX_INDEX_ERRORS, LORA_LOADS, LORA_LOAD_TIME, LORA_EVICTIONS)
DECODE = (QUEUE_TIME, DECODE_TIME, BATCH_SIZE, BATCH_TOKENS, GRAMMAR_MASK, GRAMMAR_MASK_WAIT, KV_TRANSFER_BYTES,
          KV_TRANSFER_SECONDS, LORA_LOADS, LORA_LOAD_TIME, LORA_EVICTIONS, SPEC_DRAFTS, SPEC_DRAFT_TOKENS,
          SPEC_ACCEPTED_TOKENS)
# The label values that are known in advance (a routed-to worker's name is not).
FINISH_REASONS = tuple(r.value for r in FinishReason)
LOOKUP_RESULTS = ("hit", "miss", "unavailable")


def start_series(model: str, worker: str, role: str, spec_tokens: int = 0) -> None:
    """Create, at zero, every series that a process of ``role`` ("router", "prefill" or "decode") measures
    (``spec_tokens``: a decode worker's most proposed tokens per pass, one per-position series each)."""
    for metric in {"router": ROUTER, "prefill": PREFILL, "decode": DECODE}[role]:
        metric.labels(model, worker)
    for pos in range(spec_tokens):
        SPEC_ACCEPTED_PER_POS.labels(model, worker, str(pos))
    for cached in ("true", "false"):
        GRAMMAR_COMPILE.labels(model, worker, cached)
    for kind in CONSTRAINT_KINDS:
        CONSTRAINED.labels(model, worker, kind)
    if role == "router":
        for reason in FINISH_REASONS:
            REQUEST_SUCCESS.labels(model, worker, reason)
        for result in LOOKUP_RESULTS:
            PREFIX_LOOKUPS.labels(model, worker, result)
        for cause in MIGRATION_CAUSES:
            MIGRATIONS.labels(model, worker, cause)


def start_http_series(endpoints: tuple[str, ...]) -> None:
    """The gateway's per-endpoint series, at zero (its request counter's statuses appear as they happen)."""
    for endpoint in endpoints:
        HTTP_DURATION.labels(endpoint)


def serve_metrics(host: str, port: int) -> int:
    """Serve this process's metrics at http://host:port/metrics; returns the port (0 picks one)."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port


def sample(metric, suffix: str = "_total", **labels: str) -> float:
    """The sum of a metric's samples whose name ends with ``suffix`` over the label sets that match
    ``labels`` (0 when never touched). Histograms: ``_count`` or ``_sum``."""
    return sum(s.value for m in metric.collect() for s in m.samples
               if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items()))


__all__ = ["BATCH_SIZE", "BATCH_TOKENS", "DECODE_TIME", "E2E", "GENERATION_TOKENS", "ITL", "KV_TRANSFER_BYTES",
           "KV_TRANSFER_SECONDS", "KV_USAGE", "PREFILL_TIME", "PREFIX_HITS", "PREFIX_INDEX_ERRORS", "PREFIX_LOOKUPS",
           "PREFIX_QUERIES", "PREFIX_ROUTED", "PROMPT_TOKENS", "QUEUE_TIME", "REQUEST_SUCCESS", "RUNNING",
           "SPEC_ACCEPTED_PER_POS", "SPEC_ACCEPTED_TOKENS", "SPEC_DRAFTS", "SPEC_DRAFT_TOKENS", "TTFT",
           "WAITING", "engine_gauges", "sample", "serve_metrics", "start_http_series", "start_series"]
