"""Structured output's cost: TPOT with a JSON-schema constraint against the same workload unconstrained,
at 1 and 16 clients, and grammar compile time for the ten schemas of baton/bench/schemas.py, cold and
cached (and, when xgrammar is installed, the same compiles and per-token masks with it, beside
llguidance's).

Starts `baton serve` (gRPC only) and runs, per level, --rounds rounds of (json, free), so that drift
of a shared machine hits both alike. Each client sends --requests requests one after another; a
constrained request asks for one of the ten schemas (cycling); its free twin in the same round sends
the same prompt with ignore_eos and exactly as many tokens as the constrained answer had, so both
modes decode the same lengths. TPOT of a request = (end - first token) / (tokens - 1); each round
reports the median over its requests, and the summary the median of the per-round ratios json / free.

    .venv/bin/python benchmarks/structured_output.py [--levels 1,16] [--requests 6] [--rounds 3]
        [--weights q4] [--json bench-results/structured_output.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _serve import served  # noqa: E402

from baton.api.client import Client, generate_request  # noqa: E402
from baton.bench.schemas import SCHEMAS  # noqa: E402
from baton.v1 import generation_pb2 as pb  # noqa: E402


def _one(client: Client, name: str, free_tokens: int | None) -> tuple[float, int, bool]:
    """One request: constrained to schema ``name``, or (``free_tokens`` set) free for that many tokens."""
    prompt = f"Reply in JSON. Topic: {name.replace('_', ' ')}."
    constrained = free_tokens is None
    if constrained:
        sp = pb.SamplingParams(max_tokens=300, temperature=0.8,
                               constraint=pb.Constraint(json_schema=json.dumps(SCHEMAS[name])))
    else:
        sp = pb.SamplingParams(max_tokens=free_tokens, temperature=0.8, ignore_eos=True)
    first = None
    tokens = 0
    finish = ""
    for msg in client.stream(generate_request(messages=[{"role": "user", "content": prompt}], sampling=sp),
                             timeout=600):
        if msg.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(msg.token_ids)
        finish = msg.finish_reason or finish
    end = time.perf_counter()
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else float("nan")
    # A constrained answer is complete only with "stop"; a free one runs to its length.
    return tpot, tokens, finish == ("stop" if constrained else "length")


def _round(address: str, clients: int, requests: int, lengths: list[list[int]] | None) -> dict:
    """Constrained requests (``lengths`` None), or their free twins of the given lengths per client."""
    names = list(SCHEMAS)

    def run(c: int) -> list[tuple[float, int, bool]]:
        with Client(address) as client:
            return [_one(client, names[(c * requests + i) % len(names)], lengths[c][i] if lengths else None)
                    for i in range(requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        per_client = list(pool.map(run, range(clients)))
    wall = time.perf_counter() - t0
    results = [r for rs in per_client for r in rs]
    tpots = [t for t, n, _ in results if n > 1]
    tokens = sum(n for _, n, _ in results)
    return {"tpot_p50_s": statistics.median(tpots), "tpot_mean_s": statistics.fmean(tpots), "tokens": tokens,
            "requests": len(results), "errors": sum(not ok for _, _, ok in results),
            "output_tokens_per_s": tokens / wall, "lengths": [[n for _, n, _ in rs] for rs in per_client]}


def _compile_times() -> dict:
    from baton.api.params import Constraint
    from baton.grammar import Grammars
    from baton.loader import load_tokenizer

    tok = load_tokenizer()
    grammars = Grammars(tok)
    grammars.tokenizer  # noqa: B018 - built once, outside the timings
    out: dict = {"llguidance": {}}
    for name, schema in SCHEMAS.items():
        c = Constraint("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        grammars.compile(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, cached = grammars.compile(c)
        assert cached
        out["llguidance"][name] = {"cold_s": cold, "cached_s": time.perf_counter() - t0}
    try:
        out["xgrammar"] = _xgrammar(tok)
    except ImportError:
        out["xgrammar"] = None
    return out


def _xgrammar(tok) -> dict:
    """xgrammar's compile of the same schemas, and both libraries' mask time per token along one answer."""
    import llguidance
    import numpy as np
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from baton.grammar import _JSON_OPTIONS

    vocab, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok._backend),
                                              vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    lltok = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=vocab, eos_token=eos)
    words = (vocab + 31) // 32
    rng = np.random.default_rng(0)
    out = {}
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        xgr_compile = time.perf_counter() - t0
        xm = xgr.GrammarMatcher(compiled)
        lm = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS))
        lmask = torch.zeros((1, words), dtype=torch.int32)
        xmask = xgr.allocate_token_bitmask(1, vocab)
        ll_s = xg_s = 0.0
        steps = 0
        while not lm.is_stopped() and steps < 200:
            t0 = time.perf_counter()
            lm.unsafe_compute_mask_ptr(lmask.data_ptr(), words * 4)
            ll_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            xm.fill_next_token_bitmask(xmask)
            xg_s += time.perf_counter() - t0
            allowed = np.unpackbits(lmask[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
            token = int(rng.choice(np.flatnonzero(allowed)))
            steps += 1
            lm.consume_token(token)
            if not xm.accept_token(token):  # the two disagree on this token: stop timing here
                break
        out[name] = {"compile_s": xgr_compile, "steps": steps, "llguidance_mask_s": ll_s / steps,
                     "xgrammar_mask_s": xg_s / steps}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,16", help="client counts, comma-separated")
    ap.add_argument("--requests", type=int, default=6, help="requests per client per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="q4", help="baton serve --weights")
    ap.add_argument("--json", default="bench-results/structured_output.json")
    args = ap.parse_args()

    compile_times = _compile_times()
    ll = compile_times["llguidance"]
    print(f"llguidance compile, 10 schemas: cold {sum(v['cold_s'] for v in ll.values()) * 1e3:.2f} ms, "
          f"cached {sum(v['cached_s'] for v in ll.values()) * 1e3:.3f} ms", flush=True)
    xg = compile_times["xgrammar"]
    if xg:
        ll_mask = statistics.fmean(v["llguidance_mask_s"] for v in xg.values())
        xg_mask = statistics.fmean(v["xgrammar_mask_s"] for v in xg.values())
        print(f"xgrammar compile, 10 schemas: {sum(v['compile_s'] for v in xg.values()) * 1e3:.2f} ms; "
              f"mask per token: llguidance {ll_mask * 1e6:.0f} us, xgrammar {xg_mask * 1e6:.0f} us", flush=True)

    rounds: list[dict] = []
    with served(args.weights) as serve:
        for level in [int(x) for x in args.levels.split(",")]:
            for r in range(args.rounds):
                lengths = None
                for mode in ("json", "free"):
                    row = {"clients": level, "round": r, "mode": mode,
                           **_round(serve.grpc_address, level, args.requests, lengths)}
                    lengths = row.pop("lengths")
                    rounds.append(row)
                    print(f"{level:>3} clients round {r} {row['mode']:>4}: TPOT p50 {row['tpot_p50_s'] * 1e3:6.2f} ms "
                          f"mean {row['tpot_mean_s'] * 1e3:6.2f} ms  {row['output_tokens_per_s']:7.1f} tok/s  "
                          f"errors {row['errors']}", flush=True)

    summary = {}
    for level in sorted({x["clients"] for x in rounds}):
        ratios = []
        for r in range(args.rounds):
            pair = {x["mode"]: x for x in rounds if x["clients"] == level and x["round"] == r}
            ratios.append(pair["json"]["tpot_p50_s"] / pair["free"]["tpot_p50_s"])
        summary[str(level)] = {"tpot_ratio_json_over_free": statistics.median(ratios), "per_round": ratios}
        print(f"{level} clients: TPOT json / free = {statistics.median(ratios):.3f} "
              f"(per round {', '.join(f'{x:.3f}' for x in ratios)})")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "compile": compile_times, "rounds": rounds, "summary": summary},
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
