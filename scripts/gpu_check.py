"""One-shot check of the Triton paged-KV kernels on a CUDA machine (installs nothing).

    python scripts/gpu_check.py              # CUDA: every kernel vs its torch reference, then timings
    python scripts/gpu_check.py --allow-cpu  # no CUDA: Triton's interpreter on a couple of small shapes

What it does on CUDA (a few minutes at most, mostly Triton compiles):
1. decode attention (kernels/triton_attention.py) against ``paged_attention_decode`` for every
   (query, cache) dtype pair (float32, float16, bfloat16, int8 caches with each query dtype), GQA
   ratios 1/3/8, head dims 64/128, block sizes 16/32, mixed lengths (1, a block, a block + 1, long)
   and random block tables: relative norm error ||out - ref|| / ||ref|| under a bound per query dtype;
   int8 also against float32 attention over the unquantized values;
2. the KV write against ``write_kv`` for every cache dtype: float caches must be bitwise equal; int8
   values may differ by at most 1 (the table shows how many differ; 0 is expected) and scales by 1e-6;
3. timings against the torch paths (triton.testing.do_bench) on a few shapes, as a table.
Exit status: 0 all checks passed; 1 a check failed; 2 no CUDA and no --allow-cpu.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DECODE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
INT8_VS_FLOAT_TOL = 2e-2
DTYPE_PAIRS = [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.int8), (torch.float16, torch.int8), (torch.bfloat16, torch.int8),
]
# (group, num_kv_heads, head_dim, block_size, lens)
GPU_DECODE_SHAPES = [
    (1, 2, 64, 16, [1, 16, 17, 300]),
    (3, 3, 64, 32, [33, 1, 1000, 64, 65]),
    (8, 1, 128, 16, [1, 517, 2000]),
    (8, 2, 128, 32, [32, 33, 4097]),
]
CPU_DECODE_SHAPES = [(3, 2, 64, 16, [1, 16, 17, 200]), (8, 1, 128, 32, [33, 70])]
# (num_tokens, num_kv_heads, head_dim, block_size)
GPU_WRITE_SHAPES = [(1, 8, 128, 16), (777, 3, 64, 32), (4096, 8, 128, 16)]
CPU_WRITE_SHAPES = [(5, 3, 64, 16), (40, 2, 128, 32)]
# (name, batch, group, num_kv_heads, head_dim, block_size, context)
TIMING_SHAPES = [
    ("smollm2 b1 ctx512", 1, 3, 3, 64, 16, 512),
    ("smollm2 b32 ctx1024", 32, 3, 3, 64, 16, 1024),
    ("llama8b b1 ctx4096", 1, 4, 8, 128, 16, 4096),
    ("llama8b b16 ctx2048", 16, 4, 8, 128, 16, 2048),
    ("llama8b b64 ctx1024", 64, 4, 8, 128, 32, 1024),
]


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return ((a64 - b64).norm() / b64.norm()).item()


def decode_inputs(pa, gen: torch.Generator, lens: list[int], group: int, num_kv_heads: int, head_dim: int,
                  block_size: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, device: str) -> dict:
    """A random paged cache (blocks shuffled, table tails pointing anywhere) and a decode batch."""
    per_seq = [math.ceil(n / block_size) for n in lens]
    max_blocks, num_blocks = max(per_seq) + 1, sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=gen)
    used = 0
    for b, nb in enumerate(per_seq):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_float, v_float = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q_float = torch.randn(len(lens), group * num_kv_heads, head_dim, generator=gen)
    d = dict(q=q_float.to(q_dtype), block_tables=tables, seq_lens=torch.tensor(lens), scale=head_dim ** -0.5,
             k_scale=None, v_scale=None, q_float=q_float, k_float=k_float, v_float=v_float)
    if cache_dtype == torch.int8:
        d["k_cache"], d["k_scale"] = pa.quantize_int8(k_float)
        d["v_cache"], d["v_scale"] = pa.quantize_int8(v_float)
    else:
        d["k_cache"], d["v_cache"] = k_float.to(cache_dtype), v_float.to(cache_dtype)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def check_decode(pa, ta, shapes, device: str, rows: list) -> bool:
    ok = True
    gen = torch.Generator().manual_seed(0)
    for group, kvh, hd, bs, lens in shapes:
        for q_dtype, cache_dtype in DTYPE_PAIRS:
            d = decode_inputs(pa, gen, lens, group, kvh, hd, bs, q_dtype, cache_dtype, device)
            args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["seq_lens"], d["scale"])
            scales = dict(k_scale=d["k_scale"], v_scale=d["v_scale"])
            out = ta.paged_attention_decode_triton(*args, **scales)
            ref = pa.paged_attention_decode(*args, **scales)
            err = rel_err(out, ref)
            tol = DECODE_TOL[q_dtype]
            passed = out.dtype == q_dtype and bool(torch.isfinite(out.float()).all()) and err <= tol
            extra = ""
            if cache_dtype == torch.int8 and q_dtype == torch.float32:
                fref = pa.paged_attention_decode(d["q_float"], d["k_float"], d["v_float"], d["block_tables"],
                                                 d["seq_lens"], d["scale"])
                ferr = rel_err(out, fref)
                passed = passed and ferr <= INT8_VS_FLOAT_TOL
                extra = f"vs unquantized {ferr:.1e} (<= {INT8_VS_FLOAT_TOL:.0e})"
            ok = ok and passed
            rows.append(("decode", f"g{group} kv{kvh} d{hd} bs{bs} lens{lens}", name(q_dtype), name(cache_dtype),
                         f"{err:.1e} (<= {tol:.0e}) {extra}", passed))
    return ok


def check_write(pa, ta, shapes, device: str, rows: list) -> bool:
    ok = True
    gen = torch.Generator().manual_seed(1)
    for tokens, kvh, hd, bs in shapes:
        num_blocks = math.ceil(tokens / bs) + 2
        shape = (num_blocks, bs, kvh, hd)
        for cache_dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
            for in_dtype in (torch.float32, torch.bfloat16):
                # k, v as views into one fused buffer (non-contiguous), scaled so int8 rounding matters
                kv = (torch.randn(tokens, 2 * kvh, hd, generator=gen) * 3).to(in_dtype)
                k, v = kv[:, :kvh], kv[:, kvh:]
                slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
                if cache_dtype == torch.int8:
                    base = [torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen) for _ in range(2)] \
                        + [torch.rand(shape[:3], generator=gen) for _ in range(2)]
                else:
                    base = [torch.randn(shape, generator=gen).to(cache_dtype) for _ in range(2)] + [None, None]
                ref = [None if t is None else t.clone().to(device) for t in base]
                ours = [None if t is None else t.clone().to(device) for t in base]
                dk, dv, ds = k.to(device), v.to(device), slots.to(device)
                pa.write_kv(ref[0], ref[1], dk, dv, ds, ref[2], ref[3])
                ta.write_kv_triton(ours[0], ours[1], dk, dv, ds, ours[2], ours[3])
                if cache_dtype == torch.int8:
                    diffs = [(a.int() - b.int()).abs() for a, b in zip(ours[:2], ref[:2])]
                    n_diff = sum(int((x > 0).sum()) for x in diffs)
                    max_diff = max(int(x.max()) for x in diffs)
                    scale_err = max(((a - b).abs() / b.abs().clamp(min=1e-30)).max().item()
                                    for a, b in zip(ours[2:], ref[2:]))
                    passed = max_diff <= 1 and scale_err <= 1e-6
                    detail = f"{n_diff} int8 values differ (max {max_diff}); scale rel diff {scale_err:.1e}"
                else:
                    passed = all(torch.equal(a, b) for a, b in zip(ours[:2], ref[:2]))
                    detail = "bitwise equal" if passed else "NOT bitwise equal"
                ok = ok and passed
                rows.append(("write_kv", f"t{tokens} kv{kvh} d{hd} bs{bs}", name(in_dtype), name(cache_dtype),
                             detail, passed))
    return ok


def print_checks(rows: list) -> None:
    print(f"{'kernel':<10}{'shape':<38}{'q/in':<10}{'cache':<10}{'result':<8}detail")
    for kernel, shape, qd, cd, detail, passed in rows:
        print(f"{kernel:<10}{shape:<38}{qd:<10}{cd:<10}{'ok' if passed else 'FAIL':<8}{detail}")


def time_kernels(pa, ta) -> None:
    from triton.testing import do_bench

    bench = lambda fn, *args, **kwargs: do_bench(partial(fn, *args, **kwargs), warmup=10, rep=50)  # ms
    gen = torch.Generator().manual_seed(2)
    print(f"\n{'shape':<22}{'q':<10}{'cache':<8}{'torch us':>10}{'triton us':>11}{'speedup':>9}{'triton GB/s':>13}")
    for label, batch, group, kvh, hd, bs, ctx in TIMING_SHAPES:
        for q_dtype, cache_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8)):
            d = decode_inputs(pa, gen, [ctx] * batch, group, kvh, hd, bs, q_dtype, cache_dtype, "cuda")
            args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["seq_lens"], d["scale"])
            scales = dict(k_scale=d["k_scale"], v_scale=d["v_scale"])
            mask = pa.decode_key_mask(d["block_tables"], d["seq_lens"], bs)
            t_ref = bench(pa.paged_attention_decode, *args, key_mask=mask, **scales)
            t_tri = bench(ta.paged_attention_decode_triton, *args, **scales)
            # Bytes of K/V (and scales) in the contexts: what a decode step has to read at least.
            nbytes = 2 * batch * ctx * kvh * (hd * d["k_cache"].element_size() + (4 if d["k_scale"] is not None else 0))
            print(f"{label:<22}{name(q_dtype):<10}{name(cache_dtype):<8}{t_ref * 1e3:>10.1f}{t_tri * 1e3:>11.1f}"
                  f"{t_ref / t_tri:>8.2f}x{nbytes / (t_tri * 1e-3) / 1e9:>13.1f}")
    print(f"\n{'write_kv':<22}{'in':<10}{'cache':<8}{'torch us':>10}{'triton us':>11}{'speedup':>9}")
    for tokens, kvh, hd, bs in GPU_WRITE_SHAPES:
        for cache_dtype in (torch.bfloat16, torch.int8):
            shape = (math.ceil(tokens / bs) * 2, bs, kvh, hd)
            caches = [torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(2)]
            scales = [torch.zeros(shape[:3], device="cuda") for _ in range(2)] if cache_dtype == torch.int8 \
                else [None, None]
            k = torch.randn(tokens, kvh, hd, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(tokens, kvh, hd, device="cuda", dtype=torch.bfloat16)
            slots = torch.randperm(shape[0] * bs, device="cuda")[:tokens]
            t_ref = bench(pa.write_kv, *caches, k, v, slots, *scales)
            t_tri = bench(ta.write_kv_triton, *caches, k, v, slots, *scales)
            print(f"{f't{tokens} kv{kvh} d{hd}':<22}{'bfloat16':<10}{name(cache_dtype):<8}{t_ref * 1e3:>10.1f}"
                  f"{t_tri * 1e3:>11.1f}{t_ref / t_tri:>8.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check the Triton paged-KV kernels against the torch references.")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="without CUDA, run the checks in Triton's CPU interpreter on small shapes "
                         "(exit 0 if they pass)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda:
        print("gpu_check: no CUDA device visible to torch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}).")
        if not args.allow_cpu:
            print("Run it on a CUDA machine, or pass --allow-cpu to run the checks in Triton's CPU interpreter.")
            return 2
        print("--allow-cpu: running the checks in Triton's interpreter on small shapes (no timings).")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import triton

    import baton.kernels.paged_attention as pa
    import baton.kernels.triton_attention as ta

    device = "cuda" if cuda else "cpu"
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          + (f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
             if cuda else "interpreter on CPU"))
    rows: list = []
    ok = check_decode(pa, ta, GPU_DECODE_SHAPES if cuda else CPU_DECODE_SHAPES, device, rows)
    ok = check_write(pa, ta, GPU_WRITE_SHAPES if cuda else CPU_WRITE_SHAPES, device, rows) and ok
    print_checks(rows)
    print(f"checks: {sum(r[-1] for r in rows)}/{len(rows)} passed ({time.perf_counter() - start:.0f} s so far)")
    if cuda:
        time_kernels(pa, ta)
    print(f"{'ALL CHECKS PASSED' if ok else 'SOME CHECKS FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
