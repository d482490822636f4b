"""Memory and start-up of the default stack: what `baton serve` holds (PSS summed over every process of the stack,
Ray's daemons and Redis included; RSS beside it), each worker's breakdown, what one more decode worker costs,
and the time from starting `baton serve` to serving.

Each round starts the stack with each --decode-counts value (one more decode worker than the default gives its
cost) and sends --requests requests before measuring. With --baseline DIR, another checkout of Baton (run from
its own source, with this Python) is measured in the same rounds, alternating, so that both see the same load.

    .venv/bin/python benchmarks/memory_startup.py [--rounds 3] [--requests 16] [--decode-counts 1,2]
        [--baseline DIR] [--json bench-results/memory_startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.api.client import Client, generate_request  # noqa: E402
from baton.memory import process_tree_memory  # noqa: E402
from baton.services.redis_server import free_port  # noqa: E402

MIB = 2**20


def _tree_memory(pid: int) -> dict:
    tree = process_tree_memory(pid)
    return {"processes": tree["processes"], "rss_mib": tree["rss"] / MIB, "pss_mib": tree["pss"] / MIB}


def _has_verbose(tree: Path) -> bool:
    r = subprocess.run([sys.executable, "-m", "baton.cli", "serve", "--help"], cwd=tree, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return "--verbose" in r.stdout


def run_once(tree: Path, decode: int, requests: int, verbose: bool) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "baton.cli", "serve", "--port", str(port), "--metrics-port", "-1",
            "--http-port", "-1", "--decode", str(decode), *(["--verbose"] if verbose else [])]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    began = time.monotonic()
    proc = subprocess.Popen(argv, cwd=tree, env={**env, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    serving = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "serving baton.v1.Generation on" in line:
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not serving.wait(0.2):
            if proc.poll() is not None:
                raise SystemExit(f"baton serve exited with {proc.returncode}:\n" + "\n".join(lines[-30:]))
        to_serving = time.monotonic() - began
        address = f"127.0.0.1:{port}"

        def one(i: int) -> int:
            with Client(address) as c:
                done = c.complete(generate_request(f"Tell me about the number {i}.",
                                                   sampling={"max_tokens": 32, "temperature": 0}), timeout=300)
            return len(done.token_ids)

        with ThreadPoolExecutor(4) as pool:
            tokens = sum(pool.map(one, range(requests)))
        time.sleep(1.0)
        memory = _tree_memory(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=5)
    breakdown = [line.removeprefix("baton: ") for line in lines if line.startswith("baton: memory of")]
    started = next((float(m.group(1)) for line in lines if (m := re.search(r"started in ([\d.]+) s", line))), None)
    return {"decode": decode, "to_serving_s": to_serving, "started_in_s": started, "tokens": tokens, **memory,
            "breakdown": breakdown}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="requests served before measuring (4 at a time)")
    ap.add_argument("--decode-counts", default="1,2", help="decode workers of each stack started in a round")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout of Baton to measure beside")
    ap.add_argument("--json", type=Path, default=Path("bench-results/memory_startup.json"))
    args = ap.parse_args()
    counts = [int(x) for x in args.decode_counts.split(",")]
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    verbose = {name: _has_verbose(tree) for name, tree in trees.items()}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            for decode in counts:
                run = run_once(tree, decode, args.requests, verbose[name])
                runs[name].append(run)
                print(f"round {r} {name:8s} decode={decode}: serving after {run['to_serving_s']:.1f} s; "
                      f"{run['processes']} processes, PSS {run['pss_mib']:.0f} MiB, RSS {run['rss_mib']:.0f} MiB",
                      flush=True)
                for line in run["breakdown"]:
                    print(f"    {line}", flush=True)
    summary = {}
    for name in trees:
        s: dict = {}
        for decode in counts:
            mine = [x for x in runs[name] if x["decode"] == decode]
            s[f"decode{decode}"] = {"to_serving_s_median": statistics.median(x["to_serving_s"] for x in mine),
                                    "pss_mib_median": statistics.median(x["pss_mib"] for x in mine),
                                    "rss_mib_median": statistics.median(x["rss_mib"] for x in mine),
                                    "processes": mine[-1]["processes"]}
        if len(counts) > 1:
            a, b = s[f"decode{counts[0]}"], s[f"decode{counts[1]}"]
            s["extra_decode_worker_pss_mib"] = (b["pss_mib_median"] - a["pss_mib_median"]) / (counts[1] - counts[0])
        summary[name] = s
        d = s[f"decode{counts[0]}"]
        extra = (f"; one more decode worker: +{s['extra_decode_worker_pss_mib']:.0f} MiB PSS"
                 if "extra_decode_worker_pss_mib" in s else "")
        print(f"{name}: {counts[0]} decode: serving after {d['to_serving_s_median']:.1f} s (median), PSS "
              f"{d['pss_mib_median']:.0f} MiB, RSS {d['rss_mib_median']:.0f} MiB{extra}", flush=True)
    if "baseline" in summary:
        key = f"decode{counts[0]}"
        this, base = summary["this"][key], summary["baseline"][key]
        print(f"this / baseline: PSS {this['pss_mib_median'] / base['pss_mib_median']:.2f}, time to serving "
              f"{this['to_serving_s_median'] / base['to_serving_s_median']:.2f}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": runs, "summary": summary, "requests": args.requests}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
