"""Triton paged-KV kernels against the torch references (kernels/paged_attention.py).

Without CUDA the tests run under Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 is set here,
before triton is imported (it then holds for the whole pytest process, harmless where there is no GPU).
With CUDA and no TRITON_INTERPRET in the environment the same tests run the compiled kernels on the GPU.

How results are compared:
- decode attention: relative norm ||out - ref|| / ||ref|| against ``paged_attention_decode`` on the
  same (possibly int8) cache, with a bound per query dtype (DECODE_TOL); int8 caches are also compared
  with float32 attention over the *unquantized* keys/values (INT8_VS_FLOAT_TOL, quantization error).
- KV write: the whole caches (and scales) after ``write_kv_triton`` must be bitwise equal to the ones
  after ``write_kv``, int8 included: the kernel divides with IEEE rounding and rounds half to even
  exactly like torch.round, so no off-by-one values are tolerated here.
- a subprocess without the interpreter: CPU tensors are refused with advice, and the kernels compile
  for sm_90 ahead of time (Triton's code generator and ptxas, which the interpreter never runs) with
  no register spills under the wrappers' launch configurations.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import baton.kernels.triton_attention as ta  # noqa: E402
from baton.kernels.paged_attention import (  # noqa: E402
    Chunks,
    paged_attention_decode,
    paged_attention_prefill,
    quantize_int8,
    write_kv,
)

if os.environ.get("TRITON_INTERPRET") == "1" and not ta.INTERPRETED:
    # Imported earlier in this process without the interpreter: decorate the kernels again.
    ta = importlib.reload(ta)
DEVICE = "cpu" if ta.INTERPRETED else "cuda"
ROOT = Path(__file__).resolve().parents[1]

# Bound on ||triton - reference|| / ||reference|| per query dtype (same cache for both).
DECODE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# int8 cache (float32 queries) against float32 attention over the values before quantization.
INT8_VS_FLOAT_TOL = 2e-2
# (query dtype, cache dtype) pairs under test.
DTYPE_PAIRS = [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.int8), (torch.float16, torch.int8), (torch.bfloat16, torch.int8),
]
PROPERTY = settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a64, b64 = a.double(), b.double()
    return ((a64 - b64).norm() / b64.norm()).item()


# ---- decode attention -------------------------------------------------------------------------------


class Case:
    """A random paged cache and a decode batch over it."""

    def __init__(self, *, seed: int, lens: list[int], group: int, num_kv_heads: int, head_dim: int,
                 block_size: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, spare_blocks: int = 3,
                 extra_columns: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        batch = len(lens)
        blocks_per_seq = [math.ceil(n / block_size) for n in lens]
        max_blocks = max(blocks_per_seq) + extra_columns
        num_blocks = sum(blocks_per_seq) + spare_blocks
        # Distinct blocks per sequence in random order; table entries past a sequence's blocks point
        # anywhere valid (other sequences' blocks included), so the kernel must not read them.
        perm = torch.randperm(num_blocks, generator=gen)
        tables = torch.randint(0, num_blocks, (batch, max_blocks), generator=gen)
        used = 0
        for b, nb in enumerate(blocks_per_seq):
            tables[b, :nb] = perm[used:used + nb]
            used += nb
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # The float keys/values (every slot filled, so garbage outside a context would show).
        self.k_float = torch.randn(shape, generator=gen)
        self.v_float = torch.randn(shape, generator=gen)
        self.k_scale = self.v_scale = None
        if cache_dtype == torch.int8:
            self.k_cache, self.k_scale = quantize_int8(self.k_float)
            self.v_cache, self.v_scale = quantize_int8(self.v_float)
        else:
            self.k_cache, self.v_cache = self.k_float.to(cache_dtype), self.v_float.to(cache_dtype)
        # q: [batch, num_heads, head_dim]
        self.q_float = torch.randn(batch, group * num_kv_heads, head_dim, generator=gen)
        self.q = self.q_float.to(q_dtype)
        self.block_tables = tables
        self.seq_lens = torch.tensor(lens, dtype=torch.int64)
        self.scale = head_dim ** -0.5

    def to(self, device: str) -> Case:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def triton(self, window: int | None = None) -> torch.Tensor:
        return ta.paged_attention_decode_triton(self.q, self.k_cache, self.v_cache, self.block_tables,
                                                self.seq_lens, self.scale, k_scale=self.k_scale,
                                                v_scale=self.v_scale, window=window)

    def reference(self, window: int | None = None) -> torch.Tensor:
        return paged_attention_decode(self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                                      self.scale, k_scale=self.k_scale, v_scale=self.v_scale, window=window)

    def float_reference(self) -> torch.Tensor:
        """float32 attention over the keys/values before quantization (float32 queries)."""
        return paged_attention_decode(self.q_float, self.k_float, self.v_float, self.block_tables,
                                      self.seq_lens, self.scale)


@st.composite
def seq_len_lists(draw: st.DrawFn, block_size: int) -> list[int]:
    """1-3 sequence lengths mixing the edge cases: 1, a block, a block plus one, short, long."""
    one = st.sampled_from([1, block_size, block_size + 1]) | st.integers(2, 3 * block_size) \
        | st.integers(200, 400)
    return draw(st.lists(one, min_size=1, max_size=3))


@st.composite
def decode_cases(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([16, 32]))
    q_dtype, cache_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)), lens=draw(seq_len_lists(block_size)),
        group=draw(st.sampled_from([1, 3, 8])), num_kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([64, 128])), block_size=block_size, q_dtype=q_dtype,
        cache_dtype=cache_dtype, extra_columns=draw(st.integers(0, 2)),
    )


@PROPERTY
@given(decode_cases())
def test_decode_matches_reference(params: dict) -> None:
    case = Case(**params).to(DEVICE)
    out = case.triton()
    ref = case.reference()
    assert out.shape == ref.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out.float()).all()
    err = rel_err(out, ref)
    assert err <= DECODE_TOL[params["q_dtype"]], f"relative error {err:.2e} for {params}"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_cases())
def test_int8_decode_is_close_to_unquantized_attention(params: dict) -> None:
    params = {**params, "q_dtype": torch.float32, "cache_dtype": torch.int8}
    case = Case(**params).to(DEVICE)
    err = rel_err(case.triton(), case.float_reference())
    assert err <= INT8_VS_FLOAT_TOL, f"int8 vs float32 relative error {err:.2e} for {params}"


@pytest.mark.parametrize("q_dtype,cache_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_decode_fixed_shapes_every_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    # GQA 8 with 2 KV heads, head_dim 128, block 16: lengths 1, a block, a block + 1, long.
    case = Case(seed=7, lens=[1, 16, 17, 300], group=8, num_kv_heads=2, head_dim=128, block_size=16,
                q_dtype=q_dtype, cache_dtype=cache_dtype).to(DEVICE)
    err = rel_err(case.triton(), case.reference())
    assert err <= DECODE_TOL[q_dtype], f"relative error {err:.2e}"


WINDOW_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.int8)]


@pytest.mark.parametrize("q_dtype,cache_dtype", WINDOW_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("window", [1, 16, 17, 100])
def test_decode_with_a_sliding_window_matches_reference(window: int, q_dtype: torch.dtype,
                                                        cache_dtype: torch.dtype) -> None:
    """Each sequence sees its last ``window`` keys: windows on a block's edge, past it, shorter and longer
    than the contexts (1, a block, a block + 1, long); the result differs from full attention."""
    case = Case(seed=window, lens=[1, 16, 17, 300], group=3, num_kv_heads=2, head_dim=64, block_size=16,
                q_dtype=q_dtype, cache_dtype=cache_dtype).to(DEVICE)
    out, ref = case.triton(window), case.reference(window)
    assert rel_err(out, ref) <= DECODE_TOL[q_dtype]
    assert rel_err(out[3], case.reference()[3]) > 0.05  # the long sequence: the window changed its answer


def test_decode_one_token_context_returns_its_value() -> None:
    # With a single key the softmax weight is 1: the output is that token's value for every query head.
    case = Case(seed=3, lens=[1, 1], group=3, num_kv_heads=2, head_dim=64, block_size=16,
                q_dtype=torch.float32, cache_dtype=torch.float32).to(DEVICE)
    out = case.triton()
    for b in range(2):
        block = case.block_tables[b, 0]
        # value: [num_kv_heads, head_dim] -> each KV head's row repeated for its 3 query heads
        value = case.v_cache[block, 0].repeat_interleave(3, dim=0)
        torch.testing.assert_close(out[b], value, rtol=1e-6, atol=1e-6)


def test_decode_ignores_positions_past_the_block_table() -> None:
    # seq_lens larger than max_blocks * block_size: the reference attends to the whole table, so must we.
    case = Case(seed=5, lens=[40, 20], group=1, num_kv_heads=1, head_dim=64, block_size=16,
                q_dtype=torch.float32, cache_dtype=torch.float32, extra_columns=0).to(DEVICE)
    case.seq_lens = torch.tensor([1000, 20], device=DEVICE)
    err = rel_err(case.triton(), case.reference())
    assert err <= DECODE_TOL[torch.float32]


def test_decode_tile_sizes_agree() -> None:
    case = Case(seed=11, lens=[70, 129], group=3, num_kv_heads=1, head_dim=64, block_size=32,
                q_dtype=torch.float32, cache_dtype=torch.int8).to(DEVICE)
    ref = case.reference()
    for tile_n in (16, 32, 128):
        out = ta.paged_attention_decode_triton(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.seq_lens, case.scale, k_scale=case.k_scale,
                                               v_scale=case.v_scale, tile_n=tile_n)
        assert rel_err(out, ref) <= DECODE_TOL[torch.float32], f"tile_n={tile_n}"


def test_decode_non_contiguous_query() -> None:
    # q as a slice of a fused qkv projection output: [batch, heads, head_dim] with a batch stride > heads * dim.
    case = Case(seed=2, lens=[33, 5], group=3, num_kv_heads=2, head_dim=64, block_size=16,
                q_dtype=torch.float16, cache_dtype=torch.float16).to(DEVICE)
    qkv = torch.randn(2, 10, 64, dtype=torch.float16, device=DEVICE)
    qkv[:, :6] = case.q
    case.q = qkv[:, :6]
    assert not case.q.is_contiguous()
    err = rel_err(case.triton(), case.reference())
    assert err <= DECODE_TOL[torch.float16]


def test_decode_empty_batch() -> None:
    case = Case(seed=1, lens=[5], group=1, num_kv_heads=1, head_dim=64, block_size=16,
                q_dtype=torch.float32, cache_dtype=torch.float32).to(DEVICE)
    out = ta.paged_attention_decode_triton(case.q[:0], case.k_cache, case.v_cache, case.block_tables[:0],
                                           case.seq_lens[:0], case.scale)
    assert out.shape == (0, 1, 64)


# ---- KV write ---------------------------------------------------------------------------------------


def _caches(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Randomly prefilled k_cache, v_cache, k_scale, v_scale (scales None for float caches)."""
    if dtype == torch.int8:
        kc = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
        vc = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
        return [kc, vc, torch.rand(shape[:3], generator=gen), torch.rand(shape[:3], generator=gen)]
    return [torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype), None, None]


def _assert_writes_equal(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, caches: list) -> None:
    ours = [None if c is None else c.clone().to(DEVICE) for c in caches]
    ref = [None if c is None else c.clone() for c in caches]
    write_kv(ref[0], ref[1], k, v, slots, ref[2], ref[3])
    ta.write_kv_triton(ours[0], ours[1], k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), ours[2], ours[3])
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), ours, ref):
        if b is not None:
            a = a.cpu()
            diff = (a.double() - b.double()).abs()
            assert torch.equal(a, b), f"{name}: {int((diff > 0).sum())} elements differ, max {diff.max().item()}"


@st.composite
def write_cases(draw: st.DrawFn) -> dict:
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)), num_tokens=draw(st.integers(1, 40)),
        num_kv_heads=draw(st.integers(1, 3)), head_dim=draw(st.sampled_from([64, 128])),
        block_size=draw(st.sampled_from([16, 32])),
        cache_dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8])),
        input_dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        fused=draw(st.booleans()),
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(write_cases())
def test_write_kv_matches_reference(p: dict) -> None:
    gen = torch.Generator().manual_seed(p["seed"])
    num_blocks = math.ceil(p["num_tokens"] / p["block_size"]) + 2
    shape = (num_blocks, p["block_size"], p["num_kv_heads"], p["head_dim"])
    caches = _caches(gen, shape, p["cache_dtype"])
    h, d, t = p["num_kv_heads"], p["head_dim"], p["num_tokens"]
    if p["fused"]:
        # k, v as views into one fused projection output (non-contiguous, like a qkv split).
        kv = torch.randn(t, 2 * h + 1, d, generator=gen).to(p["input_dtype"]) * 4
        k, v = kv[:, :h], kv[:, h + 1:]
    else:
        k = (torch.randn(t, h, d, generator=gen) * 4).to(p["input_dtype"])
        v = torch.randn(t, h, d, generator=gen).to(p["input_dtype"])
    slots = torch.randperm(num_blocks * p["block_size"], generator=gen)[:t]
    _assert_writes_equal(k, v, slots, caches)


def test_write_kv_int8_rounding_ties_and_zero_rows() -> None:
    # amax 127 makes the scale exactly 1, so these values are exact ties: round half to even, like torch.round.
    d = 64
    k = torch.zeros(2, 1, d)
    ties = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, 1.5, -2.5, 126.5, -126.5])
    k[0, 0, :len(ties)] = ties
    v = torch.zeros(2, 1, d)  # row 1 of k and both rows of v are all zeros: scale 1e-8 / 127, values 0
    caches = _caches(torch.Generator().manual_seed(0), (2, 16, 1, d), torch.int8)
    slots = torch.tensor([3, 20])
    _assert_writes_equal(k, v, slots, caches)
    ours = [c.clone().to(DEVICE) for c in caches]
    ta.write_kv_triton(ours[0], ours[1], k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), ours[2], ours[3])
    assert ours[0].cpu()[0, 3, 0, :len(ties)].tolist() == [127, 2, 4, 0, -2, 0, 2, -2, 126, -126]
    assert ours[2].cpu()[0, 3, 0].item() == 1.0


def test_write_kv_empty_is_a_no_op() -> None:
    caches = _caches(torch.Generator().manual_seed(0), (2, 16, 2, 64), torch.float16)
    before = [c.clone() for c in caches[:2]]
    empty = torch.zeros(0, 2, 64)
    ta.write_kv_triton(caches[0], caches[1], empty, empty, torch.zeros(0, dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(caches[:2], before))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8], ids=["fp16", "int8"])
def test_write_then_decode_matches_reference_pipeline(cache_dtype: torch.dtype) -> None:
    # Prefill-style write of 3 sequences through the kernels, then one decode step; same through torch.
    gen = torch.Generator().manual_seed(4)
    lens, block_size, h, d = [5, 33, 16], 16, 2, 64
    tables = torch.tensor([[4, 0, 0], [1, 7, 2], [6, 0, 0]])
    slots = torch.cat([tables[b, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
                       for b, n in enumerate(lens)])
    k = torch.randn(len(slots), h, d, generator=gen)
    v = torch.randn(len(slots), h, d, generator=gen)
    q = torch.randn(3, 2 * h, d, generator=gen).to(torch.float16)
    shape = (8, block_size, h, d)
    ref = _caches(gen, shape, cache_dtype)
    ours = [None if c is None else c.clone().to(DEVICE) for c in ref]
    write_kv(ref[0], ref[1], k, v, slots, ref[2], ref[3])
    ta.write_kv_triton(ours[0], ours[1], k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), ours[2], ours[3])
    seq_lens = torch.tensor(lens)
    want = paged_attention_decode(q, ref[0], ref[1], tables, seq_lens, d ** -0.5, k_scale=ref[2], v_scale=ref[3])
    got = ta.paged_attention_decode_triton(q.to(DEVICE), ours[0], ours[1], tables.to(DEVICE),
                                           seq_lens.to(DEVICE), d ** -0.5, k_scale=ours[2], v_scale=ours[3])
    assert rel_err(got.cpu(), want) <= DECODE_TOL[torch.float16]


# ---- wrapper checks ---------------------------------------------------------------------------------


def _decode_args(**over) -> dict:
    case = Case(seed=0, lens=[3, 20], group=2, num_kv_heads=2, head_dim=64, block_size=16,
                q_dtype=torch.float32, cache_dtype=torch.float32).to(DEVICE)
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_tables=case.block_tables,
                seq_lens=case.seq_lens, scale=case.scale, k_scale=None, v_scale=None)
    args.update(over)
    return args


def _int8_cache(shape=(4, 16, 2, 64)) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(torch.randn(shape, device=DEVICE))


BAD_DECODE = {
    "q 2-D": lambda a: dict(q=a["q"][0]),
    "q int": lambda a: dict(q=a["q"].to(torch.int32)),
    "heads not a multiple": lambda a: dict(q=a["q"][:, :3]),
    "head_dim mismatch": lambda a: dict(q=a["q"][..., :32]),
    "head_dim not a power of two": lambda a: dict(q=a["q"][..., :48], k_cache=a["k_cache"][..., :48].contiguous(),
                                                  v_cache=a["v_cache"][..., :48].contiguous()),
    "v_cache shape": lambda a: dict(v_cache=a["v_cache"][:-1]),
    "cache dtypes differ": lambda a: dict(v_cache=a["v_cache"].half()),
    "cache float64": lambda a: dict(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()),
    "cache not contiguous": lambda a: dict(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
    "block_tables int32": lambda a: dict(block_tables=a["block_tables"].int()),
    "block_tables 1-D": lambda a: dict(block_tables=a["block_tables"][0]),
    "block_tables batch": lambda a: dict(block_tables=a["block_tables"][:1]),
    "seq_lens shape": lambda a: dict(seq_lens=a["seq_lens"][:1]),
    "seq_lens int32": lambda a: dict(seq_lens=a["seq_lens"].int()),
    "scales for a float cache": lambda a: dict(k_scale=torch.ones(a["k_cache"].shape[:3], device=DEVICE),
                                               v_scale=torch.ones(a["k_cache"].shape[:3], device=DEVICE)),
    "int8 without scales": lambda a: dict(k_cache=_int8_cache()[0], v_cache=_int8_cache()[0]),
    "int8 scale shape": lambda a: dict(k_cache=_int8_cache()[0], v_cache=_int8_cache()[0],
                                       k_scale=torch.ones(4, 16, device=DEVICE),
                                       v_scale=torch.ones(4, 16, 2, device=DEVICE)),
    "int8 scale dtype": lambda a: dict(k_cache=_int8_cache()[0], v_cache=_int8_cache()[0],
                                       k_scale=torch.ones(4, 16, 2, device=DEVICE, dtype=torch.float16),
                                       v_scale=torch.ones(4, 16, 2, device=DEVICE)),
    "scale negative": lambda a: dict(scale=-1.0),
    "tensors on two devices": lambda a: dict(seq_lens=a["seq_lens"].to("meta")),
}


@pytest.mark.parametrize("bad", list(BAD_DECODE))
def test_decode_wrapper_rejects(bad: str) -> None:
    args = _decode_args()
    args.update(BAD_DECODE[bad](args))
    with pytest.raises(ValueError):
        ta.paged_attention_decode_triton(**args)


def test_decode_wrapper_rejects_bad_tile() -> None:
    with pytest.raises(ValueError, match="tile_n"):
        ta.paged_attention_decode_triton(**_decode_args(), tile_n=24)


def _write_args(**over) -> dict:
    shape = (4, 16, 2, 64)
    args = dict(k_cache=torch.zeros(shape, device=DEVICE), v_cache=torch.zeros(shape, device=DEVICE),
                k=torch.randn(3, 2, 64, device=DEVICE), v=torch.randn(3, 2, 64, device=DEVICE),
                slot_mapping=torch.tensor([0, 5, 17], device=DEVICE), k_scale=None, v_scale=None)
    args.update(over)
    return args


BAD_WRITE = {
    "k heads": lambda a: dict(k=a["k"][:, :1]),
    "v shape differs": lambda a: dict(v=a["v"][:2]),
    "k int": lambda a: dict(k=a["k"].to(torch.int8)),
    "slot_mapping int32": lambda a: dict(slot_mapping=a["slot_mapping"].int()),
    "slot_mapping length": lambda a: dict(slot_mapping=a["slot_mapping"][:2]),
    "int8 without scales": lambda a: dict(k_cache=a["k_cache"].to(torch.int8), v_cache=a["v_cache"].to(torch.int8)),
    "scales for a float cache": lambda a: dict(k_scale=torch.ones(4, 16, 2, device=DEVICE),
                                               v_scale=torch.ones(4, 16, 2, device=DEVICE)),
    "cache 3-D": lambda a: dict(k_cache=a["k_cache"][0], v_cache=a["v_cache"][0]),
    "tensors on two devices": lambda a: dict(slot_mapping=a["slot_mapping"].to("meta")),
}


@pytest.mark.parametrize("bad", list(BAD_WRITE))
def test_write_wrapper_rejects(bad: str) -> None:
    args = _write_args()
    args.update(BAD_WRITE[bad](args))
    with pytest.raises(ValueError):
        ta.write_kv_triton(**args)


# ---- prefill attention ------------------------------------------------------------------------------


def prefill_case(seed: int, chunks: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int,
                 head_dim: int, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> dict:
    """Chunks (cached tokens, chunk length) of distinct sequences over one shuffled paged cache (a decode
    Case's, whose sequences are the chunks' whole contexts), rows of q laid out one chunk after another
    after a row of no chunk."""
    ctxs = [a + b for a, b in chunks]
    c = Case(seed=seed, lens=ctxs, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
             block_size=block_size, q_dtype=q_dtype, cache_dtype=cache_dtype)
    lens = [b for _, b in chunks]
    starts = [1 + sum(lens[:i]) for i in range(len(lens))]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(1 + sum(lens), group * num_kv_heads, head_dim, generator=gen).to(q_dtype)
    chunk_set = Chunks(torch.tensor(starts), torch.tensor(lens), torch.tensor(ctxs), c.block_tables)
    return dict(q=q, k=c.k_cache, v=c.v_cache, k_scale=c.k_scale, v_scale=c.v_scale, chunks=chunk_set,
                scale=c.scale)


def run_prefill(c: dict, device: str, window: int | None = None) -> torch.Tensor:
    t = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in c.items()}
    ch = c["chunks"].to(device)
    out = torch.full_like(t["q"], 5.0)
    ta.paged_attention_prefill_triton(t["q"], t["k"], t["v"], ch.starts, ch.lens, ch.ctxs, ch.tables,
                                      int(c["chunks"].lens.max()), c["scale"], out, t["k_scale"], t["v_scale"],
                                      window)
    return out.cpu()


PREFILL_SHAPES = [  # (chunks, block_size, num_kv_heads, group, head_dim)
    ([(0, 1), (0, 40)], 16, 2, 1, 64),                    # a one-token prompt; a fresh one within a tile
    ([(63, 66), (130, 9)], 16, 1, 3, 64),                 # cached prefixes; query and key tile edges
    ([(5, 33)], 32, 2, 4, 128),                           # the wider head, 32-key tiles for 16-bit queries
]


@pytest.mark.parametrize("q_dtype,cache_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", range(len(PREFILL_SHAPES)))
def test_prefill_matches_reference(shape: int, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Every chunk's rows equal paged_attention_prefill (gather + SDPA per chunk, on the same cache) within
    the decode bounds; the row of no chunk is untouched."""
    check_prefill(shape, q_dtype, cache_dtype, None)


@pytest.mark.parametrize("q_dtype,cache_dtype", WINDOW_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("window", [1, 20, 64])
@pytest.mark.parametrize("shape", range(len(PREFILL_SHAPES)))
def test_prefill_with_a_sliding_window_matches_reference(shape: int, window: int, q_dtype: torch.dtype,
                                                         cache_dtype: torch.dtype) -> None:
    """The same with a sliding window: windows of one key, inside a key tile and a whole tile, over chunks
    that start inside and past the window."""
    check_prefill(shape, q_dtype, cache_dtype, window)


def check_prefill(shape: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, window: int | None) -> None:
    chunks, block_size, kv_heads, group, head_dim = PREFILL_SHAPES[shape]
    c = prefill_case(shape, chunks, block_size, kv_heads, group, head_dim, q_dtype, cache_dtype)
    out = run_prefill(c, DEVICE, window)
    ref = torch.full_like(c["q"], 5.0)
    q32 = c["q"].float()  # the reference in float32 over the same (dequantized, rounded) values
    k, v = c["k"], c["v"]
    if cache_dtype != torch.int8:
        k, v = k.float(), v.float()
    elif q_dtype != torch.float32:  # the kernel rounds dequantized values to the query dtype, as gather_kv does
        k, v = (k.float() * c["k_scale"][..., None]).to(q_dtype).float(), \
            (v.float() * c["v_scale"][..., None]).to(q_dtype).float()
    paged_attention_prefill(q32, k, v, c["chunks"], c["scale"], ref,
                            c["k_scale"] if cache_dtype == torch.int8 and q_dtype == torch.float32 else None,
                            c["v_scale"] if cache_dtype == torch.int8 and q_dtype == torch.float32 else None, window)
    assert (out[0] == 5).all()
    assert rel_err(out[1:].float(), ref[1:]) < DECODE_TOL[q_dtype]


def test_prefill_of_one_token_is_decode() -> None:
    """A one-token chunk after a cached prefix is a decode query: the prefill and decode kernels agree."""
    c = prefill_case(9, [(37, 1)], 16, 2, 3, 64, torch.float32, torch.float32)
    out = run_prefill(c, DEVICE)
    ch = c["chunks"]
    dec = ta.paged_attention_decode_triton(c["q"][1:].to(DEVICE), c["k"].to(DEVICE), c["v"].to(DEVICE),
                                           ch.tables.to(DEVICE), ch.ctxs.to(DEVICE), c["scale"]).cpu()
    assert rel_err(out[1:], dec) < 1e-6


def test_prefill_wrapper_rejects_what_it_cannot_run() -> None:
    c = prefill_case(1, [(0, 4)], 16, 1, 1, 64, torch.float32, torch.float32)
    ch = c["chunks"]
    with pytest.raises(ValueError, match="out must have q's shape"):
        ta.paged_attention_prefill_triton(c["q"], c["k"], c["v"], ch.starts, ch.lens, ch.ctxs, ch.tables, 4, 0.1,
                                          c["q"][:1])
    with pytest.raises(ValueError, match="lens must be"):
        ta.paged_attention_prefill_triton(c["q"], c["k"], c["v"], ch.starts, ch.lens.int(), ch.ctxs, ch.tables, 4,
                                          0.1, torch.empty_like(c["q"]))
    with pytest.raises(ValueError, match="max_len"):
        ta.paged_attention_prefill_triton(c["q"], c["k"], c["v"], ch.starts, ch.lens, ch.ctxs, ch.tables, 0, 0.1,
                                          torch.empty_like(c["q"]))


# ---- batched LoRA (kernels/triton_lora.py) against the row-by-row reference


def _lora_case(n: int, in_dim: int, out: int, slots: int, width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_dim, generator=g).to(dtype)
    a = torch.randn(slots * width, in_dim, generator=g).to(dtype)
    b = (torch.randn(slots * width, out, generator=g) * 0.1).to(dtype)
    rows = torch.randint(-1, slots, (n,), generator=g)
    y = torch.randn(n, out, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (x, a, b, rows, y)]


@pytest.mark.parametrize("n,in_dim,out,slots,width", [(1, 64, 96, 1, 16), (9, 100, 70, 3, 48), (33, 576, 960, 4, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_matches_reference(n, in_dim, out, slots, width, dtype) -> None:
    from baton.kernels.triton_lora import lora_delta_triton
    from baton.model.lora import lora_delta_reference

    x, a, b, rows, y = _lora_case(n, in_dim, out, slots, width, dtype)
    want = y.float() + lora_delta_reference(x, a, b, rows, width)
    got = lora_delta_triton(x, a, b, rows, width, y.clone())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((got.float() - want).norm() / want.norm()) < tol
    base = rows < 0
    assert torch.equal(got[base], y[base])  # base rows untouched


def test_lora_wrapper_rejects_what_it_cannot_run() -> None:
    from baton.kernels.triton_lora import lora_delta_triton

    x, a, b, rows, y = _lora_case(4, 32, 16, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="shapes disagree"):
        lora_delta_triton(x, a, b, rows, 8, y[:, :8])
    with pytest.raises(ValueError, match="must divide"):
        lora_delta_triton(x, a, b, rows, 5, y)
    with pytest.raises(ValueError, match="rows must be int64"):
        lora_delta_triton(x, a, b, rows.int(), 8, y)


# Run in a fresh interpreter without TRITON_INTERPRET: the wrappers must refuse CPU tensors, and the
# kernels must compile for a real GPU (sm_90, ahead of time: Triton's code generator and ptxas, no GPU
# needed), which the interpreter never exercises. Runtime specialization is mimicked: 16-byte aligned
# pointers, strides that are multiples of 16, unit strides as constants.
_NO_INTERPRETER_CHECKS = r"""
import json, os, re, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import baton.kernels.triton_attention as ta

assert not ta.INTERPRETED
q = torch.zeros(1, 1, 64); c = torch.zeros(1, 16, 1, 64)
try:
    ta.paged_attention_decode_triton(q, c, c, torch.zeros(1, 1, dtype=torch.int64),
                                     torch.ones(1, dtype=torch.int64), 0.125)
    refusal = None
except ValueError as e:
    refusal = str(e)

T = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8"}
UNIT = {"stride_qd", "stride_cd", "stride_od", "stride_sh", "stride_tn", "stride_kd", "stride_vd"}
DIV16 = {"stride_qb", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_ob", "stride_oh",
         "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_qt", "stride_ot"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def build(fn, pointers, consts, num_warps):
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(pointers)
    sig["qk_scale"] = "fp32" if "qk_scale" in sig else None
    sig = {n: t for n, t in sig.items() if t is not None}
    consts = dict(consts, **{n: 1 for n in UNIT & set(fn.arg_names)})
    sig.update({n: "constexpr" for n in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n in DIV16)}
    k = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return dict(stack=int(re.search(r"STACK:(\d+)", usage).group(1)), mma="mma" in k.asm["ptx"])

results = {}
for q_dtype, cache_dtype, group, head_dim in [(torch.bfloat16, torch.int8, 8, 128),
                                              (torch.float16, torch.float16, 3, 128),
                                              (torch.float32, torch.float32, 1, 64)]:
    tile, warps = ta._decode_launch_config(q_dtype, cache_dtype)
    cache, scale = T[cache_dtype], "fp32" if cache_dtype == torch.int8 else T[cache_dtype]
    pointers = dict(q_ptr="*" + T[q_dtype], out_ptr="*" + T[q_dtype], k_cache_ptr="*" + cache,
                    v_cache_ptr="*" + cache, k_scale_ptr="*" + scale, v_scale_ptr="*" + scale,
                    block_tables_ptr="*i64", seq_lens_ptr="*i64", qk_scale="fp32")
    consts = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                  BLOCK_SIZE=16, TILE_N=tile, IS_INT8=cache_dtype == torch.int8, WIDEN_BF16=False,
                  DOT_PRECISION="ieee" if q_dtype == torch.float32 else "tf32")
    results[f"decode {q_dtype} {cache_dtype} g{group} d{head_dim}"] = build(ta._paged_decode_kernel, pointers,
                                                                            consts, warps)
for q_dtype, cache_dtype, head_dim in [(torch.bfloat16, torch.bfloat16, 64), (torch.bfloat16, torch.int8, 128),
                                       (torch.float32, torch.float32, 64)]:
    tile_m, tile_n, warps = ta._prefill_launch_config(q_dtype, head_dim)
    cache, scale = T[cache_dtype], "fp32" if cache_dtype == torch.int8 else T[cache_dtype]
    pointers = dict(q_ptr="*" + T[q_dtype], out_ptr="*" + T[q_dtype], k_cache_ptr="*" + cache,
                    v_cache_ptr="*" + cache, k_scale_ptr="*" + scale, v_scale_ptr="*" + scale, starts_ptr="*i64",
                    lens_ptr="*i64", ctxs_ptr="*i64", block_tables_ptr="*i64", qk_scale="fp32")
    consts = dict(GROUP=3, HEAD_DIM=head_dim, BLOCK_SIZE=16, TILE_M=tile_m, TILE_N=tile_n,
                  IS_INT8=cache_dtype == torch.int8, WIDEN_BF16=False,
                  DOT_PRECISION="ieee" if q_dtype == torch.float32 else "tf32")
    results[f"prefill {q_dtype} {cache_dtype} d{head_dim}"] = build(ta._paged_prefill_kernel, pointers, consts, warps)
pointers = dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*i8", v_cache_ptr="*i8", k_scale_ptr="*fp32",
                v_scale_ptr="*fp32", slot_ptr="*i64")
results["write bf16 -> int8"] = build(ta._write_kv_kernel, pointers,
                                      dict(HEADS_PAD=8, HEAD_DIM=128, BLOCK_SIZE=16, IS_INT8=True), 4)
import baton.kernels.triton_lora as tlo
pointers = dict(x_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", rows_ptr="*i64", y_ptr="*bf16")
results["lora bf16"] = build(tlo._lora_delta_kernel, pointers, dict(W_P=64, BLOCK_K=64, BLOCK_O=64), 4)
print(json.dumps(dict(refusal=refusal, compiled=results)))
"""


def test_without_interpreter_cpu_is_refused_and_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _NO_INTERPRETER_CHECKS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert "need CUDA tensors" in report["refusal"] and "TRITON_INTERPRET=1" in report["refusal"]
    for name, r in report["compiled"].items():
        # No register spills with the wrapper's launch configuration; 16-bit dots on the tensor cores.
        assert r["stack"] == 0, f"{name}: ptxas spills ({r['stack']} bytes of stack)"
        if name.startswith(("decode", "prefill")) and "float32 torch.float32" not in name:
            assert r["mma"], f"{name}: no tensor-core instructions"
