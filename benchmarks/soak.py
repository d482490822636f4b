"""Soak: faults under load for a chosen duration, then a check that nothing was lost and everything went back
to idle.

A stack of --prefill and --decode workers (local Ray, in-memory prefix index) takes load from
--clients closed-loop clients (greedy, EOS ignored, --max-tokens each, deadline --deadline s) while a
random worker of --kill pools is killed every --kill-every seconds, the only one of its pool too (the
autoscaler replaces it; the router moves the requests it held). At the end it waits for the stack to drain,
asks --check of the completed prompts again with nothing killed and reports: requests sent, completed with all
their tokens, lost (failed by status, or short), hung (a client call that outlived its deadline), migrations
by cause and the time they added, how many of the re-asked answers are token-identical to the first, KV
blocks in use on every worker and objects in Ray's object store. Exit status 0 when nothing was lost or hung
and everything is back to 0.

    .venv/bin/python benchmarks/soak.py [--duration 90] [--clients 8] [--kill-every 20] [--prefill 2]
        [--decode 2] [--kill prefill,decode] [--check 40] [--json bench-results/soak.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import ray  # noqa: E402

from baton import metrics  # noqa: E402
from baton.api.client import Client, generate_request  # noqa: E402
from baton.config import (
    EngineConfig,  # noqa: E402
    ServeConfig,  # noqa: E402
)
from baton.serve import Stack  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill", default="prefill,decode", help="pools whose workers are killed (comma-separated)")
    ap.add_argument("--check", type=int, default=40, help="completed prompts asked again undisturbed at the end")
    ap.add_argument("--json", default="bench-results/soak.json")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    stack = Stack(ServeConfig(engine=EngineConfig(kv_cache_memory=256 << 20), port=0, prefill=args.prefill,
                              decode=args.decode, redis_url="memory", metrics_port=None, http_port=None)).start()
    outcomes: Counter = Counter()
    answers: dict[str, list[int]] = {}  # prompt -> the tokens of its completed request
    hung = 0
    pools = [k.strip() for k in args.kill.split(",") if k.strip()]
    moves_before = {c: metrics.sample(metrics.MIGRATIONS, cause=c) for c in metrics.MIGRATION_CAUSES}
    move_time_before = (metrics.sample(metrics.MIGRATION_TIME, "_sum"),
                        metrics.sample(metrics.MIGRATION_TIME, "_count"))
    kills: list[tuple[float, str]] = []
    lock = threading.Lock()
    stop = threading.Event()
    t0 = time.monotonic()
    try:
        with Client(stack.address) as api:

            def client(k: int) -> None:
                nonlocal hung
                i = 0
                while not stop.is_set():
                    start = time.monotonic()
                    prompt = f"Client {k}, request {i}: tell me something."
                    tokens: list[int] = []
                    try:
                        for m in api.stream(_request(prompt, args.max_tokens), timeout=args.deadline):
                            tokens += m.token_ids
                        status = "OK" if len(tokens) == args.max_tokens else f"SHORT({len(tokens)})"
                    except grpc.RpcError as e:
                        status = e.code().name
                    with lock:
                        outcomes[status] += 1
                        if status == "OK":
                            answers[prompt] = tokens
                        hung += time.monotonic() - start > args.deadline + 5
                    i += 1

            threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
            for t in threads:
                t.start()
            next_kill = args.kill_every
            while time.monotonic() - t0 < args.duration:
                time.sleep(0.5)
                if time.monotonic() - t0 >= next_kill:
                    pool = rng.choice(pools)
                    handles = list(stack.prefill if pool == "prefill" else stack.decode)
                    if handles:
                        victim = rng.choice(handles)
                        kills.append((time.monotonic() - t0, stack.names.get(victim, "?")))
                        print(f"{kills[-1][0]:6.1f} s: killing {kills[-1][1]}", flush=True)
                        ray.kill(victim, no_restart=True)
                    next_kill += args.kill_every
                done = sum(outcomes.values())
                if int(time.monotonic() - t0) % 10 == 0:
                    print(f"{time.monotonic() - t0:6.1f} s: {done} requests, {dict(outcomes)}", flush=True)
            stop.set()
            for t in threads:
                t.join(timeout=args.deadline + 10)
            hung += sum(t.is_alive() for t in threads)
        # Back to idle: every worker's blocks free, no KV held, the object store empty.
        deadline = time.monotonic() + 60
        while True:
            stats = []
            for h in stack.prefill + stack.decode:
                try:
                    stats.append(ray.get(h.stats.remote(), timeout=10))
                except Exception:  # noqa: BLE001 - a worker still starting or just killed
                    continue
            blocks_in_use = sum(s["num_blocks"] - s["free_blocks"] for s in stats)
            exports = sum(s.get("exports", 0) for s in stats)
            from ray._private.internal_api import memory_summary

            summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
            objects = int(re.search(r"(\d+) objects", summary).group(1))
            if (blocks_in_use == 0 and exports == 0 and objects == 0) or time.monotonic() > deadline:
                break
            time.sleep(1)
        # The same prompts again, nothing killed now: greedy answers must be the same tokens.
        checked = rng.sample(sorted(answers), min(args.check, len(answers)))
        differing = []
        with Client(stack.address) as api:
            for prompt in checked:
                again = [t for m in api.stream(_request(prompt, args.max_tokens), timeout=args.deadline)
                         for t in m.token_ids]
                if again != answers[prompt]:
                    first = next((i for i, (a, b) in enumerate(zip(again, answers[prompt])) if a != b), None)
                    differing.append({"prompt": prompt, "first_difference": first})
        events = [list(e) for e in stack.autoscaler.events]
    finally:
        stack.stop()
    moves = {c: metrics.sample(metrics.MIGRATIONS, cause=c) - moves_before[c] for c in metrics.MIGRATION_CAUSES}
    move_seconds = metrics.sample(metrics.MIGRATION_TIME, "_sum") - move_time_before[0]
    move_count = metrics.sample(metrics.MIGRATION_TIME, "_count") - move_time_before[1]
    lost = sum(v for k, v in outcomes.items() if k != "OK")
    report = {"args": vars(args), "sent": sum(outcomes.values()), "completed": outcomes.get("OK", 0), "lost": lost,
              "failed": {k: v for k, v in outcomes.items() if k != "OK"}, "hung": hung, "kills": kills,
              "migrations": {k: int(v) for k, v in moves.items() if v},
              "migration_mean_seconds": round(move_seconds / move_count, 3) if move_count else None,
              "rechecked": len(checked), "identical": len(checked) - len(differing), "differing": differing,
              "autoscaler_events": events, "kv_blocks_in_use_at_end": blocks_in_use,
              "kv_exports_at_end": exports, "object_store_objects_at_end": objects}
    print(json.dumps({k: v for k, v in report.items() if k not in ("args", "autoscaler_events")}, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0 if lost == 0 and hung == 0 and blocks_in_use == 0 and exports == 0 and objects == 0 else 1


def _request(prompt: str, max_tokens: int):
    return generate_request(prompt, sampling={"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


if __name__ == "__main__":
    sys.exit(main())
