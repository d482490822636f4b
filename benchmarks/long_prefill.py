"""Long-prompt prefill, side by side in one run: Baton's default stack (one prefill and one decode worker,
pinned; the prefill worker borrows the idle decode core), the same with fixed pinning (--no-share-cores),
optionally another checkout of Baton (--baseline DIR), and llama.cpp's server on the same GGUF file
(`-np 1 -c 8192 -t 2`). One request at a time, prefix cache off (Baton: --no-prefix-cache; llama.cpp:
cache_prompt false), max_tokens 1: the time of a request is its prefill. Prompts are the first N tokens of
benchmarks/data/heldout.txt (repeated), sent as token ids to both, so both compute the same tokens.
Each configuration runs --rounds rounds over the lengths; the figure is the median. First, in this process on
one thread, the attention kernels alone: the last 256-token chunk of each length (the default model's 9 query
heads, 3 KV heads of 64 dims, bfloat16 cache) by the tiled prefill kernel (where the CPU has AMX, also with it
turned off) and by the paged decode kernel, each chunk row a decode query (the path before it and without
AVX-512), in GFLOP/s of causal attention.

    .venv/bin/python benchmarks/long_prefill.py [--lengths 500,2000,6000] [--rounds 2]
        [--llama-server ~/.cache/baton-peers/llama-bin/llama-server] [--baseline DIR]
        [--json bench-results/long_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _serve import ROOT, llama_server, served  # noqa: E402

from baton.api.client import Client  # noqa: E402
from baton.loader import default_model_path, load_tokenizer  # noqa: E402
from baton.v1 import generation_pb2 as pb  # noqa: E402


def prompt_ids(n: int) -> list[int]:
    tok = load_tokenizer(None)
    text = (ROOT / "benchmarks" / "data" / "heldout.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def time_baton(address: str, ids: list[int]) -> float:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                             sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    with Client(address) as c:
        t = time.perf_counter()
        out = list(c.stream(req, timeout=600))
        dt = time.perf_counter() - t
    assert out and out[-1].usage.prompt_tokens == len(ids), out[-1].usage
    return dt


def time_llama(port: int, ids: list[int]) -> float:
    body = json.dumps({"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    dt = time.perf_counter() - t
    assert answer["tokens_evaluated"] >= len(ids) - 1, answer.get("tokens_evaluated")
    return dt


def kernel_figures(lengths: list[int], repeats: int = 5) -> dict[int, dict[str, float]]:
    import torch

    from baton.kernels import cpu

    if not cpu.has_prefill_attention(64, torch.bfloat16):
        return {}
    torch.set_num_threads(1)
    amx = cpu.amx()
    g = torch.Generator().manual_seed(0)
    out: dict[int, dict[str, float]] = {}
    for ctx in lengths:
        n = min(256, ctx)
        blocks = -(-ctx // 16)
        k = torch.randn(blocks + 1, 16, 3, 64, generator=g).bfloat16()
        v = torch.randn(blocks + 1, 16, 3, 64, generator=g).bfloat16()
        slots = (torch.randperm(blocks + 1, generator=g)[:blocks, None] * 16 + torch.arange(16)).flatten()[:ctx]
        q = torch.randn(n, 9, 64, generator=g).bfloat16()
        flops = 4 * n * (ctx - n / 2) * 64 * 9  # QK and PV over the causal part
        rows = cpu.chunk_query_rows(slots, n, 16)
        runs = {"tiled": (cpu.prefill_attention, (q, k, v, slots, 0.125), True),
                "rows": (cpu.paged_decode, (q, k, v, *rows, 0.125), True)}
        if amx:
            runs["tiled without AMX"] = (cpu.prefill_attention, (q, k, v, slots, 0.125), False)
        out[ctx] = {}
        for name, (fn, fn_args, on) in runs.items():
            cpu.set_amx(on and amx)
            fn(*fn_args)
            t = time.perf_counter()
            for _ in range(repeats):
                fn(*fn_args)
            out[ctx][name] = flops / ((time.perf_counter() - t) / repeats) / 1e9
        cpu.set_amx(amx)
        figures = ", ".join(f"{name} {g:.0f}" for name, g in out[ctx].items())
        print(f"attention kernel, last {n} of {ctx} tokens: {figures} GFLOP/s", flush=True)
    return out


def measure(run, lengths: list[int], rounds: int, prompts: dict[int, list[int]]) -> dict[int, float]:
    run(prompts[min(lengths)])  # warm-up
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(rounds):
        for n in lengths:
            times[n].append(run(prompts[n]))
    return {n: statistics.median(ts) for n, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="500,2000,6000")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-server", default=os.path.expanduser("~/.cache/baton-peers/llama-bin/llama-server"))
    ap.add_argument("--baseline", default=None, metavar="DIR", help="another Baton checkout, run the same way")
    ap.add_argument("--json", default="bench-results/long_prefill.json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {n: prompt_ids(n) for n in lengths}
    kernel = kernel_figures(lengths)
    results: dict[str, dict[int, float]] = {}
    configs = [("baton", ROOT, ()), ("baton fixed pinning", ROOT, ("--no-share-cores",))]
    if args.baseline:
        configs.append(("baseline", Path(args.baseline), ()))
    for name, root, extra in configs:
        with served("auto", extra=("--no-prefix-cache", *extra), root=root) as s:
            results[name] = measure(lambda ids, a=s.grpc_address: time_baton(a, ids), lengths, args.rounds, prompts)
        print(name, {n: f"{t:.2f} s" for n, t in results[name].items()}, flush=True)
    if Path(args.llama_server).exists():
        proc, port = llama_server(args.llama_server, default_model_path(), slots=1, ctx=8192)
        try:
            results["llama.cpp"] = measure(lambda ids: time_llama(port, ids), lengths, args.rounds, prompts)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        print("llama.cpp", {n: f"{t:.2f} s" for n, t in results["llama.cpp"].items()}, flush=True)
    print(f"\n{'prompt tokens':>14} " + " ".join(f"{name:>22}" for name in results))
    for n in lengths:
        print(f"{n:>14,} " + " ".join(f"{results[k][n]:>8.2f} s ({n / results[k][n]:>5.0f} t/s)" for k in results))
    base = results["baton"]
    for k in results:
        if k != "baton":
            print(f"baton vs {k}: " + ", ".join(f"{n}: {results[k][n] / base[n]:.2f}x" for n in lengths))
    lo, hi = min(lengths), max(lengths)
    print(f"baton throughput at {hi} tokens / at {lo}: {(hi / base[hi]) / (lo / base[lo]):.0%}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    report = {k: {str(n): t for n, t in v.items()} for k, v in results.items()}
    report["kernel_gflops"] = {str(n): v for n, v in kernel.items()}
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
