"""Decode throughput of the single-process engine against transformers generate(), in one run.

Same weights, same prompts, same output lengths (EOS ignored), static batches for transformers and
one continuous batch for Baton. transformers runs in the engine's dtype (the like-for-like ratio) and,
where that is not float32, also in float32 (what transformers computes in when no dtype is asked
for); each gets its own ratio. Also compares Baton's batch-1 decode step with the time to read the
weights once at the machine's memory bandwidth, in rounds that alternate the two measurements (the
bandwidth of a shared host moves from one second to the next), and gives the most tokens/s the
linear layers alone allow at the chip's matmul rate.

    .venv/bin/python benchmarks/decode_throughput.py [--batches 1,8,32,64] [--output-tokens 64]
                                                     [--transformers-dtypes same,float32] [--rounds 5]

Prints a table and writes JSON (default bench-results/decode_throughput.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.api import SamplingParams  # noqa: E402
from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.kernels import cpu as cpu_kernels  # noqa: E402
from baton.loader import load_model  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about autumn leaves.",
    "Explain how a bicycle stays upright.", "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?", "Describe the water cycle.",
    "Why do cats purr?", "Summarize the plot of Romeo and Juliet.",
]


def best_seconds(f, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of f (after one untimed call)."""
    f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def memory_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second for summing a buffer far larger than the caches (best of several)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_seconds(buf.sum, repeats)


def weight_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    """The weight tensors a decode step reads: every linear layer's copy for small passes
    (Linear.read_tensors), the LM head, the norms."""
    m = engine.model
    out = m.lm_head.read_tensors + [m.norm]
    for layer in m.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            out += lin.read_tensors
        out += [layer.input_norm, layer.post_norm]
    return out


def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads."""
    return sum(t.numel() * t.element_size() for t in weight_tensors(engine))


def weights_read_seconds(engine: LLMEngine, repeats: int = 10) -> float | None:
    """Time to read the weights once where they lie (best of several), with the kernels' threads; None
    without the CPU kernels."""
    tensors = weight_tensors(engine)
    if engine.device.type != "cpu" or not cpu_kernels.available() or not all(t.is_contiguous() for t in tensors):
        return None
    return best_seconds(lambda: cpu_kernels.read_bytes(tensors), repeats)


def prompts_for(engine: LLMEngine, batch: int) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"}])
            for i in range(batch)]


def run_baton(engine: LLMEngine, prompts: list[list[int]], out_tokens: int) -> dict:
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    t0 = time.perf_counter()
    step_times: list[float] = []
    prefill_done = None
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if prefill_done is None and not engine.scheduler.waiting and all(
                s.num_output_tokens >= 1 for s in engine.scheduler.running):
            prefill_done = time.perf_counter()
        elif prefill_done is not None:
            step_times.append(dt)
    total = time.perf_counter() - t0
    # Steady-state steps: every sequence decoding (the last few steps shrink as nothing is left).
    steady = step_times[: max(1, out_tokens - 2)]
    return {"seconds": total, "tokens_per_s": len(prompts) * out_tokens / total,
            "decode_step_ms": 1e3 * statistics.median(steady) if steady else None,
            "decode_tokens_per_s": len(prompts) / statistics.median(steady) if steady else None}


def run_transformers(model, pad_id: int, prompts: list[list[int]], out_tokens: int) -> dict:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate() expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_tokens,
                             min_new_tokens=out_tokens, do_sample=False, pad_token_id=pad_id)
    total = time.perf_counter() - t0
    assert out.shape[1] - width == out_tokens
    return {"seconds": total, "tokens_per_s": len(prompts) * out_tokens / total}


def hf_model(engine: LLMEngine, dtype: torch.dtype):
    """transformers' Llama on the engine's weights (the correctness oracle's model), in ``dtype``."""
    from tests.oracle import hf_from_loaded

    return hf_from_loaded(load_model(engine.config.model)).to(dtype)  # the engine keeps no copy of the file's


def transformers_dtypes(spec: str, engine_dtype: torch.dtype) -> list[torch.dtype]:
    """--transformers-dtypes: "same" is the engine's dtype; duplicates are dropped, order kept."""
    out: list[torch.dtype] = []
    for name in filter(None, (n.strip() for n in spec.split(","))):
        if name == "same":
            dt = engine_dtype
        elif name in ("float32", "bfloat16", "float16"):
            dt = getattr(torch, name)
        else:
            raise SystemExit(f"--transformers-dtypes: unknown dtype {name!r} (same, float32, bfloat16, float16)")
        if dt not in out:
            out.append(dt)
    return out


def matmul_rate(engine: LLMEngine, rows: int = 256, repeats: int = 20) -> float:
    """FLOP/s of the engine's dtype on this machine: the best of torch's matmul and Baton's own kernel
    (through Linear) on one layer's gate-up weights at ``rows`` rows, weights in cache."""
    lin = engine.model.layers[0].gate_up
    x = torch.randn(rows, lin.in_features).to(engine.dtype)
    dense = lin.values().to(engine.dtype)
    with torch.inference_mode():
        best = min(best_seconds(f, repeats) for f in (lambda: lin(x), lambda: x @ dense.T))
    return 2 * rows * lin.in_features * lin.out_features / best


def linear_flops(engine: LLMEngine, prompts: list[list[int]], out_tokens: int) -> float:
    """Multiply-add FLOPs of the linear layers and LM head to run these prompts from scratch and decode
    out_tokens each (attention left out): the work either system must do at the least."""
    m = engine.model
    per_token = 2 * sum(lin.in_features * lin.out_features
                        for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    head = 2 * m.lm_head.in_features * m.lm_head.out_features
    prompt_tokens = sum(map(len, prompts))
    # Every prompt token and every generated token but the last goes through the layers; each
    # generated token comes from one LM head row.
    return per_token * (prompt_tokens + len(prompts) * (out_tokens - 1)) + head * len(prompts) * out_tokens


def compare_weights(engine: LLMEngine, mode: str, out_tokens: int, rounds: int = 3) -> dict:
    """Batch-1 decode with another weight mode (auto, int8, q4) beside the model dtype's, alternating runs
    (same prompts)."""
    other = LLMEngine(dataclasses.replace(engine.config, weights=mode))
    prompts = prompts_for(engine, 1)
    steps: dict[str, list[float]] = {"default": [], mode: []}
    for _ in range(rounds):
        for name, e in (("default", engine), (mode, other)):
            steps[name].append(run_baton(e, prompts, out_tokens)["decode_step_ms"])
    d, q = statistics.median(steps["default"]), statistics.median(steps[mode])
    print(f"batch-1 decode step: default weights {d:.1f} ms, {mode} weights {q:.1f} ms -> {d / q:.2f}x "
          f"(weights read per step {weight_bytes_per_step(engine) / 1e6:.0f} MB vs "
          f"{weight_bytes_per_step(other) / 1e6:.0f} MB)")
    return {"mode": mode, "default_step_ms": d, "step_ms": q, "speedup": d / q,
            "default_weight_bytes": weight_bytes_per_step(engine), "weight_bytes": weight_bytes_per_step(other)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="dtype", choices=["auto", "dtype", "int8", "q4"],
                    help="auto (the file's own blocks), int8 or q4: also time the engine with those weights at batch "
                    "1 beside the model dtype's")
    ap.add_argument("--transformers-dtypes", default="same,float32",
                    help="dtypes to run transformers in, comma-separated; 'same' is the engine's dtype")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of (memory bandwidth, batch-1 decode) for the weight-read comparison")
    ap.add_argument("--json", default="bench-results/decode_throughput.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.rounds < 1 or min(batches) < 1:
        ap.error("--rounds and every batch size must be at least 1")

    # the model dtype (the file's weights dequantized): the weights transformers computes with
    engine = LLMEngine(EngineConfig(dtype=args.dtype, weights="dtype", max_num_seqs=max(batches)))
    bw = memory_read_bandwidth()
    wbytes = weight_bytes_per_step(engine)
    print(f"model {engine.model_config.name}  dtype {engine.dtype}  threads {torch.get_num_threads()}  "
          f"cpu {platform.processor() or platform.machine()}")
    print(f"memory read bandwidth {bw / 1e9:.1f} GB/s; weights read per step {wbytes / 1e6:.0f} MB "
          f"-> {1e3 * wbytes / bw:.1f} ms to read them once")
    hf_dtypes = [] if args.skip_transformers else transformers_dtypes(args.transformers_dtypes, engine.dtype)
    hf = {str(dt).removeprefix("torch."): hf_model(engine, dt) for dt in hf_dtypes}
    dtype_name = str(engine.dtype).removeprefix("torch.")
    pad = engine.tokenizer.eos_token_ids and min(engine.tokenizer.eos_token_ids) or 0

    run_baton(engine, prompts_for(engine, 2), 4)  # warm-up
    rate_before = matmul_rate(engine)
    for model in hf.values():
        run_transformers(model, pad, prompts_for(engine, 2), 4)
    rows = []
    head = "".join(f" {'transformers ' + name:>22} {'ratio':>6}" for name in hf)
    print(f"{'batch':>5} {'baton tok/s':>12} {'step ms':>8}{head}")
    for b in batches:
        prompts = prompts_for(engine, b)
        ours = run_baton(engine, prompts, args.output_tokens)
        theirs = {name: run_transformers(model, pad, prompts, args.output_tokens) for name, model in hf.items()}
        ratios = {name: ours["tokens_per_s"] / t["tokens_per_s"] for name, t in theirs.items()}
        rows.append({"batch": b, "baton": ours, "transformers": theirs.get(dtype_name),
                     "ratio": ratios.get(dtype_name),
                     "transformers_by_dtype": theirs, "ratio_by_dtype": ratios})
        cols = "".join(f" {theirs[n]['tokens_per_s']:>22.1f} {ratios[n]:>6.2f}" for n in hf)
        print(f"{b:>5} {ours['tokens_per_s']:>12.1f} {ours['decode_step_ms']:>8.1f}{cols}", flush=True)

    rate = max(rate_before, matmul_rate(engine))  # best of both ends of the run: this host is noisy
    print(f"matmul rate in {dtype_name} (best of torch and Baton's kernel, in cache): "
          f"{rate / 1e9:.0f} GFLOP/s; at that rate the linear layers alone allow at most (a compute bound; "
          f"small batches meet the memory bound first):")
    for r in rows:
        ceiling = r["batch"] * args.output_tokens / (linear_flops(engine, prompts_for(engine, r["batch"]),
                                                                  args.output_tokens) / rate)
        r["ceiling_tokens_per_s"] = ceiling
        print(f"  batch {r['batch']:>3}: {ceiling:.0f} tokens/s; Baton reached "
              f"{100 * r['baton']['tokens_per_s'] / ceiling:.0f}% of it")

    # A shared host's memory bandwidth moves from one second to the next and differs between allocations
    # (other tenants, how the host backs each region), so the batch-1 step is compared, in alternating
    # rounds, with reading the weights themselves just before it and with a large buffer's bandwidth.
    print(f"batch-1 decode step against the time to read the weights once ({args.rounds} alternating rounds):")
    batch1 = []
    for _ in range(args.rounds):
        round_bw = memory_read_bandwidth(repeats=3)
        own = weights_read_seconds(engine)
        step = run_baton(engine, prompts_for(engine, 1), args.output_tokens)["decode_step_ms"]
        read = 1e3 * wbytes / round_bw
        entry = {"memory_read_GBps": round_bw / 1e9, "weight_read_ms": read, "step_ms": step, "ratio": step / read}
        line = f"  buffer {round_bw / 1e9:.1f} GB/s -> {read:.1f} ms to read; "
        if own is not None:
            entry.update(own_read_ms=1e3 * own, own_ratio=step / (1e3 * own))
            line += f"the weights themselves {1e3 * own:.1f} ms ({wbytes / own / 1e9:.1f} GB/s); "
        print(line + f"step {step:.1f} ms = {step / read:.2f} x the buffer's"
              + (f", {step / (1e3 * own):.2f} x the weights' own" if own is not None else ""))
        batch1.append(entry)
    ratio1 = statistics.median(b["ratio"] for b in batch1)
    own_ratio = statistics.median(b["own_ratio"] for b in batch1) if "own_ratio" in batch1[0] else None
    print(f"batch-1 decode step (medians of the rounds) = {ratio1:.2f} x the time to read the weights at the "
          f"buffer's bandwidth" + (f", {own_ratio:.2f} x reading the weights themselves" if own_ratio else ""))
    read_ms = 1e3 * wbytes / bw
    result = {"dtype": str(engine.dtype), "threads": torch.get_num_threads(), "memory_read_GBps": bw / 1e9,
              "weight_bytes_per_step": wbytes, "weight_read_ms": read_ms, "output_tokens": args.output_tokens,
              "batch1_step_over_weight_read": ratio1, "batch1_step_over_own_weight_read": own_ratio,
              "batch1_rounds": batch1,
              "matmul_GFLOPs": rate / 1e9, "rows": rows}
    if args.weights != "dtype":
        result["other_weights"] = compare_weights(engine, args.weights, args.output_tokens)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
