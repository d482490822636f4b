"""Speculative decoding against none, side by side: output tokens/s of `baton serve --speculative ngram` and of
`baton serve` without it, for each weight format, on three loads: 1 client on `edit` (the answer repeats much
of the prompt), 1 client on `chat` and many clients on `chat` (where the verify rows cost their compute and the
controller should back off by itself).

For each format (--formats: q4 is --weights q4; bfloat16 and float32 are --dtype with the file's weights
dequantized) one stack runs without speculation and then one with it, each load measured with baton bench's own
closed loop and workloads (the same seeded requests both times, greedy, EOS ignored); every load is measured
--rounds times per stack, alternating loads, and the median taken. The ratio is on / off; mean accepted length
(tokens a sequence makes in a pass with proposals) and acceptance come from the responses' usage.

    .venv/bin/python benchmarks/speculative.py [--formats q4,bfloat16] [--requests 8] [--many 16]
        [--many-requests 32] [--output-tokens 128] [--spec-tokens 8] [--rounds 1]
        [--json bench-results/speculative.json]   (each stack's log beside it: speculative.FORMAT-MODE.log)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _serve import median, served  # noqa: E402

from baton.bench import workloads as wl  # noqa: E402
from baton.bench.report import SLO, summarize  # noqa: E402
from baton.bench.runner import closed_loop, make_client  # noqa: E402
from baton.loader import load_tokenizer  # noqa: E402

FORMATS = {"q4": ("--weights", "q4"), "bfloat16": ("--weights", "dtype", "--dtype", "bfloat16"),
           "float32": ("--weights", "dtype", "--dtype", "float32")}


def loads(args) -> list[tuple[str, str, int, int]]:
    """(name, workload, clients, requests)."""
    return [("edit, 1 client", "edit", 1, args.requests), ("chat, 1 client", "chat", 1, args.requests),
            (f"chat, {args.many} clients", "chat", args.many, args.many_requests)]


def requests_for(workload: str, n: int, seed: int, output_tokens: int) -> list[wl.BenchRequest]:
    tok = load_tokenizer(None)
    maker = wl.PromptMaker(lambda s: tok.encode(s, add_special_tokens=False), tok.decode)
    o = (output_tokens, output_tokens)
    if workload == "edit":
        return wl.edit(maker, n, seed, o)
    return wl.chat(maker, n, seed, (50, 200), o)


def measure(address: str, args) -> dict[str, list[dict]]:
    """Every load, --rounds times (loads alternating): name -> one stats dict per round."""
    client = make_client(f"grpc://{address}")
    out: dict[str, list[dict]] = {}
    try:
        for r in range(args.rounds):
            for name, workload, clients, n in loads(args):
                warmup = clients  # each client's first request teaches the controller the pass costs
                reqs = requests_for(workload, warmup + n, args.seed + r, args.output_tokens)
                records, window = closed_loop(client, reqs, clients, warmup, None, name)
                out.setdefault(name, []).append(summarize(records, window, SLO(1.0, 0.1, 95.0), None))
    finally:
        client.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="q4,bfloat16", help="comma list of q4, bfloat16, float32")
    p.add_argument("--requests", type=int, default=8, help="measured requests per 1-client load (default 8)")
    p.add_argument("--many", type=int, default=16, help="clients of the loaded chat (default 16)")
    p.add_argument("--many-requests", type=int, default=32, help="its measured requests (default 32)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--spec-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench-results/speculative.json")
    args = p.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        p.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    if min(args.requests, args.many, args.many_requests, args.output_tokens, args.rounds) < 1:
        p.error("--requests, --many, --many-requests, --output-tokens and --rounds must be >= 1")

    rows = []
    for fmt in formats:
        flags = FORMATS[fmt]
        weights, extra = flags[1], flags[2:]
        got = {}
        for mode, spec in (("off", ()), ("on", ("--speculative", "ngram", "--spec-tokens", str(args.spec_tokens)))):
            t0 = time.monotonic()
            log = Path(args.json).with_suffix(f".{fmt}-{mode}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            with served(weights, extra=(*extra, *spec), log=log) as s:
                print(f"{fmt}, speculation {mode}: stack up in {time.monotonic() - t0:.0f} s", flush=True)
                got[mode] = measure(s.grpc_address, args)
        for name, *_ in loads(args):
            off, on = median(got["off"][name], "output_tokens_per_s"), median(got["on"][name], "output_tokens_per_s")
            errors = sum(sum(st["errors"].values()) for m in ("off", "on") for st in got[m][name])
            details = {f"{m}: {code}": text for m in ("off", "on") for st in got[m][name]
                       for code, text in st["error_details"].items()}
            rows.append({"format": fmt, "load": name, "off_tokens_per_s": off, "on_tokens_per_s": on,
                         "ratio": on / off if on and off else None, "errors": errors,
                         "error_details": details,
                         "mean_accepted_length": median(got["on"][name], "spec_mean_accepted_length"),
                         "acceptance": median(got["on"][name], "spec_acceptance"),
                         "rounds": {m: got[m][name] for m in ("off", "on")}})

    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    print(f"\n{'format':9} {'load':18} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'acc. len':>9} "
          f"{'acceptance':>10}")
    for r in rows:
        print(f"{r['format']:9} {r['load']:18} {f(r['off_tokens_per_s']):>10} {f(r['on_tokens_per_s']):>10} "
              f"{f(r['ratio'], '.2f'):>7} {f(r['mean_accepted_length'], '.2f'):>9} {f(r['acceptance'], '.0%'):>10}"
              + (f"  ({r['errors']} errors)" if r["errors"] else ""))
    for r in rows:
        for code, text in r["error_details"].items():
            print(f"  {r['format']}, {r['load']}, speculation {code}: {text}")
    if any(r["errors"] for r in rows):  # what the stacks logged of it
        for log in sorted(Path(args.json).parent.glob(Path(args.json).stem + ".*.log")):
            lines = log.read_text(errors="replace").splitlines()
            hits = [i for i, line in enumerate(lines) if "Error" in line or "Traceback" in line]
            if hits:
                print(f"{log}:\n" + "\n".join(lines[max(0, hits[0] - 2):hits[0] + 30]))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
