"""Structured output: a request's ``Constraint`` compiled into a grammar, and the per-request matcher
that turns it into a mask of the tokens allowed next.

The constrained-decoding library is llguidance: it compiles a JSON schema, a regex or a Lark grammar in
about a millisecond (lazily: masks are computed per step by an Earley parser over a token trie), and
both compiling and masking run in Rust with the GIL released. ``Grammars`` is the compiler of one
tokenizer: compiled grammars are cached by the constraint's content hash; a compile runs on a pool
thread with a time bound, so a slow grammar never holds the engine thread or a gRPC thread for longer
than ``timeout_s``, and past it the request is refused, naming the field.

The router compiles to refuse a bad constraint before any worker sees it; each worker compiles again
(cached) to get matchers. A matcher's state is the output tokens it consumed: the decode worker
rebuilds it from the grammar and replays the first token the prefill worker sampled.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from baton import metrics
from baton.api.errors import InvalidRequestError
from baton.api.params import Constraint
from baton.tokenizer import Tokenizer
from baton.tracing import child_span

__all__ = ["CompiledGrammar", "Grammars", "Matcher", "grammar_source"]

# Parser limits, where a hostile grammar could make one step slow or one request large. Compiling is
# bounded by the lexer's initial fuel and the grammar size; a mask step by its fuel and item cap
# (llguidance measures about 14k lexer fuel and 20k items per millisecond); a request's lexer by its
# states (1-2 kB each: 20k is at most about 40 MB, a fifth of llguidance's default).
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
               max_lexer_states=20_000, max_grammar_size=200_000)
# JSON without free whitespace: the compact separators, so a schema's longest answer is bounded.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_source(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint (not yet checked: compiling does that)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so each choice is written as a JSON string.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choices))
    if "::=" in value:  # GBNF (llama.cpp's grammar syntax)
        try:
            value = gbnf_to_lark(value)
        except Exception as e:  # noqa: BLE001 - the converter's message is the client's answer
            raise InvalidRequestError(constraint.field, f"{constraint.field}: GBNF does not convert: {_cut(str(e))}"
                                      ) from None
    return llguidance.LLMatcher.grammar_from_lark(value)


class Matcher:
    """One request's position in its grammar: which tokens may come next, and whether it is complete."""

    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the matcher is then in error)."""
        return bool(self._m.consume_token(token)) and not self._m.is_error()

    def allows(self, token: int) -> bool:
        """Whether the grammar takes ``token`` next (about a microsecond; nothing is consumed)."""
        return self._m.validate_tokens([token]) == 1

    @property
    def done(self) -> bool:
        """The structure is complete and can take nothing more (EOS consumed, or no extension exists)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._m


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one tokenizer; ``matcher()`` starts a request at its beginning."""

    key: str
    template: llguidance.LLMatcher  # never advanced: each request starts from a copy
    compile_seconds: float

    def matcher(self) -> Matcher:
        return Matcher(self.template.deep_copy())


class Grammars:
    """Compiles constraints for one tokenizer, with a cache by content hash and a time bound."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 256, timeout_s: float = 5.0,
                 threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        # At most this many compiles queued or running: beyond it a compile waits (within its time bound).
        self._slots = threading.BoundedSemaphore(threads * 4)
        self.compiles = 0  # cache misses compiled since start
        self.hits = 0

    def warm(self) -> None:
        """Build llguidance's tokenizer on a thread of its own now, so that the first constrained request
        does not wait for it."""
        threading.Thread(target=lambda: self.tokenizer, name="grammar-warm", daemon=True).start()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built once, about 0.3 s for a 49k vocabulary)."""
        with self._tok_lock:
            if self._lltok is None:
                t = self._tokenizer
                self._lltok = llguidance.LLTokenizer(t._backend.to_str(), n_vocab=t.vocab_size,
                                                     eos_token=sorted(t.eos_token_ids))
            return self._lltok

    def compile(self, constraint: Constraint) -> tuple[CompiledGrammar, bool]:
        """The compiled grammar and whether it came from the cache. InvalidRequestError naming
        ``constraint.<kind>`` when the compiler refuses it or it takes longer than ``timeout_s``."""
        key = constraint.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit, True
        name = constraint.field
        deadline = time.monotonic() + self.timeout_s
        source = grammar_source(constraint)
        lltok = self.tokenizer
        if not self._slots.acquire(timeout=self.timeout_s):
            raise InvalidRequestError(name, f"{name}: the grammar compiler is busy; try again")
        t0 = time.perf_counter()
        try:
            future = self._pool.submit(_build, lltok, source)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        try:
            template = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(name, f"{name} took longer than {self.timeout_s:g} s to compile; "
                                            "simplify it") from None
        seconds = time.perf_counter() - t0
        if template.is_error():
            raise InvalidRequestError(name, f"{name}: {_cut(template.get_error())}")
        grammar = CompiledGrammar(key, template, seconds)
        with self._lock:
            self.compiles += 1
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar, False

    def compile_observed(self, constraint: Constraint, model: str, worker: str, tracer, parent) -> CompiledGrammar:
        """``compile`` with its time on the metrics (by cached) and a ``baton.grammar.compile`` child span of
        ``parent``; what the router and both kinds of worker call. InvalidRequestError as ``compile``."""
        t0 = time.time()
        grammar, cached = self.compile(constraint)
        t1 = time.time()
        metrics.GRAMMAR_COMPILE.labels(model, worker, "true" if cached else "false").observe(t1 - t0)
        metrics.CONSTRAINED.labels(model, worker, constraint.kind).inc()
        child_span(tracer, "baton.grammar.compile", parent, t0, t1,
                   {"baton.constraint.kind": constraint.kind, "baton.grammar.cached": cached})
        return grammar

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _cut(message: str, limit: int = 1000) -> str:
    """A compiler message may quote the client's grammar: at most ``limit`` characters of it come back."""
    return message if len(message) <= limit else message[:limit] + f"... ({len(message)} characters)"


def _build(lltok: llguidance.LLTokenizer, source: str) -> llguidance.LLMatcher:
    return llguidance.LLMatcher(lltok, source, log_level=0, limits=llguidance.LLParserLimits(**_LIMITS))
