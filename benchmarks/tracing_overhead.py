"""Tracing on against off: throughput of the stack at a fixed concurrency, in one run.

The same requests (greedy, EOS ignored, --max-tokens each) go from --concurrency closed-loop clients
to a stack with tracing off, then to a fresh stack exporting every span by OTLP/gRPC to a receiver in
this process (the collector's trace service, which counts spans and drops them). The two settings
alternate --rounds times (off, on, off, on, ...) so that drift of a shared machine hits both alike;
the report gives output tokens/s of each round, the medians and their ratio.

    .venv/bin/python benchmarks/tracing_overhead.py [--concurrency 16] [--requests 48] [--max-tokens 32]
        [--rounds 2] [--json bench-results/tracing_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import ray  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from baton.api.client import Client, generate_request  # noqa: E402
from baton.config import (
    EngineConfig,  # noqa: E402
    ServeConfig,  # noqa: E402
)
from baton.serve import Stack  # noqa: E402


class CountingReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def load(client: Client, n: int, concurrency: int, max_tokens: int, tag: str) -> tuple[int, float]:
    todo = iter(range(n))
    lock = threading.Lock()
    tokens = 0

    def user() -> None:
        nonlocal tokens
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            req = generate_request(f"[{tag} {i}] Write a few words about the number {i}.",
                                   sampling={"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            got = sum(len(m.token_ids) for m in client.stream(req, timeout=600))
            with lock:
                tokens += got

    threads = [threading.Thread(target=user) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens, time.perf_counter() - t0


def run(endpoint: str | None, args, tag: str) -> dict:
    cfg = ServeConfig(engine=EngineConfig(kv_cache_memory=256 << 20), port=0, otlp_endpoint=endpoint,
                      metrics_port=None, http_port=None)
    stack = Stack(cfg).start()
    try:
        with Client(stack.address) as client:
            load(client, 4, 4, 4, f"{tag}-warm")
            tokens, wall = load(client, args.requests, args.concurrency, args.max_tokens, tag)
    finally:
        stack.stop()
    return {"tracing": endpoint is not None, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="bench-results/tracing_overhead.json")
    args = ap.parse_args()

    # One Ray for every stack of the run, started before any gRPC server of this process: Ray forks its
    # processes, and a fork beside a running gRPC server can leave the new node unable to start.
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    receiver = CountingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    rounds = []
    try:
        for r in range(args.rounds):
            for traced in (False, True):
                row = run(endpoint if traced else None, args, f"r{r}-{'on' if traced else 'off'}")
                rounds.append(row)
                print(f"round {r} tracing {'on ' if traced else 'off'}: {row['tokens_per_s']:.1f} output tokens/s "
                      f"({row['tokens']} tokens in {row['wall_s']:.1f} s)", flush=True)
    finally:
        server.stop(0)
        ray.shutdown()
    off = statistics.median(r["tokens_per_s"] for r in rounds if not r["tracing"])
    on = statistics.median(r["tokens_per_s"] for r in rounds if r["tracing"])
    print(f"median tokens/s: off {off:.1f}, on {on:.1f}; on / off = {on / off:.3f}; "
          f"spans received {receiver.spans}")
    out = {"args": vars(args), "machine": {"platform": platform.platform(), "python": platform.python_version()},
           "rounds": rounds, "median_off": off, "median_on": on, "on_over_off": on / off,
           "spans_received": receiver.spans}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
