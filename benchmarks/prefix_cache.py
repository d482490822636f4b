"""Prefix caching on the stack: a shared 1,000-token system prompt with short distinct questions.

Three phases on one stack (router + prefill and decode workers on Ray, prefix index in Redis):

  cold    --cold requests, each with its own 1,000-token system prompt (nothing to reuse)
  first   the first request with the shared system prompt (computes and caches it)
  warm    --warm requests with the shared system prompt and distinct questions, --concurrency at a time

It reports TTFT (p50/p95) per phase, the share of the warm phase's prompt tokens that came from the
cache, and warm TTFT p50 against cold TTFT p50. Targets: >= 90% cached and a ratio <= 0.25.

    .venv/bin/python benchmarks/prefix_cache.py [--system-tokens 1000] [--warm 24] [--cold 4]
        [--concurrency 1] [--prefill 1] [--json bench-results/prefix_cache.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from baton.api.client import Client, generate_request  # noqa: E402
from baton.bench.report import percentile  # noqa: E402
from baton.config import (
    EngineConfig,  # noqa: E402
    ServeConfig,  # noqa: E402
)
from baton.loader import load_tokenizer  # noqa: E402
from baton.serve import Stack  # noqa: E402

TOPICS = ["astronomy", "cooking", "gardening", "chess", "sailing", "painting", "history", "music"]


def system_prompt(tokenizer, n: int, topic: str) -> list[int]:
    """Exactly ``n`` tokens of instructions about ``topic`` (repeated numbered rules)."""
    text = f"You are a patient assistant who knows {topic} well. Follow these rules.\n"
    i = 0
    while len(tokenizer.encode(text)) < n:
        i += 1
        text += f"Rule {i}: when asked about {topic}, answer in plain words and give one example ({i}).\n"
    return tokenizer.encode(text)[:n]


def ask(client: Client, rid: str, ids: list[int], max_tokens: int) -> dict:
    req = generate_request(prompt_token_ids=ids, request_id=rid,
                           sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    t0 = time.perf_counter()
    first, usage = None, None
    for msg in client.stream(req, timeout=600):
        if first is None and msg.token_ids:
            first = time.perf_counter() - t0
        if msg.HasField("usage"):
            usage = msg.usage
    return {"id": rid, "ttft_s": first, "e2e_s": time.perf_counter() - t0, "prompt_tokens": usage.prompt_tokens,
            "cached_prompt_tokens": usage.cached_prompt_tokens}


def run(client: Client, items: list[tuple[str, list[int]]], concurrency: int, max_tokens: int) -> list[dict]:
    todo, out, lock = iter(items), [], threading.Lock()

    def user() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            r = ask(client, item[0], item[1], max_tokens)
            with lock:
                out.append(r)

    threads = [threading.Thread(target=user) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def pct(rows: list[dict], key: str, q: float) -> float:
    return percentile([r[key] for r in rows], q)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=24, help="requests sharing the system prompt after the first")
    ap.add_argument("--cold", type=int, default=4, help="requests with system prompts of their own")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers")
    ap.add_argument("--redis-url", default=None, help="default: a private redis-server")
    ap.add_argument("--json", default="bench-results/prefix_cache.json")
    args = ap.parse_args()

    tok = load_tokenizer(None)
    shared = system_prompt(tok, args.system_tokens, "astronomy")
    questions = [tok.encode(f"\nQuestion {i}: what should I know about topic number {i}?")
                 for i in range(args.warm)]
    cold_items = [(f"cold-{i}", system_prompt(tok, args.system_tokens, TOPICS[1 + i % (len(TOPICS) - 1)] + f" {i}")
                   + questions[i % len(questions)]) for i in range(args.cold)]

    t = time.perf_counter()
    stack = Stack(ServeConfig(engine=EngineConfig(kv_cache_memory=512 << 20), prefill=args.prefill, port=0,
                              redis_url=args.redis_url, metrics_port=None, http_port=None)).start()
    print(f"stack up in {time.perf_counter() - t:.1f} s; prefix index at {stack.index.url}", flush=True)
    try:
        with Client(stack.address) as client:
            run(client, [("warmup", tok.encode("Hello there, how are you?"))], 1, 4)
            cold = run(client, cold_items, 1, args.max_tokens)
            print(f"cold : TTFT p50 {pct(cold, 'ttft_s', 50):.3f} s over {len(cold)} requests", flush=True)
            first = run(client, [("first", shared + questions[0])], 1, args.max_tokens)
            print(f"first: TTFT {first[0]['ttft_s']:.3f} s", flush=True)
            time.sleep(0.3)  # the prefill worker publishes its new blocks to the index
            warm_items = [(f"warm-{i}", shared + questions[i]) for i in range(args.warm)]
            warm = run(client, warm_items, args.concurrency, args.max_tokens)
            stats = ray.get([a.stats.remote() for a in stack.prefill])
    finally:
        stack.stop()

    cached = sum(r["cached_prompt_tokens"] for r in warm) / sum(r["prompt_tokens"] for r in warm)
    ratio = pct(warm, "ttft_s", 50) / pct(cold, "ttft_s", 50)
    summary = {
        "cold_ttft_p50_s": pct(cold, "ttft_s", 50), "first_ttft_s": first[0]["ttft_s"],
        "warm_ttft_p50_s": pct(warm, "ttft_s", 50), "warm_ttft_p95_s": pct(warm, "ttft_s", 95),
        "warm_cached_fraction": cached, "warm_over_cold_ttft_p50": ratio,
        "targets_met": {"cached_fraction>=0.9": cached >= 0.9, "ttft_ratio<=0.25": ratio <= 0.25},
    }
    print(f"warm : TTFT p50 {summary['warm_ttft_p50_s']:.3f} s, p95 {summary['warm_ttft_p95_s']:.3f} s "
          f"({args.concurrency} client(s))")
    print(f"cached share of warm prompt tokens: {cached:.1%} (target >= 90%)")
    print(f"warm TTFT p50 / cold TTFT p50: {ratio:.3f} (target <= 0.25)")
    out = {"args": vars(args), "machine": {"platform": platform.platform(), "python": platform.python_version()},
           "summary": summary, "prefill_stats": stats, "cold": cold, "first": first, "warm": warm}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
