"""Quantized GGUF files as stored, against llama.cpp's server on the same files: output tokens/s at 1 and 16
clients and resident weight memory, per format.

For each format (--formats: GGUF types that llama-quantize makes from the default model's file, e.g. Q4_K_M,
Q8_0, Q5_K_M, Q6_K; `source` is the default model's own Q4_1 file) the file is made once (kept under
--files), then side by side in one run: `baton serve --model FILE` (--weights auto: the file's block types as
stored) and llama.cpp's llama-server on the same file (16 slots, 2 threads: the peer's defaults), each measured
with baton bench's closed loop on the same seeded chat requests (greedy, EOS ignored), every client level
--rounds times, the median taken. Every round starts each stack afresh, and the order of the stacks turns by one
place each round: a stack measured right after another runs faster on a shared host, so with as many rounds as
stacks (the default) each stack runs first once. Memory: the file's tensor bytes against the bytes of the weights
a Baton engine holds for it (ModelWeights.nbytes), and what it holds them in.

    .venv/bin/python benchmarks/quant_formats.py [--formats Q4_K_M,Q8_0] [--clients 1,16] [--requests 8]
        [--many-requests 32] [--output-tokens 128] [--rounds STACKS] [--llama-bin ~/.cache/baton-peers/llama-bin]
        [--files bench-results/quant] [--baseline DIR] [--json bench-results/quant_formats.json]

Without llama.cpp's binaries (or llama-quantize) it measures Baton's side alone, on the formats it has files for.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _serve import llama_server, median, served  # noqa: E402
from gguf import GGUFReader  # noqa: E402

from baton.bench import workloads as wl  # noqa: E402
from baton.bench.report import SLO, summarize  # noqa: E402
from baton.bench.runner import closed_loop, make_client  # noqa: E402
from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.loader import default_model_path, load_tokenizer  # noqa: E402


def model_file(fmt: str, files: Path, bin_dir: Path) -> Path | None:
    """The default model in format ``fmt`` (made with llama-quantize when missing), or None if it cannot be."""
    source = Path(default_model_path())
    if fmt == "source":
        return source
    out = files / f"{source.stem.split('.')[0]}.{fmt}.gguf"
    if out.exists():
        return out
    quantize = bin_dir / "llama-quantize"
    if not quantize.exists():
        return None
    files.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(quantize), "--allow-requantize", str(source), str(out), fmt], check=True,
                   env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)), capture_output=True)
    return out


def memory(path: Path) -> dict:
    """The file's tensor bytes and its types; what an engine holds for it (bytes and layout)."""
    reader = GGUFReader(str(path))
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=1 << 24))
    held, described = engine.model.weights.nbytes, engine.model.weights.describe()
    del engine
    gc.collect()
    return {"file_types": types, "file_tensor_bytes": file_bytes, "resident_weight_bytes": held,
            "memory_ratio": held / file_bytes, "held_as": described}


def measure(target: str, levels: list[int], args, tokenizer, r: int) -> dict[int, dict]:
    """Round ``r`` of each client level against one stack: clients -> stats dict. Round r's requests are the same
    for every stack."""
    maker = wl.PromptMaker(lambda s: tokenizer.encode(s, add_special_tokens=False), tokenizer.decode)
    client = make_client(target)
    out: dict[int, dict] = {}
    try:
        for clients in levels:
            n = args.requests if clients == 1 else args.many_requests
            reqs = wl.chat(maker, clients + n, args.seed + r, (50, 200), (args.output_tokens,) * 2)
            records, window = closed_loop(client, reqs, clients, clients, None, f"{clients} clients")
            out[clients] = summarize(records, window, SLO(1.0, 0.1, 95.0), None)
    finally:
        client.close()
    return out


@contextlib.contextmanager
def started(stack: str, path: Path, args) -> Iterator[str]:
    """One stack on the file, started afresh: its target for baton bench's client."""
    if stack == "llama.cpp":
        proc, port = llama_server(Path(args.llama_bin) / "llama-server", path, slots=16, ctx=16384)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        return
    root = Path(args.baseline) if stack == "baseline" else ROOT
    with served("auto", extra=("--model", str(path)), root=root) as s:
        yield f"grpc://{s.grpc_address}"


def turned(stacks: list[str], r: int) -> list[str]:
    """Round r's order: the stacks turned by r places, so each runs first in one round of every len(stacks)."""
    k = r % len(stacks)
    return stacks[k:] + stacks[:k]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="Q4_K_M,Q8_0", help="comma list of llama-quantize types, or source")
    p.add_argument("--clients", default="1,16", help="comma list of client levels")
    p.add_argument("--requests", type=int, default=8, help="measured requests at 1 client (default 8)")
    p.add_argument("--many-requests", type=int, default=32, help="measured requests at more clients (default 32)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, help="rounds per stack (default: as many as stacks, so each runs first once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-bin", default=os.path.expanduser("~/.cache/baton-peers/llama-bin"))
    p.add_argument("--files", default="bench-results/quant", help="where the made files are kept")
    p.add_argument("--baseline", help="another checkout of Baton, also measured (its stack on the same file)")
    p.add_argument("--json", default="bench-results/quant_formats.json")
    args = p.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    try:
        levels = [int(c) for c in args.clients.split(",") if c]
    except ValueError:
        p.error("--clients must be a comma list of integers")
    bin_dir = Path(args.llama_bin)
    have_llama = (bin_dir / "llama-server").exists()
    if not have_llama:
        print(f"llama.cpp: no llama-server in {bin_dir}; Baton's side only")
    stacks = ["baton"] + (["baseline"] if args.baseline else []) + (["llama.cpp"] if have_llama else [])
    if args.rounds is None:
        args.rounds = len(stacks)
    if not formats or not levels or min(*levels, args.requests, args.many_requests, args.output_tokens,
                                        args.rounds) < 1:
        p.error("--formats and --clients must be non-empty; counts must be >= 1")
    if args.rounds % len(stacks):
        print(f"note: {args.rounds} rounds for {len(stacks)} stacks: not every stack runs first equally often")
    tokenizer = load_tokenizer(None)

    rows = []
    for fmt in formats:
        path = model_file(fmt, Path(args.files), bin_dir)
        if path is None:
            print(f"{fmt}: no file and no llama-quantize to make it; left out")
            continue
        path = path.resolve()  # a --baseline stack runs in its own folder
        mem = memory(path)
        print(f"{fmt}: {mem['file_tensor_bytes'] / 1e6:.1f} MB of tensors in the file, Baton holds "
              f"{mem['resident_weight_bytes'] / 1e6:.1f} MB ({mem['memory_ratio']:.3f}x): {mem['held_as']}", flush=True)
        runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in stacks}
        orders = [turned(stacks, r) for r in range(args.rounds)]
        for r, order in enumerate(orders):
            print(f"{fmt} round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for name in order:
                with started(name, path, args) as target:
                    for clients, stats in measure(target, levels, args, tokenizer, r).items():
                        runs[name][clients].append(stats)
        baton, baseline, llama = runs["baton"], runs.get("baseline"), runs.get("llama.cpp")
        for clients in levels:
            b = median(baton[clients], "output_tokens_per_s")
            ll = median(llama[clients], "output_tokens_per_s") if llama else None
            errors = sum(sum(st["errors"].values()) for st in baton[clients] + (llama[clients] if llama else []))
            base = median(baseline[clients], "output_tokens_per_s") if baseline else None
            rows.append({"format": fmt, "clients": clients, "baton_tokens_per_s": b, "llama_tokens_per_s": ll,
                         "baseline_tokens_per_s": base, "ratio": b / ll if b and ll else None, "errors": errors,
                         **mem, "ttft_s_p95": median(baton[clients], "ttft_s_p95"),
                         "llama_ttft_s_p95": median(llama[clients], "ttft_s_p95") if llama else None,
                         "baseline_ttft_s_p95": median(baseline[clients], "ttft_s_p95") if baseline else None,
                         "orders": orders, "rounds": {"baton": baton[clients],
                                                      "llama.cpp": llama[clients] if llama else None,
                                                      "baseline": baseline[clients] if baseline else None}})

    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    print(f"\n{'format':8} {'clients':>7} {'Baton tok/s':>12} {'llama.cpp tok/s':>16} {'ratio':>6} {'baseline':>9} "
          f"{'TTFT p95 s':>11} {'llama':>6} {'weights MB':>11} {'x file':>7}")
    for r in rows:
        print(f"{r['format']:8} {r['clients']:>7} {f(r['baton_tokens_per_s']):>12} {f(r['llama_tokens_per_s']):>16} "
              f"{f(r['ratio'], '.2f'):>6} {f(r['baseline_tokens_per_s']):>9} {f(r['ttft_s_p95'], '.2f'):>11} "
              f"{f(r['llama_ttft_s_p95'], '.2f'):>6} {r['resident_weight_bytes'] / 1e6:>11.1f} "
              f"{r['memory_ratio']:>7.3f}"
              + (f"  ({r['errors']} errors)" if r["errors"] else ""))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
