"""``baton bench``: the same seeded workload against Baton (gRPC) or any OpenAI-compatible server (HTTP),
closed or open loop, reported as percentiles, goodput under an SLO and cost per million tokens, in a
table, a JSON file and PNG plots. ``baton bench compare A.json B.json ...`` plots several runs together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from baton.bench import workloads as wl
from baton.bench.report import SLO, RequestRecord, summarize, table


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure a running Baton or OpenAI-compatible server",
                       description="Measure a running server. `baton bench compare A.json B.json ...` plots runs "
                                   "side by side.")
    b.add_argument("--target", default="grpc://127.0.0.1:50051",
                   help="grpc://HOST:PORT for Baton, http://HOST:PORT for an OpenAI-compatible server "
                        "(/v1/completions, streamed) (default grpc://127.0.0.1:50051)")
    b.add_argument("--model", default=None, help="model name for an OpenAI-compatible server (default: its first)")
    b.add_argument("--tls-ca", default=None, metavar="PEM", help="Baton over TLS, trusting this certificate or CA")
    b.add_argument("--token", default=None, help="bearer token (default: BATON_TOKEN; for HTTP targets too)")
    b.add_argument("--workload", default="chat",
                   help="chat | shared-prefix | long-prompt | edit (rewrite or fix a given passage: the answer "
                        "repeats much of the prompt) | file:PATH.jsonl (lines {\"prompt\": ..., "
                        "\"max_tokens\": ...}) (default chat)")
    b.add_argument("--prompt-tokens", default="50:200", help="N or MIN:MAX, uniform (default 50:200)")
    b.add_argument("--output-tokens", default="128", help="N or MIN:MAX; EOS is ignored (default 128)")
    b.add_argument("--system-tokens", type=int, default=1000, help="shared-prefix: system prompt length")
    b.add_argument("--long-tokens", type=int, default=4000, help="long-prompt: length of the long prompts")
    b.add_argument("--long-every", type=int, default=10, help="long-prompt: one request in this many is long")
    load = b.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="closed loop: clients, or a comma list of levels (default 1)")
    load.add_argument("--rate", default=None,
                      help="open loop: Poisson arrivals per second, or a comma list for a sweep")
    b.add_argument("--requests", type=int, default=32, help="measured requests per level (default 32)")
    b.add_argument("--warmup", type=int, default=2,
                   help="requests per level left out of the figures (default 2); closed loop: sent by the same "
                        "clients, which run on into the measured ones")
    b.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds per level")
    b.add_argument("--ramp-up", type=float, default=0.0, metavar="SECONDS",
                   help="closed loop: start the clients one by one over this many seconds (default 0: all at once)")
    b.add_argument("--slo-ttft", type=float, default=1.0, help="SLO: TTFT bound in seconds (default 1)")
    b.add_argument("--slo-tpot", type=float, default=0.1, help="SLO: TPOT bound in seconds (default 0.1)")
    b.add_argument("--slo-percentile", type=float, default=95.0, help="SLO percentile (default 95)")
    b.add_argument("--price-per-hour", type=float, default=None,
                   help="what the server costs per hour, for cost per million output tokens")
    b.add_argument("--tokenizer", default=None, help="model file or folder whose tokenizer sizes the prompts "
                                                     "(default: Baton's default model)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--label", default=None, help="name of this run in plots (default: the target)")
    b.add_argument("--json", default="bench-results/bench.json", help="where to write the results")
    b.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here (default: beside --json)")
    b.set_defaults(func=_cmd_bench)
    bsub = b.add_subparsers(dest="bench_command")
    c = bsub.add_parser("compare", help="plot several runs on the same axes")
    c.add_argument("results", nargs="+", help="JSON files written by baton bench")
    c.add_argument("--out", default="bench-results/compare", help="folder for the PNGs")
    c.set_defaults(func=_cmd_compare)


def _levels(text: str | None, cast) -> list:
    vals = [cast(v) for v in str(text).split(",") if v.strip()]
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"load levels {text!r}: want positive numbers, comma-separated")
    return vals


def build_workload(args, n: int) -> list[wl.BenchRequest]:
    from baton.loader import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    maker = wl.PromptMaker(lambda s: tok.encode(s, add_special_tokens=False), tok.decode)
    p, o = wl.parse_range(args.prompt_tokens), wl.parse_range(args.output_tokens)
    w = args.workload
    if w == "chat":
        return wl.chat(maker, n, args.seed, p, o)
    if w == "shared-prefix":
        return wl.shared_prefix(maker, n, args.seed, args.system_tokens, p, o)
    if w == "long-prompt":
        return wl.long_prompt(maker, n, args.seed, p, o, args.long_tokens, args.long_every)
    if w == "edit":
        return wl.edit(maker, n, args.seed, o)
    if w.startswith("file:"):
        return wl.from_file(w.removeprefix("file:"), n, maker, o, args.seed)
    raise ValueError(f"unknown workload {w!r}: chat, shared-prefix, long-prompt, edit or file:PATH")


def _record_dict(r: RequestRecord) -> dict:
    return {"id": r.id, "kind": r.kind, "sent_s": r.sent, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
            "itl_s": r.itl, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "output_tokens": r.output_tokens, "error": r.error, "spec_drafts": r.spec_drafts,
            "spec_draft_tokens": r.spec_draft_tokens, "spec_accepted_tokens": r.spec_accepted_tokens}


def run_bench(args, out=None) -> dict:
    """Everything ``baton bench`` does except parsing: returns the result dict (also written as JSON)."""
    out = out or sys.stdout
    from baton.bench.runner import closed_loop, make_client, open_loop

    mode = "rate" if args.rate else "concurrency"
    values = _levels(args.rate, float) if args.rate else _levels(args.concurrency or "1", int)
    if args.requests < 1 or args.warmup < 0 or args.ramp_up < 0:
        raise ValueError("--requests must be >= 1, --warmup >= 0 and --ramp-up >= 0")
    slo = SLO(args.slo_ttft, args.slo_tpot, args.slo_percentile)
    client = make_client(args.target, args.model, getattr(args, "tls_ca", None), getattr(args, "token", None))
    levels = []
    try:
        for i, v in enumerate(values):
            # Each level gets its own prompts (a seed per level), so levels do not hit each other's cache.
            level_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * i})
            reqs = build_workload(level_args, args.warmup + args.requests)
            label = f"{v:g} req/s" if mode == "rate" else f"{v} client{'s' if v != 1 else ''}"
            if mode == "rate":
                records, window = open_loop(client, reqs, v, args.seed + i, args.warmup, args.duration, label)
            else:
                records, window = closed_loop(client, reqs, v, args.warmup, args.duration, label, args.ramp_up)
            stats = summarize(records, window, slo, args.price_per_hour)
            levels.append({"label": label, "mode": mode, "value": v, "stats": stats,
                           "requests": [_record_dict(r) for r in sorted(records, key=lambda r: r.sent)]})
    finally:
        client.close()
    result = {"tool": "baton bench", "label": args.label or args.target, "target": args.target,
              "model": getattr(client, "model", None), "workload": args.workload,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "seed": args.seed,
              "slo": asdict(slo), "price_per_hour": args.price_per_hour,
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "python": platform.python_version()},
              "levels": levels}
    print(table(levels), file=out)
    for lv in levels:
        s = lv["stats"]
        cost = s["cost_per_million_output_tokens"]
        print(f"{lv['label']}: SLO (TTFT <= {slo.ttft_s} s, TPOT <= {slo.tpot_s} s at p{slo.percentile:g}) "
              f"{'met' if s['slo_met_at_percentile'] else 'not met'}; "
              f"{s['slo_met_share']:.0%} of requests within it"
              + (f"; ${cost:.3f} per million output tokens" if cost is not None else ""), file=out)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=out)
    from baton.bench.plots import plot_runs

    for f in plot_runs([(result["label"], result)], args.plots or path.parent, prefix=path.stem):
        print(f"wrote {f}", file=out)
    return result


def _cmd_bench(args) -> int:
    if getattr(args, "bench_command", None) == "compare":
        return _cmd_compare(args)
    run_bench(args)
    return 0


def _cmd_compare(args) -> int:
    from baton.bench.plots import plot_runs

    runs = []
    for f in args.results:
        try:
            data = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{f}: not a baton bench result ({e})") from e
        if data.get("tool") != "baton bench":
            raise ValueError(f"{f}: not a baton bench result")
        runs.append((data.get("label") or Path(f).stem, data))
    for label, data in runs:
        print(f"== {label}")
        print(table(data["levels"]))
    for f in plot_runs(runs, args.out, prefix="compare"):
        print(f"wrote {f}")
    return 0


__all__ = ["add_parser", "build_workload", "run_bench"]
