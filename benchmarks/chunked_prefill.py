"""Long-prompt interference: TTFT of short prompts while 4,000-token prompts arrive, with chunked
prefill on and off, in one run.

For each setting a fresh stack (router + 1 prefill + 1 decode worker) gets the same seeded open-loop
load: short prompts (about 40 tokens, Poisson arrivals at --rate per second) for --duration seconds,
and a long prompt (--long-tokens, each different so none is cached) every --long-every seconds from
the start. It reports TTFT p50/p95/max of the short prompts and the long prompts' TTFT. With chunking
off a short prompt that arrives behind a long one waits for its whole prefill; with chunking on the
long prompt takes at most --prefill-chunk tokens of each pass and the short ones share the passes.
A third setting is what `baton serve` runs: chunked, with the prefill worker taking the prompt with
the fewest tokens left first (short prompts go ahead of a long one's next chunk).

    .venv/bin/python benchmarks/chunked_prefill.py [--long-tokens 4000] [--duration 60] [--rate 0.5]
        [--long-every 40] [--prefill-chunk 256] [--json bench-results/chunked_prefill.json]

The defaults keep a 2-core machine below its prefill capacity (about 150 tokens/s): an overloaded
worker shows queueing, not chunking.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from baton.api.client import Client, generate_request  # noqa: E402
from baton.bench.report import percentile  # noqa: E402
from baton.config import (
    EngineConfig,  # noqa: E402
    ServeConfig,  # noqa: E402
)
from baton.loader import load_tokenizer  # noqa: E402
from baton.serve import Stack  # noqa: E402


def ask(client: Client, rid: str, ids: list[int], max_tokens: int, out: list[dict], kind: str,
        t_start: float) -> None:
    req = generate_request(prompt_token_ids=ids, request_id=rid,
                           sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    t0 = time.perf_counter()
    first = None
    try:
        for msg in client.stream(req, timeout=900):
            if first is None and msg.token_ids:
                first = time.perf_counter() - t0
        out.append({"id": rid, "kind": kind, "sent_at_s": t0 - t_start, "ttft_s": first,
                    "e2e_s": time.perf_counter() - t0, "prompt_tokens": len(ids)})
    except grpc.RpcError as e:
        out.append({"id": rid, "kind": kind, "error": f"{e.code().name}: {e.details()}"})


def workload(tok, args) -> list[tuple[float, str, str, list[int]]]:
    """(send time, id, kind, prompt ids), the same for every setting."""
    rng = random.Random(args.seed)
    items, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            break
        items.append((t, f"short-{i}", "short", tok.encode(f"Request {i}: name a color and a fruit, then say why "
                                                             f"they go together in one sentence.")))
        i += 1
    vocab = tok.vocab_size
    for j, t in enumerate(np.arange(1.0, args.duration, args.long_every)):
        ids = [rng.randrange(1000, vocab) for _ in range(args.long_tokens)]
        items.append((float(t), f"long-{j}", "long", ids))
    return sorted(items)


def run_setting(chunked: bool, order: str, items, args) -> dict:
    engine = EngineConfig(kv_cache_memory=1 << 30, enable_chunked_prefill=chunked, prefill_chunk=args.prefill_chunk,
                          max_num_batched_tokens=args.max_batched_tokens, prefill_order=order)
    stack = Stack(ServeConfig(engine=engine, port=0, threads_per_worker=args.threads_per_worker,
                              metrics_port=None, http_port=None)).start()
    out: list[dict] = []
    try:
        with Client(stack.address) as client:
            ask(client, "warmup", items[0][3][:32], 2, [], "warmup", 0.0)
            t_start = time.perf_counter()
            threads = []
            for t, rid, kind, ids in items:
                delay = t_start + t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                th = threading.Thread(target=ask, args=(client, rid, ids, 1 if kind == "long" else args.max_tokens,
                                                        out, kind, t_start))
                th.start()
                threads.append(th)
            for th in threads:
                th.join()
    finally:
        stack.stop()
    short = [r["ttft_s"] for r in out if r["kind"] == "short" and "error" not in r]
    long = [r["ttft_s"] for r in out if r["kind"] == "long" and "error" not in r]
    errors = [r for r in out if "error" in r]
    return {"chunked": chunked, "prefill_order": order, "short_requests": len(short), "errors": errors,
            "short_ttft_p50_s": percentile(short, 50), "short_ttft_p95_s": percentile(short, 95),
            "short_ttft_max_s": max(short), "long_ttft_s": long, "requests": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--rate", type=float, default=0.5, help="short prompts per second (Poisson)")
    ap.add_argument("--long-every", type=float, default=40.0, help="seconds between long prompts")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens of each short prompt")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="most tokens of one prompt per pass (chunked)")
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--threads-per-worker", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench-results/chunked_prefill.json")
    args = ap.parse_args()

    tok = load_tokenizer(None)
    items = workload(tok, args)
    n_long = sum(1 for i in items if i[2] == "long")
    print(f"{len(items) - n_long} short prompts at {args.rate}/s and {n_long} prompts of {args.long_tokens} tokens "
          f"over {args.duration:.0f} s, per setting", flush=True)
    results = []
    for chunked, order in ((True, "arrival"), (False, "arrival"), (True, "shortest")):
        r = run_setting(chunked, order, items, args)
        results.append(r)
        print(f"chunked prefill {'on ' if chunked else 'off'}, {order:8s} first: short TTFT p50 "
              f"{r['short_ttft_p50_s']:.3f} s, p95 {r['short_ttft_p95_s']:.3f} s, max {r['short_ttft_max_s']:.3f} s; "
              f"long TTFT {', '.join(f'{x:.1f}' for x in r['long_ttft_s'])} s; errors {len(r['errors'])}", flush=True)
    on, off, shortest = results
    print(f"short TTFT p95, off / on: {off['short_ttft_p95_s'] / on['short_ttft_p95_s']:.2f}x; "
          f"arrival / shortest first (both chunked): {on['short_ttft_p95_s'] / shortest['short_ttft_p95_s']:.2f}x")
    out = {"args": vars(args), "machine": {"platform": platform.platform(), "python": platform.python_version()},
           "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
