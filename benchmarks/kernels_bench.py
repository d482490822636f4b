"""Paged-KV kernels: Triton against the torch references, per shape.

- decode attention: ``paged_attention_decode_triton`` against ``paged_attention_decode`` (gather the
  blocks with index_select, then scaled_dot_product_attention; the key mask precomputed once, as the
  model does per forward);
- KV write: ``write_kv_triton`` against ``write_kv`` (index_copy_, quantizing for int8).

    .venv/bin/python benchmarks/kernels_bench.py [--interpret] [--quick] [--output bench-results/kernels.json]

On CUDA both run (timed with triton.testing.do_bench). On CPU only the torch paths are timed, since
Triton needs CUDA, unless --interpret is given: then Triton's interpreter runs the kernels too, on
small shapes, which checks them but says nothing about their speed. Every Triton result is also
compared with the reference (relative norm error in the table). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.kernels.paged_attention import (  # noqa: E402
    decode_key_mask,
    paged_attention_decode,
    quantize_int8,
    write_kv,
)


@dataclass(frozen=True)
class AttnShape:
    name: str
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context: int  # tokens of context per sequence

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads must be a multiple of num_kv_heads")


@dataclass(frozen=True)
class WriteShape:
    name: str
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    block_size: int


# (model-like head layouts: SmolLM2-135M has 9 heads / 3 KV heads of 64; Llama-3-8B 32 / 8 of 128)
GPU_ATTN = [
    AttnShape("smollm2 b1 ctx512", 1, 9, 3, 64, 16, 512),
    AttnShape("smollm2 b32 ctx1024", 32, 9, 3, 64, 16, 1024),
    AttnShape("llama8b b1 ctx4096", 1, 32, 8, 128, 16, 4096),
    AttnShape("llama8b b16 ctx2048", 16, 32, 8, 128, 16, 2048),
    AttnShape("llama8b b64 ctx1024", 64, 32, 8, 128, 32, 1024),
]
CPU_ATTN = [
    AttnShape("smollm2 b1 ctx512", 1, 9, 3, 64, 16, 512),
    AttnShape("smollm2 b8 ctx1024", 8, 9, 3, 64, 16, 1024),
    AttnShape("llama8b b4 ctx1024", 4, 32, 8, 128, 16, 1024),
]
INTERP_ATTN = [
    AttnShape("smollm2 b2 ctx256", 2, 9, 3, 64, 16, 256),
    AttnShape("llama8b b1 ctx128", 1, 32, 8, 128, 32, 128),
]
GPU_WRITE = [
    WriteShape("decode b64 llama8b", 64, 8, 128, 16),
    WriteShape("prefill 4096 llama8b", 4096, 8, 128, 16),
    WriteShape("prefill 2048 smollm2", 2048, 3, 64, 16),
]
CPU_WRITE = [
    WriteShape("decode b8 smollm2", 8, 3, 64, 16),
    WriteShape("prefill 512 smollm2", 512, 3, 64, 16),
]
INTERP_WRITE = [WriteShape("prefill 64 smollm2", 64, 3, 64, 16)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return ((a64 - b64).norm() / b64.norm()).item()


def time_cpu(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds per call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_timer(device: str, repeats: int) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=50) / 1e3
    return lambda fn: time_cpu(fn, repeats)


def attention_inputs(s: AttnShape, q_dtype: torch.dtype, cache_dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = math.ceil(s.context / s.block_size)
    num_blocks = s.batch * blocks_per_seq + 1
    # Each sequence gets its own blocks in a random (non-contiguous) order.
    tables = torch.randperm(num_blocks, generator=gen)[: s.batch * blocks_per_seq].view(s.batch, blocks_per_seq)
    shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_scale = v_scale = None
    if cache_dtype == torch.int8:
        (k, k_scale), (v, v_scale) = quantize_int8(k), quantize_int8(v)
    else:
        k, v = k.to(cache_dtype), v.to(cache_dtype)
    q = torch.randn(s.batch, s.num_heads, s.head_dim, generator=gen).to(q_dtype)
    seq_lens = torch.full((s.batch,), s.context, dtype=torch.int64)
    move = lambda t: None if t is None else t.to(device)
    return tuple(move(t) for t in (q, k, v, tables, seq_lens, k_scale, v_scale))


def bench_attention(s: AttnShape, q_dtype: torch.dtype, cache_dtype: torch.dtype, device: str, timer,
                    triton_fn) -> dict:
    q, k, v, tables, seq_lens, k_scale, v_scale = attention_inputs(s, q_dtype, cache_dtype, device)
    scale = s.head_dim ** -0.5
    mask = decode_key_mask(tables, seq_lens, s.block_size)
    ref_fn = lambda: paged_attention_decode(q, k, v, tables, seq_lens, scale, key_mask=mask, k_scale=k_scale,
                                            v_scale=v_scale)
    # Bytes of K and V (and scales) the context holds: what a decode step must read at least.
    kv_bytes = 2 * s.batch * s.context * s.num_kv_heads * (s.head_dim * k.element_size()
                                                           + (4 if k_scale is not None else 0))
    row = dict(kernel="decode_attention", shape=s.name, **{k_: v_ for k_, v_ in asdict(s).items() if k_ != "name"},
               q_dtype=str(q_dtype).removeprefix("torch."), cache_dtype=str(cache_dtype).removeprefix("torch."),
               kv_bytes=kv_bytes, torch_s=timer(ref_fn))
    if triton_fn is not None:
        tri_fn = lambda: triton_fn(q, k, v, tables, seq_lens, scale, k_scale=k_scale, v_scale=v_scale)
        row["rel_err"] = rel_err(tri_fn(), ref_fn())
        row["triton_s"] = timer(tri_fn)
    return row


def bench_write(s: WriteShape, in_dtype: torch.dtype, cache_dtype: torch.dtype, device: str, timer,
                triton_fn) -> dict:
    gen = torch.Generator().manual_seed(0)
    num_blocks = math.ceil(s.num_tokens / s.block_size) * 2
    shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k = torch.randn(s.num_tokens, s.num_kv_heads, s.head_dim, generator=gen).to(in_dtype).to(device)
    v = torch.randn(s.num_tokens, s.num_kv_heads, s.head_dim, generator=gen).to(in_dtype).to(device)
    slots = torch.randperm(num_blocks * s.block_size, generator=gen)[: s.num_tokens].to(device)

    def fresh() -> list[torch.Tensor | None]:
        caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
        scales = [torch.zeros(shape[:3], device=device) for _ in range(2)] if cache_dtype == torch.int8 else [None] * 2
        return caches + scales

    ref, ours = fresh(), fresh()
    ref_fn = lambda: write_kv(ref[0], ref[1], k, v, slots, ref[2], ref[3])
    row = dict(kernel="write_kv", shape=s.name, **{k_: v_ for k_, v_ in asdict(s).items() if k_ != "name"},
               q_dtype=str(in_dtype).removeprefix("torch."), cache_dtype=str(cache_dtype).removeprefix("torch."),
               kv_bytes=2 * s.num_tokens * s.num_kv_heads * s.head_dim * (in_dtype.itemsize + cache_dtype.itemsize),
               torch_s=timer(ref_fn))
    if triton_fn is not None:
        tri_fn = lambda: triton_fn(ours[0], ours[1], k, v, slots, ours[2], ours[3])
        tri_fn()
        # Worst absolute difference over the caches (int8: in quantization steps) after the same write.
        row["max_abs_diff"] = max((a.double() - b.double()).abs().max().item()
                                  for a, b in zip(ours, ref) if a is not None)
        row["triton_s"] = timer(tri_fn)
    return row


def print_table(rows: list[dict]) -> None:
    head = f"{'kernel':<17}{'shape':<22}{'q/in':<9}{'cache':<9}{'torch us':>10}{'triton us':>11}{'speedup':>9}" \
           f"{'triton GB/s':>12}{'error':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        tri = r.get("triton_s")
        err = r.get("rel_err", r.get("max_abs_diff"))
        print(f"{r['kernel']:<17}{r['shape']:<22}{r['q_dtype']:<9}{r['cache_dtype']:<9}{r['torch_s'] * 1e6:>10.1f}"
              + (f"{tri * 1e6:>11.1f}{r['torch_s'] / tri:>8.2f}x{r['kv_bytes'] / tri / 1e9:>12.1f}"
                 if tri else f"{'-':>11}{'-':>9}{'-':>12}")
              + (f"{err:>10.1e}" if err is not None else f"{'-':>10}"))
    print("error: decode = ||triton - torch|| / ||torch||; write_kv = max |difference| over the caches")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true",
                    help="on CPU, run the Triton kernels in Triton's interpreter too (slow; small shapes)")
    ap.add_argument("--quick", action="store_true", help="first shape of each kind only")
    ap.add_argument("--repeats", type=int, default=10, help="CPU timing repeats (median)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; on a shared, busy machine 1 gives steadier numbers)")
    ap.add_argument("--output", type=Path, default=ROOT / "bench-results" / "kernels.json")
    args = ap.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.interpret:
        if device == "cuda":
            print("--interpret is for CPU machines; this one has CUDA, running the compiled kernels")
        else:
            os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    run_triton = device == "cuda" or args.interpret
    attn_fn = write_fn = None
    if run_triton:
        from baton.kernels.triton_attention import paged_attention_decode_triton, write_kv_triton

        attn_fn, write_fn = paged_attention_decode_triton, write_kv_triton
    else:
        print("No CUDA: timing the torch paths only (Triton kernels need CUDA; --interpret runs them in "
              "Triton's CPU interpreter to check them, which says nothing about their speed)")

    if device == "cuda":
        attn_shapes, write_shapes = GPU_ATTN, GPU_WRITE
        attn_dtypes = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                       (torch.bfloat16, torch.int8), (torch.float32, torch.float32)]
        write_dtypes = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8)]
    else:
        attn_shapes, write_shapes = (INTERP_ATTN, INTERP_WRITE) if args.interpret else (CPU_ATTN, CPU_WRITE)
        attn_dtypes = [(torch.float32, torch.float32), (torch.float32, torch.int8), (torch.bfloat16, torch.bfloat16)]
        write_dtypes = [(torch.float32, torch.float32), (torch.float32, torch.int8)]
    if args.quick:
        attn_shapes, write_shapes = attn_shapes[:1], write_shapes[:1]
    timer = make_timer(device, 2 if args.interpret else args.repeats)

    rows = []
    for s in attn_shapes:
        for q_dtype, cache_dtype in attn_dtypes:
            rows.append(bench_attention(s, q_dtype, cache_dtype, device, timer, attn_fn))
    for s in write_shapes:
        for in_dtype, cache_dtype in write_dtypes:
            rows.append(bench_write(s, in_dtype, cache_dtype, device, timer, write_fn))
    print_table(rows)

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        torch=torch.__version__, triton=triton_version, torch_threads=torch.get_num_threads(),
        triton_mode="cuda" if device == "cuda" else "interpreter" if args.interpret else "not run",
        note="interpreter timings measure Triton's CPU interpreter, not the kernels" if args.interpret else "",
        results=rows,
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
