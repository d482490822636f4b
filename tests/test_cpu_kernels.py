"""The C kernels of kernels/cpu_kernels.c against their torch references (kernels/cpu.py,
kernels/paged_attention.py), the build cache, and the engine's q4 weight mode on the default model.

How results are compared:
- block-quantized matmuls: against ``reference_gemm`` (the same int8 activation rounding and the
  dequantized weight, in float64): only float32 summation order differs, so 1e-5 relative.
- quantizing weights that already lie on a q4_1 / q8_0 grid gives the same values back (the
  default model's GGUF tensors), to float32 rounding.
- bfloat16 matmul and RMSNorm: against torch in float32, within one bfloat16 rounding (2^-8).
- paged decode attention: against ``paged_attention_decode`` (float32 bound 1e-5 relative).
- sliding windows: the references against attention over the window's keys sliced out, then every C
  attention path against the references with windows across block, key-block and tile edges.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.kernels import cpu
from baton.kernels.paged_attention import Chunks, paged_attention_decode, paged_attention_prefill

ROOT = Path(__file__).resolve().parents[1]
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def q4_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return cpu.gemm_q4_1(x, cpu.pack_q4_1(*cpu.quantize_q4_1(w)), bias, n=w.shape[0])


@PROPERTY
@given(m=st.integers(1, 19), n=st.integers(1, 70), blocks=st.integers(1, 6), seed=st.integers(0, 10**6),
       bias=st.booleans(), threads=st.sampled_from([1, 2]))
def test_block_quantized_matmuls_match_reference(m, n, blocks, seed, bias, threads) -> None:
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q4 = cpu.quantize_q4_1(w)
        y4 = cpu.gemm_q4_1(x, cpu.pack_q4_1(*q4), b, n=n)
        q8 = cpu.quantize_q8_0(w)
        y8 = cpu.gemm_q8_0(x, *q8, b)
    finally:
        torch.set_num_threads(old)
    assert y4.shape == y8.shape == (m, n)
    assert rel(y4, cpu.reference_gemm(x, cpu.dequantize_q4_1(*q4), b)) < 1e-5
    assert rel(y8, cpu.reference_gemm(x, cpu.dequantize_q8_0(*q8), b)) < 1e-5


def test_block_quantized_matmuls_stay_close_to_float32() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=g)
    w = torch.randn(64, 256, generator=g) * 0.1
    ref = F.linear(x, w)
    assert rel(cpu.gemm_q8_0(x, *cpu.quantize_q8_0(w)), ref) < 0.02
    assert rel(q4_matmul(x, w), ref) < 0.15


def test_zero_rows_and_blocks_do_not_divide_by_zero() -> None:
    w = torch.zeros(4, 64)
    w[1, 32:] = 0.5  # one constant block: q4_1 scale 0, offset 0.5
    x = torch.zeros(3, 64)
    x[2] = 1.0
    for y in (q4_matmul(x, w), cpu.gemm_q8_0(x, *cpu.quantize_q8_0(w))):
        assert torch.isfinite(y).all()
        assert y[:2].abs().max() == 0
        assert y[2, 1].item() == pytest.approx(16.0)


def test_weights_on_the_grid_come_back_exactly() -> None:
    """Weights stored as q4_1 / q8_0 (the default GGUF's layers and embedding) keep their values."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (8, 4, 32), generator=g).float()
    q[:, :, 0], q[:, :, 1] = 0, 15  # a quantizer puts each block's extremes on 0 and 15
    d = torch.rand(8, 4, 1, generator=g) * 0.01 + 1e-3
    m = -torch.rand(8, 4, 1, generator=g) * 0.1
    w4 = (q * d + m).reshape(8, 128)
    assert torch.allclose(cpu.dequantize_q4_1(*cpu.quantize_q4_1(w4)), w4, rtol=0, atol=1e-6)
    q8 = torch.randint(-127, 128, (8, 4, 32), generator=g).float()
    q8[:, :, 0] = 127
    w8 = (q8 * d).reshape(8, 128)
    assert torch.allclose(cpu.dequantize_q8_0(*cpu.quantize_q8_0(w8)), w8, rtol=0, atol=1e-6)


def test_q4_1_packing_interleaves_sixteen_rows() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(20, 64, generator=g)
    qs, d, m = cpu.quantize_q4_1(w)
    packed = cpu.pack_q4_1(qs, d, m)
    assert packed.shape == (2, 2, 384) and packed.dtype == torch.uint8  # 20 rows -> 2 tiles; 2 blocks
    # tile 1, block 0, nibble group 2: byte 4c + i is row 16 + c's byte 8 + i of block 0
    assert torch.equal(packed[1, 0, 128:144], qs[16:20, 8:12].flatten())
    assert not packed[1, 0, 144:192].any()  # rows past N are zero
    scales = packed[0, 1, 256:].view(torch.float32)
    assert torch.equal(scales[:16], d[:16, 1]) and torch.equal(scales[16:], m[:16, 1])
    for a, b in zip(cpu.unpack_q4_1(packed, 20), (qs, d, m)):
        assert torch.equal(a, b)


def test_no_rows_give_an_empty_result() -> None:
    """A pass can sample no row (a prefill chunk that ends mid-prompt): the LM head gets 0 rows."""
    w = torch.randn(8, 64)
    x = torch.zeros(0, 64)
    assert q4_matmul(x, w).shape == (0, 8)
    assert cpu.gemm_q8_0(x, *cpu.quantize_q8_0(w)).shape == (0, 8)
    if cpu.has_bf16_gemm():
        assert cpu.gemm_bf16(x.bfloat16(), cpu.pack_bf16(w.bfloat16()), n=8).shape == (0, 8)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        cpu.quantize_q4_1(torch.randn(4, 48))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu.paged_decode(torch.randn(1, 2, 8).half(), torch.zeros(1, 4, 1, 8).half(),
                         torch.zeros(1, 4, 1, 8).half(), torch.zeros(1, 1, dtype=torch.int64),
                         torch.ones(1, dtype=torch.int64), 1.0)


def test_bf16_packing_round_trips() -> None:
    w = torch.randn(70, 50).bfloat16()
    packed = cpu.pack_bf16(w)
    assert packed.shape == (96, 50)  # 70 columns padded to three tiles of 32
    assert torch.equal(cpu.unpack_bf16(packed, 70), w)
    # a tile starts with the first input pair of its 32 columns: W[0, 0], W[0, 1], W[1, 0], W[1, 1], ...
    assert torch.equal(packed.flatten()[:4], torch.stack([w[0, 0], w[0, 1], w[1, 0], w[1, 1]]))
    assert not cpu.unpack_bf16(packed, 96)[70:].any()  # padding columns are zero
    with pytest.raises(ValueError, match="even number of inputs"):
        cpu.pack_bf16(torch.randn(4, 7))


# The bfloat16 matmul's and prefill attention's paths on this CPU: vdpbf16ps always, AMX tiles where the CPU
# and the OS allow them.
AMX_PATHS = [False] + ([True] if cpu.available() and cpu.amx() else [])


@contextlib.contextmanager
def amx_path(on: bool):
    was = cpu.amx()
    assert cpu.set_amx(on) == on
    try:
        yield
    finally:
        cpu.set_amx(was)


@pytest.mark.skipif(not cpu.has_bf16_gemm(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("amx", AMX_PATHS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("m", "k"), [(1, 192), (3, 50), (8, 192), (12, 64), (13, 192), (16, 64), (17, 192),
                                    (40, 96), (300, 64), (20, 50)])
def test_bf16_matmul_matches_float32(m: int, k: int, threads: int, amx: bool) -> None:
    """Row counts on both sides of the kernel's 12-row tiles, AMX's 16- and 32-row tiles and 256-row
    blocks; 70 columns leave a partial tile; any even input width (AMX takes multiples of 32)."""
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(70, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(70, generator=g).bfloat16()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with amx_path(amx):
            y = cpu.gemm_bf16(x, cpu.pack_bf16(w), b, n=70)
            no_bias = cpu.gemm_bf16(x, cpu.pack_bf16(w), n=70)
    finally:
        torch.set_num_threads(old)
    ref = F.linear(x.float(), w.float(), b.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, 70)
    assert ((y.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-3).all()
    ref = F.linear(x.float(), w.float())
    assert ((no_bias.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-3).all()


@pytest.mark.skipif(not cpu.has_bf16_gemm(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("amx", AMX_PATHS)
def test_bf16_matmul_gives_a_row_the_same_bits_in_any_pass_size(amx: bool) -> None:
    """A row's outputs do not depend on the rows beside it: 37 rows at once, one by one, and in passes of
    5, 16 and 32 give the same bits (a prefix-cache hit changes a prompt's pass sizes, not its output)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, 96, generator=g).bfloat16()
    packed = cpu.pack_bf16((torch.randn(70, 96, generator=g) * 0.1).bfloat16())
    with amx_path(amx):
        whole = cpu.gemm_bf16(x, packed, n=70)
        for size in (1, 5, 16, 32):
            parts = torch.cat([cpu.gemm_bf16(x[i:i + size], packed, n=70) for i in range(0, 37, size)])
            assert torch.equal(parts, whole), size


@pytest.mark.skipif(not cpu.has_bf16_gemm(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("amx", AMX_PATHS)
@pytest.mark.parametrize("m", [5, 21])
def test_bf16_matmul_float32_output_is_the_bfloat16_result_widened(m: int, amx: bool) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, 64, generator=g).bfloat16()
    packed = cpu.pack_bf16(torch.randn(40, 64, generator=g).bfloat16())
    bias = torch.randn(40, generator=g).bfloat16()
    with amx_path(amx):
        wide = cpu.gemm_bf16(x, packed, bias, n=40, out_dtype=torch.float32)
        assert wide.dtype == torch.float32 and torch.equal(wide, cpu.gemm_bf16(x, packed, bias, n=40).float())


@PROPERTY
@given(m=st.integers(0, 5), n=st.integers(1, 100), seed=st.integers(0, 10**6), ties=st.booleans(),
       special=st.sampled_from([None, "nan", "-inf", "inf"]))
def test_argmax_rows_matches_torch(m, n, seed, ties, special) -> None:
    """First index among equals, a NaN counts as the largest: torch.argmax's rules."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g)
    if ties:
        x = torch.round(x)  # many equal values, equal maxima among them
    if special and m:
        x[0, torch.randint(0, n, (2,), generator=g)] = float(special)
    assert torch.equal(cpu.argmax_rows(x), x.argmax(dim=-1))


@PROPERTY
@given(m=st.integers(1, 6), n=st.integers(1, 200), seed=st.integers(0, 10**6),
       words=st.sampled_from(["random", "zeros", "ones", "mixed"]), short=st.booleans())
def test_mask_rows_matches_the_torch_reference(m, n, seed, words, short) -> None:
    """Structured output's mask: in place on the chosen rows only, every disallowed token and every token
    past the mask at -inf, the rest untouched."""
    from baton.engine.sampling import unpack_bitmask

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g)
    rows = torch.randperm(m, generator=g)[: max(1, m // 2)]
    nwords = max(1, (n + 31) // 32 - (1 if short else 0))  # short: the mask ends before the vocabulary
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), nwords), dtype=torch.int32, generator=g)
    if words in ("zeros", "mixed"):
        bitmask[:, ::2] = 0
    if words in ("ones", "mixed"):
        bitmask[:, 1::2] = -1
    want = x.clone()
    want[rows] = x[rows].masked_fill(~unpack_bitmask(bitmask, n), float("-inf"))
    got = cpu.mask_rows_(x.clone(), rows, bitmask)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 96, generator=g) * 4).to(dtype)
    delta = torch.randn(5, 96, generator=g).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    expect_x = x + delta
    xf = expect_x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    expect = (w * normed.to(dtype)) if dtype == torch.bfloat16 else normed * w
    out = cpu.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, expect_x)  # the residual add happened in place, rounded like torch's
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(out.float(), expect.float(), rtol=tol, atol=tol)
    before = x.clone()
    cpu.add_rms_norm(x, None, w, 1e-5)
    assert torch.equal(x, before)


@PROPERTY
@given(batch=st.integers(1, 5), lens=st.lists(st.integers(1, 70), min_size=5, max_size=5),
       block_size=st.sampled_from([1, 4, 16]), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3]),
       head_dim=st.sampled_from([16, 64, 128]), seed=st.integers(0, 10**6), threads=st.sampled_from([1, 2]),
       window=st.none() | st.integers(1, 80))
def test_paged_decode_matches_reference(batch, lens, block_size, kv_heads, group, head_dim, seed, threads,
                                        window) -> None:
    """Head sizes 64 and 128 take the vectorized path (on AVX-512 CPUs); others the portable one; with or
    without a sliding window."""
    g = torch.Generator().manual_seed(seed)
    lens_t = torch.tensor(lens[:batch])
    max_blocks = (int(lens_t.max()) + block_size - 1) // block_size + 1  # one spare column past every context
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g)
    ref = paged_attention_decode(q, k_cache, v_cache, tables, lens_t, 0.25, window=window)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu.paged_decode(q, k_cache, v_cache, tables, lens_t, 0.25, window)
        out_bf16 = cpu.paged_decode(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, lens_t, 0.25,
                                    window)
    finally:
        torch.set_num_threads(old)
    assert rel(out, ref) < 1e-5
    ref_bf16 = paged_attention_decode(q.bfloat16().float(), k_cache.bfloat16().float(), v_cache.bfloat16().float(),
                                      tables, lens_t, 0.25, window=window)
    assert out_bf16.dtype == torch.bfloat16 and rel(out_bf16.float(), ref_bf16) < 1e-2


@pytest.mark.parametrize(("ctx", "n", "block_size"), [(40, 40, 16), (70, 23, 16), (37, 5, 4), (9, 1, 4)])
def test_prefill_attention_is_causal_attention_over_the_prefix(ctx: int, n: int, block_size: int) -> None:
    """A prompt chunk of n tokens after ctx - n cached ones, through a shuffled block table: the
    span's causal mask (query i sees keys 0..ctx - n + i), as SDPA computes it."""
    g = torch.Generator().manual_seed(ctx * n)
    blocks = -(-ctx // block_size)
    k_cache = torch.randn(blocks + 3, block_size, 3, 64, generator=g)
    v_cache = torch.randn(blocks + 3, block_size, 3, 64, generator=g)
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
    q = torch.randn(n, 9, 64, generator=g)
    keys = k_cache.view(-1, 3, 64)[slots].transpose(0, 1)
    values = v_cache.view(-1, 3, 64)[slots].transpose(0, 1)
    mask = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=0.125,
                                         enable_gqa=True).transpose(0, 1)
    assert rel(cpu.prefill_attention(q, k_cache, v_cache, slots, 0.125), ref) < 1e-5
    out = cpu.prefill_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), slots, 0.125)
    assert out.dtype == torch.bfloat16 and rel(out.float(), ref) < 2e-2


def test_windowed_references_are_attention_over_the_window_alone() -> None:
    """The references' sliding window (a mask) against attention over the window's keys sliced out of the
    context, one query at a time: the query at position p over keys max(0, p - W + 1) .. p."""
    g = torch.Generator().manual_seed(11)
    bs, kv_heads, group, d, ctx, n = 4, 2, 3, 16, 45, 30
    k_cache = torch.randn(16, bs, kv_heads, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(16, bs, kv_heads, d, generator=g, dtype=torch.float64)
    table = torch.randperm(16, generator=g)[:12]
    slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:ctx]
    q = torch.randn(n, kv_heads * group, d, generator=g, dtype=torch.float64)
    keys, values = k_cache.view(-1, kv_heads, d)[slots], v_cache.view(-1, kv_heads, d)[slots]
    for window in (1, 5, 16, 40, 100):
        pre = torch.zeros_like(q)
        paged_attention_prefill(q, k_cache, v_cache, Chunks.of([(0, n, slots)], bs), 0.3, pre, window=window)
        dec = paged_attention_decode(q, k_cache, v_cache, table.expand(n, -1), torch.arange(ctx - n + 1, ctx + 1),
                                     0.3, window=window)
        for i in range(n):
            p = ctx - n + i
            lo = max(0, p - window + 1)
            want = F.scaled_dot_product_attention(q[i, :, None], keys[lo:p + 1].transpose(0, 1),
                                                  values[lo:p + 1].transpose(0, 1), scale=0.3,
                                                  enable_gqa=True)[:, 0]
            assert torch.allclose(pre[i], want, atol=1e-12) and torch.allclose(dec[i], want, atol=1e-12)


def prefill_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention in float64 of the last q.shape[0] positions over keys/values [ctx, kv_heads, d] (over
    each query's last ``window`` keys with a sliding window)."""
    from baton.kernels.paged_attention import causal_mask

    n = q.shape[0]
    mask = causal_mask(n, ctx, window)
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), keys.double().transpose(0, 1),
                                          values.double().transpose(0, 1), attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


PREFILL_CASES = [  # (chunks as (cached tokens, chunk length), block_size, kv_heads, group, head_dim)
    ([(0, 1)], 16, 3, 3, 64),
    ([(0, 15), (0, 16), (0, 17)], 16, 3, 3, 64),          # block edges
    ([(0, 63), (1, 64), (64, 65)], 16, 2, 4, 64),         # key-block edges (64), cached prefixes
    ([(200, 31), (7, 32), (33, 33)], 4, 1, 8, 128),       # query-tile edges (32), small blocks
    ([(100, 300)], 32, 4, 1, 32),                         # no grouping, a long chunk
    ([(5, 70), (0, 3)], 16, 1, 16, 96),                   # the widest group; a head size of 6 vectors
]


@pytest.mark.skipif(not cpu.has_prefill_attention(64, torch.float32), reason="the tiled prefill kernel needs AVX-512")
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("chunks", "block_size", "kv_heads", "group", "head_dim"), PREFILL_CASES)
def test_tiled_prefill_matches_causal_attention(chunks: list[tuple[int, int]], block_size: int, kv_heads: int,
                                                group: int, head_dim: int, kind: str) -> None:
    """Several chunks in one call, each after its own cached prefix, through shuffled block tables:
    every chunk row equals causal attention over its sequence's keys (dequantized for int8, as
    gather_kv reads them); rows of no chunk are left alone. float32 queries within 1e-5 (summation
    order only); bfloat16 within 1e-2 of the float64 result on the same bfloat16 inputs (the
    probabilities are rounded to bfloat16 before the value products, as torch's CPU flash attention
    does: about 2^-9 relative)."""
    check_tiled_prefill(chunks, block_size, kv_heads, group, head_dim, kind, None)


@pytest.mark.skipif(not cpu.has_prefill_attention(64, torch.float32), reason="the tiled prefill kernel needs AVX-512")
@pytest.mark.parametrize("window", [1, 16, 33, 64, 100])
@pytest.mark.parametrize(("chunks", "block_size", "kv_heads", "group", "head_dim"), PREFILL_CASES[1:])
def test_tiled_prefill_with_a_sliding_window_matches_windowed_attention(
        chunks: list[tuple[int, int]], block_size: int, kv_heads: int, group: int, head_dim: int, window: int) -> None:
    """The same with a sliding window: one key, a block, past a block, a key block (64), wider than the
    tiles; every cache kind."""
    for kind in ("float32", "bfloat16", "int8"):
        check_tiled_prefill(chunks, block_size, kv_heads, group, head_dim, kind, window)


def check_tiled_prefill(chunks: list[tuple[int, int]], block_size: int, kv_heads: int, group: int, head_dim: int,
                        kind: str, window: int | None) -> None:
    from baton.kernels.paged_attention import quantize_int8

    g = torch.Generator().manual_seed(sum(a * 31 + b for a, b in chunks) + head_dim)
    ctxs = [a + b for a, b in chunks]
    blocks = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(blocks) + 5
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 2
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    if kind == "int8":
        (kc, ks), (vc, vs) = quantize_int8(k), quantize_int8(v)
        keys_all, values_all = kc.float() * ks[..., None], vc.float() * vs[..., None]
    else:
        dtype = getattr(torch, kind)
        kc, vc, ks, vs = k.to(dtype), v.to(dtype), None, None
        keys_all, values_all = kc.float(), vc.float()
    perm = torch.randperm(num_blocks, generator=g)
    tables, seq_slots, at = [], [], 0
    for c, nb in zip(ctxs, blocks):
        table = perm[at:at + nb]
        at += nb
        tables.append(table)
        seq_slots.append((table[:, None] * block_size + torch.arange(block_size)).flatten()[:c])
    rows = sum(b for _, b in chunks) + 2  # two rows of no chunk, first and last
    starts = list(torch.tensor([1] + [b for _, b in chunks[:-1]]).cumsum(0))
    for qdtype, amx in [(torch.float32, False)] + [(torch.bfloat16, on) for on in AMX_PATHS]:
        q = torch.randn(rows, kv_heads * group, head_dim, generator=g).to(qdtype)
        out = torch.full_like(q, 7.0)
        spans = [(int(st), b, sl) for st, (_, b), sl in zip(starts, chunks, seq_slots)]
        with amx_path(amx):
            cpu.prefill_chunks(q, kc, vc, Chunks.of(spans, block_size), head_dim ** -0.5, out, ks, vs, window)
        assert (out[0] == 7).all() and (out[-1] == 7).all()
        flat_k, flat_v = keys_all.view(-1, kv_heads, head_dim), values_all.view(-1, kv_heads, head_dim)
        for (first, n, sl), c in zip(spans, ctxs):
            keys, values = flat_k[sl], flat_v[sl]
            if qdtype == torch.bfloat16:  # the kernel reads bfloat16 keys and values (int8: dequantized, rounded)
                keys, values = keys.bfloat16().float(), values.bfloat16().float()
            want = prefill_reference(q[first:first + n].float(), keys, values, c, head_dim ** -0.5, window)
            assert rel(out[first:first + n].float(), want) < (1e-5 if qdtype == torch.float32 else 1e-2)


@pytest.mark.skipif(not cpu.has_prefill_attention(64, torch.bfloat16), reason="the tiled prefill kernel needs AVX-512")
@pytest.mark.parametrize("amx", AMX_PATHS)
def test_tiled_prefill_follows_scores_that_keep_rising_and_a_sink(amx: bool) -> None:
    """Scores that grow along the context (each key block passes every earlier maximum by many powers of
    2, so the running max and the accumulator are rescaled block after block) and one key far above the
    rest (an attention sink): still causal attention within bfloat16's rounding."""
    g = torch.Generator().manual_seed(11)
    ctx, n, block = 700, 200, 16
    q = torch.randn(n, 4, 64, generator=g).abs().bfloat16()
    growth = torch.linspace(0.0, 6.0, ctx)[:, None, None]
    k = (torch.rand(ctx, 2, 64, generator=g) * growth).bfloat16()
    k[3] = 4.0  # a sink: far above the rest for the early queries
    v = torch.randn(ctx, 2, 64, generator=g).bfloat16()
    blocks = -(-ctx // block)
    perm = torch.randperm(blocks + 2, generator=g)[:blocks]
    slots = (perm[:, None] * block + torch.arange(block)).flatten()[:ctx]
    kc = torch.zeros(blocks + 2, block, 2, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc.view(-1, 2, 64)[slots], vc.view(-1, 2, 64)[slots] = k, v
    with amx_path(amx):
        out = cpu.prefill_attention(q, kc, vc, slots, 0.125)
    want = prefill_reference(q.float(), k.float(), v.float(), ctx, 0.125)
    assert rel(out.float(), want) < 1e-2


@pytest.mark.skipif(not cpu.has_prefill_attention(64, torch.bfloat16), reason="the tiled prefill kernel needs AVX-512")
def test_tiled_prefill_takes_chunks_in_any_thread_count_with_the_same_bits() -> None:
    """Tasks are independent: one thread or two, chunk by chunk or all in one call, the same bits."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(40, 16, 3, 64, generator=g).bfloat16()
    v = torch.randn(40, 16, 3, 64, generator=g).bfloat16()
    perm = torch.randperm(40, generator=g)
    slots_a = (perm[:20, None] * 16 + torch.arange(16)).flatten()[:300]
    slots_b = (perm[20:30, None] * 16 + torch.arange(16)).flatten()[:150]
    q = torch.randn(170, 9, 64, generator=g).bfloat16()
    spans = [(0, 100, slots_a), (100, 70, slots_b)]
    for amx in AMX_PATHS:
        outs = []
        old = torch.get_num_threads()
        try:
            with amx_path(amx):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    out = torch.empty_like(q)
                    cpu.prefill_chunks(q, k, v, Chunks.of(spans, 16), 0.125, out)
                    outs.append(out)
                one_by_one = torch.cat([cpu.prefill_attention(q[:100], k, v, slots_a, 0.125),
                                        cpu.prefill_attention(q[100:], k, v, slots_b, 0.125)])
        finally:
            torch.set_num_threads(old)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], one_by_one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_runs_a_mixed_pass_in_one_call_with_the_per_span_results(dtype: torch.dtype) -> None:
    """Two decode rows, a fresh prompt and a chunk after cached tokens, through shuffled block tables:
    the one-call path gives exactly the per-span path's output and cache, and SDPA's within rounding."""
    from baton.model.attention import AttentionMetadata, CpuAttention, DecodeBatch, LayerCache, PrefillSpan

    g = torch.Generator().manual_seed(7)
    bs, nkv, nh, hd = 4, 3, 9, 64
    k_cache = torch.randn(40, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(40, bs, nkv, hd, generator=g).to(dtype)
    perm = torch.randperm(40, generator=g).tolist()
    t0, t1, t2, t3 = perm[0:2], perm[2:6], perm[6:8], perm[8:11]

    def slots(table: list[int], start: int, stop: int) -> torch.Tensor:
        return torch.tensor([table[i // bs] * bs + i % bs for i in range(start, stop)])

    tables = torch.tensor([t0 + [0, 0], t1])
    lens = torch.tensor([7, 13])
    decode = DecodeBatch(2, tables, lens, bs)
    chunk = PrefillSpan(8, 3, slots(t3, 0, 12), torch.arange(12)[None, :] <= (9 + torch.arange(3))[:, None])
    meta = AttentionMetadata(torch.cat([slots(t0, 6, 7), slots(t1, 12, 13), slots(t2, 0, 6), slots(t3, 9, 12)]),
                             decode, (PrefillSpan(2, 6, None, None), chunk))
    q = torch.randn(11, nh, hd, generator=g).to(dtype)
    k = torch.randn(11, nkv, hd, generator=g).to(dtype)
    v = torch.randn(11, nkv, hd, generator=g).to(dtype)
    backend = CpuAttention()
    one = LayerCache(k_cache.clone(), v_cache.clone())
    out = backend.forward(q, k, v, one, meta, 0.125)
    if cpu.has_prefill_attention(hd, dtype):  # the spans in one call of the tiled kernel, the decode rows in another
        assert backend._chunks._last is not None and backend._chunks._last[0] is meta and backend._rows is None
    else:  # every row as a decode query, in one call
        assert backend._rows is not None and backend._rows[0] is meta and backend._rows[1] is not None
    per_span = LayerCache(k_cache.clone(), v_cache.clone())
    ref = super(CpuAttention, backend).forward(q, k, v, per_span, meta, 0.125)
    assert torch.equal(out, ref) and torch.equal(one.k, per_span.k) and torch.equal(one.v, per_span.v)
    # Against SDPA per sequence, over the cache as written.
    kf, vf = one.k.float().view(-1, nkv, hd), one.v.float().view(-1, nkv, hd)
    rows = [(slice(0, 1), slots(t0, 0, 7), 6), (slice(1, 2), slots(t1, 0, 13), 12),
            (slice(2, 8), slots(t2, 0, 6), 0), (slice(8, 11), slots(t3, 0, 12), 9)]
    for r, ctx_slots, first in rows:
        n, ctx = r.stop - r.start, ctx_slots.shape[0]
        mask = torch.arange(ctx)[None, :] <= (first + torch.arange(n))[:, None]
        want = F.scaled_dot_product_attention(q[r].float().transpose(0, 1), kf[ctx_slots].transpose(0, 1),
                                              vf[ctx_slots].transpose(0, 1), attn_mask=mask, scale=0.125,
                                              enable_gqa=True).transpose(0, 1)
        assert rel(out[r].float(), want) < (1e-5 if dtype == torch.float32 else 2e-2)
    # Rows the decode batch and spans leave uncovered: the per-span path, not a guess.
    gap = AttentionMetadata(meta.slot_mapping[2:], None, (PrefillSpan(0, 6, None, None),))
    assert backend.query_rows(gap, bs, 9) is None


def test_paged_decode_rejects_a_context_longer_than_its_table() -> None:
    k = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="paged decode attention failed"):
        cpu.paged_decode(torch.zeros(1, 1, 8), k, k, torch.zeros(1, 1, dtype=torch.int64),
                         torch.tensor([5]), 1.0)


def test_one_thread_takes_the_build_without_openmp_and_gets_the_same_bits() -> None:
    """Calls on one thread run the build without OpenMP (no libgomp team setup for regions that would not
    fork), calls on two the OpenMP build: the same kernels, so the same bits, on passes large enough that
    two threads split them."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(70, 256, generator=g) * 0.1
    packed, q8 = cpu.pack_q4_1(*cpu.quantize_q4_1(w)), cpu.quantize_q8_0(w)
    x, gu = torch.randn(20, 256, generator=g), torch.randn(20, 2048, generator=g)
    norm = torch.rand(256, generator=g) + 0.5
    builds, outs = [], []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            builds.append(cpu.library().baton_openmp())
            outs.append([cpu.gemm_q4_1(x, packed, n=70), cpu.gemm_q8_0(x, *q8), cpu.silu_mul(gu),
                         cpu.add_rms_norm(x.clone(), x * 0.5, norm, 1e-6), cpu.argmax_rows(gu)])
    finally:
        torch.set_num_threads(old)
    assert builds == [0, 1]
    for one, two in zip(*outs, strict=True):
        assert torch.equal(one, two)


@pytest.mark.slow  # compiles the kernels in fresh processes: about 20 s here
def test_build_is_cached_per_source_and_missing_compiler_is_a_clear_error(tmp_path: Path) -> None:
    code = ("from baton.kernels import cpu; p = cpu.build(); print(p); print(cpu.build() == p)")
    env = {**os.environ, "BATON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    path, same = out.stdout.split()
    assert Path(path).parent == tmp_path / "kernels" and Path(path).exists() and same == "True"
    env["CC"] = str(tmp_path / "no-such-compiler")
    env["BATON_CACHE_DIR"] = str(tmp_path / "other")
    code = ("from baton.kernels import cpu\ntry:\n    cpu.library()\nexcept cpu.KernelBuildError as e:\n"
            "    print('refused:', e)\nprint(cpu.available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert "refused:" in out.stdout and out.stdout.strip().endswith("False")
    # The engine: the torch backend by itself; q4 weights refused up front with the reason.
    code = ("import sys\nfrom pathlib import Path\nfrom tests.conftest import build_tiny_llama\n"
            "from baton.config import ConfigError, EngineConfig\nfrom baton.engine.engine import LLMEngine\n"
            "from baton.loader import load_model\n"
            "loaded = load_model(build_tiny_llama(Path(sys.argv[1])))\n"
            "print(type(LLMEngine(EngineConfig(kv_cache_memory=1 << 20), loaded=loaded).model.backend).__name__)\n"
            "try:\n    LLMEngine(EngineConfig(weights='q4', kv_cache_memory=1 << 20), loaded=loaded)\n"
            "except ConfigError as e:\n    print('config error:', e)\n")
    (tmp_path / "tiny").mkdir()
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny")], capture_output=True, text=True,
                         env=env, cwd=ROOT, check=True)
    assert out.stdout.splitlines()[0] == "TorchAttention"
    assert "config error: --weights q4 needs the CPU kernels: the CPU kernels need a C compiler" in out.stdout


@pytest.mark.slow  # compiles the kernels in a fresh process
def test_where_only_the_one_thread_build_compiles_it_serves_every_thread_count(tmp_path: Path) -> None:
    """A compiler that cannot make the OpenMP build (here a flag it refuses; in the field, no OpenMP runtime)
    leaves the build for one thread serving two threads too, rather than a worker that loses its kernels
    when it borrows a core."""
    code = ("import torch\nfrom baton.kernels import cpu\ncpu.FLAGS = [*cpu.FLAGS, '-fno-such-flag']\n"
            "torch.set_num_threads(2)\nlib = cpu.library()\ntorch.set_num_threads(1)\n"
            "print(lib.baton_openmp(), lib is cpu.library(), sorted(cpu._errors))")
    env = {**os.environ, "BATON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert out.stdout.split() == ["0", "True", "[False]"], out.stdout + out.stderr


@pytest.mark.slow
def test_q4_weights_on_the_default_model(default_model) -> None:
    """--weights q4: the GGUF's own q4_1 values (weights equal the float32 path's), the LM head in
    the model dtype, right greedy answers, and (with VNNI,
    where the q4_1 kernel takes every pass) a sequence's tokens the same alone as in a batch of 9.
    (Perplexity: tests/test_quant_eval.py.)"""
    from baton.api import SamplingParams
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine

    ref = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=64 << 20), loaded=default_model)
    q4 = LLMEngine(EngineConfig(dtype="float32", weights="q4", kv_cache_memory=64 << 20), loaded=default_model)
    layer_ref, layer_q4 = ref.model.layers[3], q4.model.layers[3]
    assert layer_q4.gate_up.blocks is not None and layer_q4.gate_up.block_kind == "q4_1"
    assert q4.model.lm_head.block_kind == ("bf16" if cpu.has_bf16_gemm() else None)
    assert torch.allclose(layer_q4.gate_up.values(), layer_ref.gate_up.values(), rtol=0, atol=1e-6)
    assert layer_q4.gate_up.nbytes * 5 < layer_ref.gate_up.nbytes  # 5 bits a weight (with scales) vs 32
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
                 "Who wrote Romeo and Juliet?"]
    prompts = [ref.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in questions]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs_q4 = q4.generate(prompts, params)
    # int8-rounded activations move logits slightly; the answers stay right. (The first question is
    # a near tie on this quantized model: with int8 activations in the prompt too, q4 answers
    # "L'Étoile, la Marseillaise, ...", as llama.cpp's server does on the same file.)
    colors, four, author = (o.text for o in outs_q4[1:])
    assert all(c in colors for c in ("Red", "Blue", "Yellow")), colors
    assert "4" in four and "Shakespeare" in author, (four, author)
    if cpu.blocks_fast():
        assert layer_q4.gate_up.weight is None and layer_q4.gate_up.dense is None  # the blocks are the only copy
        batch = q4.generate(prompts[1:2] * 9, params)
        assert all(o.token_ids == outs_q4[1].token_ids for o in batch)


@pytest.mark.parametrize("window", [None, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_attention_matches_the_three_step_path(dtype: torch.dtype, window: int | None) -> None:
    """rotary + K/V write + paged attention in one call == apply_rotary, write_kv, paged_attention_decode,
    with and without a sliding window."""
    from baton.kernels.paged_attention import write_kv
    from baton.model.rope import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, bs, nblocks = 6, 2, 16, 4, 40
    rope = RotaryEmbedding(hd, 128, 10000.0, None, dtype, torch.device("cpu"))
    lens = torch.tensor([5, 17, 9])
    tables = torch.randperm(nblocks, generator=g)[:18].view(3, 6)
    positions = lens - 1
    slots = torch.stack([tables[b, p // bs] * bs + p % bs for b, p in enumerate(positions.tolist())])
    k_cache = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)
    qkv = torch.randn(3, (nh + 2 * nkv) * hd, generator=g).to(dtype)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    heads = qkv.clone().view(3, nh + 2 * nkv, hd)
    cos, sin = rope.tables(positions)
    qk = apply_rotary(heads[:, : nh + nkv], cos, sin)
    write_kv(k_ref, v_ref, qk[:, nh:], heads[:, nh + nkv:], slots)
    ref = paged_attention_decode(qk[:, :nh].float(), k_ref.float(), v_ref.float(), tables, lens, 0.25,
                                 window=window)

    out = cpu.decode_attention(qkv, nh, nkv, rope.cos, rope.sin, positions, k_cache, v_cache, slots, tables, lens,
                               0.25, window)
    assert out.shape == (3, nh * hd) and out.dtype == dtype
    if dtype == torch.float32:  # torch may fuse the rotation's multiply-add: last-bit differences
        assert torch.equal(v_cache, v_ref) and torch.allclose(k_cache, k_ref, rtol=1e-6, atol=1e-6)
        assert rel(out.view(3, nh, hd), ref) < 1e-5
    else:  # two bfloat16 roundings may land one step apart
        assert torch.equal(v_cache, v_ref)
        assert (k_cache.float() - k_ref.float()).abs().max() <= 2**-7 * k_ref.float().abs().max()
        assert rel(out.view(3, nh, hd).float(), ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    gu = (torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    ref = F.silu(gu[:, :32]) * gu[:, 32:]
    out = cpu.silu_mul(gu)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,weights", [("bfloat16", "auto"), ("float32", "q4"), ("bfloat16", "q4")])
def test_engine_paths_agree_with_the_torch_backend(tiny_llama_dir: Path, dtype: str, weights: str) -> None:
    """The C paths (fused decode attention, add + RMSNorm, SiLU-mul) beside the all-torch reference
    backend (both with the same matmuls), in a chunked run where some passes sample no row: the same greedy
    tokens for every prompt (as on the AVX512-BF16/VNNI machine this was written on, in every case), or, where
    summing in another order flips a token, a first difference the float32 reference scores as a near tie
    (oracle.NEAR_TIE_LOGIT_GAP). The tiny random model's top two logits are 0.001-0.2 apart: scaling the C
    RMSNorm or prefill attention output by 1.2-1.5 changes tokens the reference does not call a tie."""
    from baton.api import SamplingParams
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.loader import load_model
    from tests.oracle import assert_same_or_near_tie, hf_from_loaded

    loaded = load_model(tiny_llama_dir)
    prompts = [[(7 * i + j) % 200 + 5 for j in range(3 + 5 * i)] for i in range(4)]
    runs = {}
    for backend in ("cpu", "torch"):
        engine = LLMEngine(EngineConfig(dtype=dtype, weights=weights, attention=backend, kv_cache_memory=8 << 20,
                                        max_num_batched_tokens=8, block_size=4), loaded=loaded)
        assert type(engine.model.backend).__name__ == ("CpuAttention" if backend == "cpu" else "TorchAttention")
        runs[backend] = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                                      ignore_eos=True))]
    assert all(len(t) == 12 for t in runs["cpu"])
    if runs["cpu"] != runs["torch"]:
        hf = hf_from_loaded(loaded)
        for i, prompt in enumerate(prompts):
            assert_same_or_near_tie(runs["cpu"][i], runs["torch"][i], prompt, hf, f"{dtype}/{weights} prompt {i}")


@pytest.mark.parametrize("dtype,weights", [("bfloat16", "auto"), ("float32", "q4"), ("bfloat16", "q4")])
def test_whole_layer_decode_call_equals_the_per_layer_calls(tiny_llama_dir: Path, dtype: str, weights: str) -> None:
    """Decode-only passes run every layer in one C call: the same kernels in the same order, so the
    same tokens and log-probs, bit for bit, as the Python loop over layers. 12 sequences: passes
    beyond 8 rows take the q4_1 kernel with VNNI, else its packed bfloat16 copy (bfloat16) or the
    Python loop (float32)."""
    from baton.api import SamplingParams
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.loader import load_model

    if dtype == "bfloat16" and weights == "auto" and not cpu.has_bf16_gemm():
        pytest.skip("bfloat16 layers use oneDNN without AVX512-BF16: no whole-layer call to compare")
    loaded = load_model(tiny_llama_dir)
    prompts = [[(5 * i + j) % 300 + 3 for j in range(4 + 5 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=11, logprobs=True, ignore_eos=True)
    results = []
    for whole in (True, False):
        engine = LLMEngine(EngineConfig(dtype=dtype, weights=weights, kv_cache_memory=8 << 20, block_size=4,
                                        prefill_order="arrival"),
                           loaded=loaded)
        assert engine.model._layer_specs is not None
        if (dtype == "bfloat16" and cpu.has_bf16_gemm()) or (weights == "q4" and cpu.blocks_fast()):
            assert engine.model._plan_rows == float("inf")  # every pass size
        if not whole:
            engine.model._layer_specs = None
        results.append([(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)])
    assert results[0] == results[1]


@pytest.mark.parametrize("threads", [1, 2])
def test_read_bytes_sums_every_byte_once(threads: int) -> None:
    """Buffers with tails past the last 64-byte line, an empty one, several dtypes: the probe's sum is
    the bytes' sum, so it read each byte exactly once."""
    g = torch.Generator().manual_seed(threads)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 1, 63, 64, 65, 4097, 100_003)]
    tensors += [torch.randn(37, 41, generator=g).bfloat16(), torch.randn(1000, generator=g)]
    want = sum(int(t.view(torch.uint8).to(torch.int64).sum()) for t in tensors)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu.read_bytes(tensors) == want
        assert cpu.read_bytes([]) == 0
    finally:
        torch.set_num_threads(old)
    with pytest.raises(ValueError, match="contiguous CPU"):
        cpu.read_bytes([torch.zeros(4, 4).t()])
