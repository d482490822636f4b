"""Latency of the disaggregated stack over gRPC against the single-process engine, in one run.

The same chat requests (greedy, EOS ignored so every request produces exactly --max-tokens tokens)
go through the stack (router + 1 prefill worker + 1 decode worker on Ray) from N closed-loop client
threads, and then through one LLMEngine in this process with the same cap of N requests in flight.
Per level it reports TTFT and TPOT (p50/p95), end-to-end latency and output tokens/s. It also reports
the KV hand-off bandwidth (bytes/s per hand-off, from the decode worker's stats) against the
machine's memcpy bandwidth.

The two sides never run at the same time: the stack is measured first and stopped before the
single-process engine is loaded, so they do not compete for the cores.

    .venv/bin/python benchmarks/serve_latency.py [--concurrency 1,4,16] [--requests-per-level 16]
        [--max-tokens 32] [--dtype auto] [--json bench-results/serve_latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from baton.api import SamplingParams  # noqa: E402
from baton.api.client import Client, generate_request  # noqa: E402
from baton.bench.report import percentile  # noqa: E402
from baton.config import (
    EngineConfig,  # noqa: E402
    ServeConfig,  # noqa: E402
)
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.serve import Stack  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about autumn leaves.",
    "Explain how a bicycle stays upright.", "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?", "Describe the water cycle.",
    "Why do cats purr?", "Summarize the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?", "Name three famous paintings and their painters.",
    "What causes the seasons on Earth?", "Write a haiku about the sea.",
    "Explain what a prime number is to a child.", "What are the benefits of regular exercise?",
    "How do airplanes generate lift?", "Suggest a name for a friendly robot and explain why.",
]
KV_CACHE_MEMORY = 256 << 20  # per engine; plenty for 16 x (prompt + 32) tokens of the default model
RPC_TIMEOUT_S = 600.0


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes copied per second by one contiguous numpy copy (a memcpy) far larger than the caches;
    best of several, after one copy that faults in the destination's pages."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def questions_for(level: int, n: int) -> list[tuple[str, str]]:
    """(request id, question) for one level. The tag in front keeps levels from sharing cached
    prefix blocks beyond the chat template's header, on both sides alike."""
    return [(f"c{level}-{i}", f"[{level}.{i}] {QUESTIONS[i % len(QUESTIONS)]}") for i in range(n)]


def summarize(records: list[dict], wall_s: float) -> dict:
    ttft = [r["ttft_s"] for r in records]
    tpot = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    e2e = [r["e2e_s"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "output_tokens": tokens, "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p95_s": percentile(tpot, 95),
            "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95)}


def record(rid: str, sent: float, first: float | None, last: float | None, done: float, token_ids: list[int]
           ) -> dict:
    if first is None or last is None:
        raise RuntimeError(f"request {rid} produced no tokens")
    n = len(token_ids)
    return {"id": rid, "tokens": n, "ttft_s": first - sent, "e2e_s": done - sent,
            "tpot_s": (last - first) / (n - 1) if n > 1 else None, "token_ids": token_ids}


# -- the stack, over gRPC -------------------------------------------------------------------------------------


def stream_one(client: Client, rid: str, question: str, max_tokens: int) -> dict:
    req = generate_request(messages=[{"role": "user", "content": question}], request_id=rid,
                           sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    ids: list[int] = []
    first = last = None
    sent = time.perf_counter()
    for msg in client.stream(req, timeout=RPC_TIMEOUT_S):
        if msg.token_ids:
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            ids += msg.token_ids
    return record(rid, sent, first, last, time.perf_counter(), ids)


def run_stack_level(client: Client, work: list[tuple[str, str]], concurrency: int,
                    max_tokens: int) -> tuple[list[dict], float]:
    """Closed loop: ``concurrency`` client threads, each sending its next request when the last ends."""
    todo = iter(work)
    lock = threading.Lock()
    records: list[dict] = []
    errors: list[BaseException] = []

    def user() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None or errors:
                return
            try:
                r = stream_one(client, item[0], item[1], max_tokens)
            except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
                with lock:
                    errors.append(e)
                return
            with lock:
                records.append(r)

    threads = [threading.Thread(target=user, name=f"client-{i}") for i in range(min(concurrency, len(work)))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"a stack request failed: {errors[0]}") from errors[0]
    return records, wall


def decode_stats(stack: Stack) -> dict:
    stats = ray.get([a.stats.remote() for a in stack.decode])
    return {k: sum(s[k] for s in stats) for k in ("handoffs", "kv_bytes_received", "kv_seconds")}


def bench_stack(config: EngineConfig, levels: list[int], n: int, max_tokens: int) -> tuple[dict, dict]:
    t = time.perf_counter()
    stack = Stack(ServeConfig(engine=config, port=0, metrics_port=None, http_port=None)).start()
    print(f"stack up in {time.perf_counter() - t:.1f} s at {stack.address} (1 prefill + 1 decode worker, "
          f"{stack.config.threads_per_worker or max(1, (os.cpu_count() or 1) // 2)} torch thread(s) each)",
          flush=True)
    try:
        with Client(stack.address) as client:
            run_stack_level(client, [(f"warm-{i}", q) for i, q in enumerate(QUESTIONS[:2])], 2, 4)
            before = decode_stats(stack)
            rows = {}
            for c in levels:
                records, wall = run_stack_level(client, questions_for(c, n), c, max_tokens)
                rows[c] = {"summary": summarize(records, wall), "requests": records}
                print(f"  stack     concurrency {c:>3}: {rows[c]['summary']['tokens_per_s']:.1f} tok/s", flush=True)
            after = decode_stats(stack)
    finally:
        stack.stop()
    return rows, {k: after[k] - before[k] for k in after}


# -- the single-process engine ---------------------------------------------------------------------------------


def run_engine_level(engine: LLMEngine, work: list[tuple[str, list[int]]], concurrency: int, max_tokens: int
                     ) -> tuple[list[dict], float]:
    """Keep ``concurrency`` requests in flight; a new one is added as soon as one finishes. Token times
    are the times the step that produced them returned."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo = iter(work)
    live: dict[str, dict] = {}
    records: list[dict] = []

    def add_next() -> None:
        item = next(todo, None)
        if item is not None:
            rid = engine.add_request(item[1], params, request_id=item[0])
            live[rid] = {"sent": time.perf_counter(), "first": None, "last": None, "ids": []}

    t0 = time.perf_counter()
    for _ in range(concurrency):
        add_next()
    while live:
        outs = engine.step()
        now = time.perf_counter()
        finished = []
        for out in outs:
            st = live[out.request_id]
            if out.token_ids:
                st["first"] = st["first"] if st["first"] is not None else now
                st["last"] = now
                st["ids"] += out.token_ids
            if out.finished:
                finished.append(out.request_id)
        for rid in finished:
            st = live.pop(rid)
            records.append(record(rid, st["sent"], st["first"], st["last"], now, st["ids"]))
            add_next()
    return records, time.perf_counter() - t0


def bench_engine(config: EngineConfig, levels: list[int], n: int, max_tokens: int) -> tuple[dict, LLMEngine]:
    engine = LLMEngine(config)
    tok = engine.tokenizer

    def chat(work: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
        return [(rid, tok.encode_chat([{"role": "user", "content": q}])) for rid, q in work]

    run_engine_level(engine, chat([(f"warm-{i}", q) for i, q in enumerate(QUESTIONS[:2])]), 2, 4)
    rows = {}
    for c in levels:
        records, wall = run_engine_level(engine, chat(questions_for(c, n)), c, max_tokens)
        rows[c] = {"summary": summarize(records, wall), "requests": records}
        print(f"  1-process concurrency {c:>3}: {rows[c]['summary']['tokens_per_s']:.1f} tok/s", flush=True)
    return rows, engine


# -- report ---------------------------------------------------------------------------------------------------


def ms(x: float | None) -> str:
    return f"{1e3 * x:.1f}" if x is not None else "-"


def print_table(levels: list[int], stack_rows: dict, engine_rows: dict) -> None:
    head = (f"{'conc':>4} {'side':<9} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'TPOT p95':>9} "
            f"{'e2e p50':>9} {'e2e p95':>9} {'tok/s':>8}")
    print("\nlatencies in ms")
    print(head)
    print("-" * len(head))
    for c in levels:
        for side, rows in (("stack", stack_rows), ("1-process", engine_rows)):
            s = rows[c]["summary"]
            print(f"{c:>4} {side:<9} {ms(s['ttft_p50_s']):>9} {ms(s['ttft_p95_s']):>9} {ms(s['tpot_p50_s']):>9} "
                  f"{ms(s['tpot_p95_s']):>9} {ms(s['e2e_p50_s']):>9} {ms(s['e2e_p95_s']):>9} "
                  f"{s['tokens_per_s']:>8.1f}")
        ratio = stack_rows[c]["summary"]["tokens_per_s"] / engine_rows[c]["summary"]["tokens_per_s"]
        print(f"{'':>4} {'ratio':<9} {'stack / 1-process throughput':>39} {ratio:>.2f}")


def same_outputs(levels: list[int], stack_rows: dict, engine_rows: dict) -> tuple[int, int]:
    """How many requests got the same greedy tokens on both sides (batching may move near-ties)."""
    same = total = 0
    for c in levels:
        theirs = {r["id"]: r["token_ids"] for r in engine_rows[c]["requests"]}
        for r in stack_rows[c]["requests"]:
            total += 1
            same += r["token_ids"] == theirs.get(r["id"])
    return same, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts, e.g. 1,4,16")
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default="bench-results/serve_latency.json")
    args = ap.parse_args()
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency takes comma-separated integers, got {args.concurrency!r}")
    if any(c < 1 for c in levels) or args.requests_per_level < 1 or args.max_tokens < 2:
        ap.error("concurrency levels and --requests-per-level must be >= 1, --max-tokens >= 2 (for TPOT)")
    n, max_tokens = args.requests_per_level, args.max_tokens
    config = EngineConfig(dtype=args.dtype, kv_cache_memory=KV_CACHE_MEMORY, max_num_seqs=max(levels))

    copy_bw = memcpy_bandwidth()
    print(f"cpu {platform.processor() or platform.machine()}, {os.cpu_count()} cores; memcpy {copy_bw / 1e9:.2f} GB/s "
          f"(numpy copy of 256 MiB, best of 5)")
    print(f"{n} requests per level, {max_tokens} output tokens each (greedy, EOS ignored), "
          f"concurrency {','.join(map(str, levels))}")
    print("measuring the stack first; it is stopped before the single-process engine is loaded, so the "
          "two never compete for the cores", flush=True)

    stack_rows, kv = bench_stack(config, levels, n, max_tokens)
    engine_rows, engine = bench_engine(config, levels, n, max_tokens)
    print(f"single-process engine: dtype {engine.dtype}, {torch.get_num_threads()} torch thread(s)")

    print_table(levels, stack_rows, engine_rows)
    same, total = same_outputs(levels, stack_rows, engine_rows)
    print(f"\nidentical greedy outputs on both sides: {same}/{total} requests")

    handoffs, nbytes, secs = kv["handoffs"], kv["kv_bytes_received"], kv["kv_seconds"]
    per_handoff = nbytes / handoffs if handoffs else None
    handoff_bw = nbytes / secs if secs > 0 else None
    if handoffs:
        print(f"KV hand-off: {handoffs} hand-offs, {per_handoff / 1e6:.2f} MB each on average, "
              f"{1e3 * secs / handoffs:.2f} ms each -> {handoff_bw / 1e9:.3f} GB/s per hand-off "
              f"= {handoff_bw / copy_bw:.4f} x memcpy ({copy_bw / 1e9:.2f} GB/s)")
    else:
        print("KV hand-off: the decode worker reported no hand-offs")

    result = {
        "config": {"concurrency": levels, "requests_per_level": n, "max_tokens": max_tokens,
                   "dtype": str(engine.dtype), "kv_cache_memory": KV_CACHE_MEMORY, "cores": os.cpu_count(),
                   "single_process_threads": torch.get_num_threads(),
                   "order": "stack first, stopped before the single-process engine was loaded"},
        "memcpy_GBps": copy_bw / 1e9,
        "handoff": {"handoffs": handoffs, "kv_bytes": nbytes, "kv_seconds": secs,
                    "bytes_per_handoff": per_handoff, "seconds_per_handoff": secs / handoffs if handoffs else None,
                    "bytes_per_s_per_handoff": handoff_bw,
                    "over_memcpy": handoff_bw / copy_bw if handoff_bw else None},
        "identical_outputs": {"same": same, "total": total},
        "levels": [{"concurrency": c, "stack": stack_rows[c], "single_process": engine_rows[c],
                    "throughput_ratio": stack_rows[c]["summary"]["tokens_per_s"]
                    / engine_rows[c]["summary"]["tokens_per_s"]} for c in levels],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
