"""The HTTP API against gRPC on one running stack: output tokens/s and TTFT at a fixed concurrency.

Starts `baton serve` (gRPC and the OpenAI-compatible HTTP API over the same router and workers), then
runs `baton bench` against grpc://... and http://... in turn, --rounds times each (grpc, http, grpc,
http, ...), so that drift of a shared machine hits both alike. Every round uses the same workload and
seed. The report gives each round's figures, the medians, the tokens/s ratio (HTTP / gRPC) and the TTFT
p50 difference (HTTP - gRPC).

    .venv/bin/python benchmarks/http_vs_grpc.py [--concurrency 16] [--requests 160] [--warmup 16]
        [--rounds 3] [--weights q4] [--prompt-tokens N|MIN:MAX] [--output-tokens N]
        [--json bench-results/http_vs_grpc.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _serve import served  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="q4", help="baton serve --weights")
    ap.add_argument("--prompt-tokens", default=None, help="baton bench --prompt-tokens (default: its default)")
    ap.add_argument("--output-tokens", default=None, help="baton bench --output-tokens (default: its default)")
    ap.add_argument("--json", default="bench-results/http_vs_grpc.json")
    args = ap.parse_args()

    sizes = [arg for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--output-tokens", args.output_tokens))
             if value is not None for arg in (flag, value)]
    rounds: list[dict] = []
    with served(args.weights, http=True) as serve:
        grpc_address, http_port = serve.grpc_address, serve.http_port
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for target in (f"grpc://{grpc_address}", f"http://127.0.0.1:{http_port}"):
                    out = Path(tmp) / f"{r}-{target.split(':')[0]}.json"
                    subprocess.run([sys.executable, "-m", "baton.cli", "bench", "--target", target,
                                    "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                                    "--warmup", str(args.warmup), *sizes, "--json", str(out), "--plots", tmp],
                                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                                   env={**os.environ, "MPLBACKEND": "Agg"})
                    s = json.loads(out.read_text())["levels"][0]["stats"]
                    row = {"round": r, "api": target.split(":")[0], "output_tokens_per_s": s["output_tokens_per_s"],
                           "ttft_p50_s": s["ttft_s_p50"], "ttft_p95_s": s["ttft_s_p95"], "tpot_p50_s": s["tpot_s_p50"],
                           "errors": s["errors"]}
                    rounds.append(row)
                    print(f"round {r} {row['api']:>4}: {row['output_tokens_per_s']:7.1f} tok/s  "
                          f"TTFT p50 {row['ttft_p50_s'] * 1e3:6.1f} ms  p95 {row['ttft_p95_s'] * 1e3:6.1f} ms  "
                          f"TPOT p50 {row['tpot_p50_s'] * 1e3:5.1f} ms  errors {row['errors'] or 0}", flush=True)

    def median(api: str, key: str) -> float:
        return statistics.median(x[key] for x in rounds if x["api"] == api)

    summary = {"grpc_tokens_per_s": median("grpc", "output_tokens_per_s"),
               "http_tokens_per_s": median("http", "output_tokens_per_s"),
               "grpc_ttft_p50_s": median("grpc", "ttft_p50_s"), "http_ttft_p50_s": median("http", "ttft_p50_s")}
    summary["tokens_per_s_ratio"] = summary["http_tokens_per_s"] / summary["grpc_tokens_per_s"]
    summary["ttft_p50_difference_s"] = summary["http_ttft_p50_s"] - summary["grpc_ttft_p50_s"]
    per_round = [next(x for x in rounds if x["round"] == r and x["api"] == "http")["output_tokens_per_s"]
                 / next(x for x in rounds if x["round"] == r and x["api"] == "grpc")["output_tokens_per_s"]
                 for r in range(args.rounds)]
    print(f"medians: gRPC {summary['grpc_tokens_per_s']:.1f} tok/s, HTTP {summary['http_tokens_per_s']:.1f} tok/s "
          f"(HTTP/gRPC {summary['tokens_per_s_ratio']:.3f}; per round {', '.join(f'{x:.3f}' for x in per_round)}); "
          f"TTFT p50 gRPC {summary['grpc_ttft_p50_s'] * 1e3:.1f} ms, HTTP {summary['http_ttft_p50_s'] * 1e3:.1f} ms "
          f"(HTTP - gRPC {summary['ttft_p50_difference_s'] * 1e3:+.1f} ms)")
    path = ROOT / args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "rounds": rounds, "per_round_ratio": per_round,
                                "summary": summary}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
