"""Soak: faults under load for a chosen duration, then a check that everything went back to idle.

A stack of --prefill and --decode workers (local Ray, in-memory prefix index) takes load from
--clients closed-loop clients (greedy, EOS ignored, --max-tokens each, deadline --deadline s) while a
random worker is killed every --kill-every seconds (the autoscaler replaces it). At the end it waits
for the stack to drain and reports: requests sent, completed, failed by status, hung (a client call
that outlived its deadline: must be 0), KV blocks in use on every worker and objects in Ray's object
store (both must be back to 0).

    .venv/bin/python benchmarks/soak.py [--duration 120] [--clients 6] [--kill-every 20] [--prefill 2]
        [--decode 2] [--json bench-results/soak.json]
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

from baton.api.client import Client, generate_request  # noqa: E402
from baton.config import (
    EngineConfig,  # noqa: E402
    ServeConfig,  # noqa: E402
)
from baton.serve import Stack  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench-results/soak.json")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    stack = Stack(ServeConfig(engine=EngineConfig(kv_cache_memory=256 << 20), port=0, prefill=args.prefill,
                              decode=args.decode, redis_url="memory", metrics_port=None, http_port=None)).start()
    outcomes: Counter = Counter()
    hung = 0
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
                    req = generate_request(f"Client {k}, request {i}: tell me something.",
                                           sampling={"max_tokens": args.max_tokens, "temperature": 0,
                                                     "ignore_eos": True})
                    try:
                        n = sum(len(m.token_ids) for m in api.stream(req, timeout=args.deadline))
                        status = "OK" if n == args.max_tokens else f"SHORT({n})"
                    except grpc.RpcError as e:
                        status = e.code().name
                    with lock:
                        outcomes[status] += 1
                        hung += time.monotonic() - start > args.deadline + 5
                    i += 1

            threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
            for t in threads:
                t.start()
            next_kill = args.kill_every
            while time.monotonic() - t0 < args.duration:
                time.sleep(0.5)
                if time.monotonic() - t0 >= next_kill:
                    pool = rng.choice(["prefill", "decode"])
                    handles = list(stack.prefill if pool == "prefill" else stack.decode)
                    if len(handles) > 1:
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
        events = [list(e) for e in stack.autoscaler.events]
    finally:
        stack.stop()
    report = {"args": vars(args), "sent": sum(outcomes.values()), "completed": outcomes.get("OK", 0),
              "failed": {k: v for k, v in outcomes.items() if k != "OK"}, "hung": hung, "kills": kills,
              "autoscaler_events": events, "kv_blocks_in_use_at_end": blocks_in_use,
              "kv_exports_at_end": exports, "object_store_objects_at_end": objects}
    print(json.dumps({k: v for k, v in report.items() if k not in ("args", "autoscaler_events")}, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0 if hung == 0 and blocks_in_use == 0 and exports == 0 and objects == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
