"""LoRA's cost under load: output tokens/s of N clients spread over several adapters, against N clients on the
base model, on one `baton serve` started with the adapters.

The adapters are PEFT folders written here (random A and B of --rank on every projection the model has, or on
--targets), so nothing is fetched. Each round runs both modes one after the other (the order alternating per
round, so drift of a shared machine hits both alike): every client sends --requests requests one after another,
each a chat prompt with ignore_eos and --max-tokens output tokens; in "lora" mode client i names adapter
i mod --adapters. Tokens/s = all output tokens / the mode's wall time; the summary is the median over rounds of
lora / base.

    .venv/bin/python benchmarks/lora_throughput.py [--clients 16] [--adapters 4] [--rank 16] [--requests 3]
        [--max-tokens 64] [--rounds 3] [--weights auto] [--json bench-results/lora_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _serve import served  # noqa: E402

from baton.api.adapters import MODULES  # noqa: E402
from baton.api.client import Client, generate_request  # noqa: E402
from baton.model.lora import write_random_adapter  # noqa: E402

TOPICS = ["the tides", "compound interest", "a sourdough starter", "how vaccines work", "the Roman roads",
          "bicycle gears", "why the sky is blue", "a binary search"]


def _client(address: str, adapter: str, requests: int, max_tokens: int, seed: int) -> tuple[int, int]:
    tokens = errors = 0
    with Client(address) as c:
        for k in range(requests):
            topic = TOPICS[(seed + k) % len(TOPICS)]
            req = generate_request(messages=[{"role": "user", "content": f"Explain {topic} in detail."}],
                                   sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
                                   adapter=adapter)
            try:
                tokens += len(c.complete(req, timeout=900).token_ids)
            except Exception as e:  # noqa: BLE001 - counted, and the first shown
                if not errors:
                    print(f"  error: {e}", flush=True)
                errors += 1
    return tokens, errors


def run_mode(address: str, mode: str, args, names: list[str]) -> dict:
    adapters = [names[i % len(names)] if mode == "lora" else "" for i in range(args.clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda i: _client(address, adapters[i], args.requests, args.max_tokens, i),
                                range(args.clients)))
    seconds = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    return {"mode": mode, "clients": args.clients, "tokens": tokens, "errors": sum(e for _, e in results),
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="all", help="comma-separated PEFT module names, or all")
    p.add_argument("--requests", type=int, default=3, help="requests per client per mode and round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--weights", default="auto")
    p.add_argument("--json", default="bench-results/lora_throughput.json")
    args = p.parse_args()
    from baton.loader import load_model

    config = load_model(None, weights=False).config
    targets = list(MODULES) if args.targets == "all" else args.targets.split(",")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="baton-lora-") as tmp:
        names = [f"adapter-{i}" for i in range(args.adapters)]
        flags: list[str] = ["--max-loras", str(max(1, args.adapters)), "--max-lora-rank", str(max(16, args.rank))]
        for i, name in enumerate(names):
            flags += ["--lora", f"{name}={write_random_adapter(Path(tmp) / name, config, args.rank, targets, i)}"]
        with served(args.weights, extra=tuple(flags)) as server:
            run_mode(server.grpc_address, "lora", argparse.Namespace(**{**vars(args), "requests": 1}), names)  # warm
            for r in range(args.rounds):
                order = ("base", "lora") if r % 2 == 0 else ("lora", "base")
                for mode in order:
                    out = run_mode(server.grpc_address, mode, args, names)
                    rounds.append({"round": r, **out})
                    print(f"round {r} {mode}: {out['tokens']} tokens in {out['seconds']:.1f} s = "
                          f"{out['tokens_per_s']:.1f} tokens/s ({out['errors']} errors)", flush=True)
    ratios = []
    for r in range(args.rounds):
        by = {x["mode"]: x for x in rounds if x["round"] == r}
        ratios.append(by["lora"]["tokens_per_s"] / by["base"]["tokens_per_s"])
    summary = {"lora_over_base": statistics.median(ratios), "ratios": ratios,
               "base_tokens_per_s": statistics.median(x["tokens_per_s"] for x in rounds if x["mode"] == "base"),
               "lora_tokens_per_s": statistics.median(x["tokens_per_s"] for x in rounds if x["mode"] == "lora")}
    print(f"{args.clients} clients over {args.adapters} adapters (rank {args.rank}, {','.join(targets)}): "
          f"{summary['lora_tokens_per_s']:.1f} tokens/s; base {summary['base_tokens_per_s']:.1f} tokens/s; "
          f"lora / base = {summary['lora_over_base']:.2f} (median of {args.rounds} rounds)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": rounds, "summary": summary}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
