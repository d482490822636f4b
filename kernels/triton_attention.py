"""Triton kernels for the paged KV cache: decode attention, prefill attention and the KV write.

Same layout and semantics as the torch references in ``kernels/paged_attention.py`` (read that
module's docstring first): per layer ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads,
head_dim]`` in float32/float16/bfloat16/int8, and for int8 the float32 scales ``k_scale``/``v_scale``
``[num_blocks, block_size, num_kv_heads]`` (value = int8 * scale, scale = amax(|x|) / 127 over
head_dim, round half to even, clamp to [-127, 127]).

- ``paged_attention_decode_triton``: one program per (sequence, KV head). It loads that head's
  query group once (padded to 16 rows, the smallest tensor-core tile), walks the sequence's context
  in tiles of ``TILE_N`` token positions (a tile may span several blocks; each position finds its
  block through the block table) and keeps an online softmax in float32 (running max, running sum,
  rescaled accumulator), so nothing of size ``seq_len`` is materialised. Dot operands are in the
  query dtype with float32 accumulation. int8 keys enter the dot as exact integers and their scales
  multiply the logits; int8 values are dequantized (value * scale, rounded to the query dtype, as the
  reference does) before the second dot.
- ``paged_attention_prefill_triton``: one program per (prompt chunk, tile of ``TILE_M`` query tokens,
  query head): the tile's queries against the chunk's paged context in tiles of ``TILE_N`` keys, the
  same online softmax and dot operands as decode, the causal mask applied only on the key tiles that
  reach past the tile's first query. Reference: ``paged_attention_prefill``.
- Both take a sliding window (``window``): key tiles before every query's window are not read, and the
  tiles on a window's edge are masked as the diagonal is.
- ``write_kv_triton``: one program per new token, all of its KV heads at once; quantizes to int8
  (with the scales; IEEE division and exact round-half-to-even, so the result is bitwise torch's)
  when the cache is int8, else casts to the cache dtype.

The wrappers check shapes, dtypes, strides and devices on the host and raise ``ValueError`` with
what to fix; they do not read device memory, so two things stay the caller's contract (as with the
references): block ids in the used part of a block table and the slots in a slot mapping must be
inside the cache (slots distinct), and ``seq_lens`` must be >= 1 (a zero length gives NaN, like the
reference).

Triton kernels need CUDA tensors. With ``TRITON_INTERPRET=1`` in the environment *before* triton
is imported, Triton's interpreter runs them on CPU tensors (slowly): that is how the tests run.
Two interpreter quirks (Triton 3.9) are worked around so that it computes what the GPU computes:
its float32 -> bfloat16 cast truncates (the GPU rounds to nearest even), so the kernels round to
bfloat16 by bit arithmetic everywhere (``_to_bf16``); and its ``tl.dot`` multiplies bfloat16
operands as their raw uint16 bits, so under the interpreter the (already bfloat16-rounded) operands
are handed to the dot as float32 (``WIDEN_BF16``; on CUDA they go to the tensor cores as bfloat16).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

INT8_MAX = tl.constexpr(127.0)
# Smallest amax used for a scale, as in the reference's quantize_int8 (an all-zero row gets scale 1e-8/127).
AMAX_FLOOR = tl.constexpr(1e-8)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2_E = 1.4426950408889634


@triton.jit
def _to_bf16(x):
    """float32 -> bfloat16, round to nearest even, by bit arithmetic (finite inputs).

    The native cast does the same on CUDA; Triton's interpreter truncates instead, so the kernels use
    this one everywhere and run the same arithmetic in both places.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even into bfloat16 (see _to_bf16) and ints going via float32."""
    if dtype == tl.bfloat16:
        if x.dtype != tl.bfloat16:
            x = _to_bf16(x.to(tl.float32))
    elif x.dtype.is_int() and dtype != tl.float32:
        x = x.to(tl.float32).to(dtype)
    else:
        x = x.to(dtype)
    return x


@triton.jit
def _dot_operand(x, OP_DTYPE: tl.constexpr, WIDEN_BF16: tl.constexpr):
    """Round x to the dot's operand dtype; with WIDEN_BF16 (interpreter only) hand the bfloat16 values
    to the dot as float32, the same numbers, because the interpreter's dot misreads bfloat16."""
    x = _cast(x, OP_DTYPE)
    if WIDEN_BF16:
        x = x.to(tl.float32)
    return x


@triton.jit
def _kv_tile(table_ptr, pos, valid, kv_head, d, stride_tn, stride_cb, stride_cs, stride_ch, stride_cd,
             stride_sb, stride_ss, stride_sh, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Where a tile of token positions ``pos`` (``valid`` ones are read) of one sequence lies, each position
    finding its block through the sequence's block table (``table_ptr``): the K/V offsets [tile, HEAD_DIM]
    of KV head ``kv_head`` and the int8 scales' offsets [tile]."""
    block_ids = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_tn, mask=valid, other=0).to(tl.int64)
    token_offs = block_ids * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    # Contiguous caches (checked by the wrappers) put every token row at a multiple of HEAD_DIM: telling
    # the compiler lets it load each row with wide vector loads instead of one load per element.
    token_offs = tl.multiple_of(token_offs, HEAD_DIM)
    scale_offs = block_ids * stride_sb + (pos % BLOCK_SIZE) * stride_ss + kv_head * stride_sh
    return token_offs[:, None] + d[None, :] * stride_cd, scale_offs


@triton.jit
def _tile_logits(q, k_cache_ptr, k_scale_ptr, kv_offs, scale_offs, valid, qk_scale, IS_INT8: tl.constexpr,
                 OP_DTYPE: tl.constexpr, WIDEN_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Base-2 logits [rows of q, tile] of the queries against a tile of keys. int8 keys enter the dot as
    exact integers (exact in every operand dtype); their scales multiply the logits after it."""
    k = _dot_operand(tl.load(k_cache_ptr + kv_offs, mask=valid[:, None], other=0), OP_DTYPE, WIDEN_BF16)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if IS_INT8:
        s = s * tl.load(k_scale_ptr + scale_offs, mask=valid, other=0.0)[None, :]
    return s * qk_scale


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v_cache_ptr, v_scale_ptr, kv_offs, scale_offs, valid,
                         IS_INT8: tl.constexpr, OP_DTYPE: tl.constexpr, WIDEN_BF16: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Folds a tile's (masked) logits into the running max ``m_i``, sum ``l_i`` and accumulator ``acc``
    (rescaled by the change of max: 0 on the first tile), its values dequantized like the reference
    (value * scale, then the operand dtype). A row whose logits are all masked so far (a sliding window that
    starts in a later tile) keeps its zeros."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_offs, mask=valid[:, None], other=0)
    if IS_INT8:
        v = v.to(tl.float32) * tl.load(v_scale_ptr + scale_offs, mask=valid, other=0.0)[:, None]
    v = _dot_operand(v, OP_DTYPE, WIDEN_BF16)
    acc = acc * alpha[:, None] + tl.dot(_dot_operand(p, OP_DTYPE, WIDEN_BF16), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    max_blocks,
    window,  # sliding window: each sequence sees its last `window` keys; 0 for full attention
    stride_qb, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # k_cache and v_cache share strides (checked by the wrapper)
    stride_sb, stride_ss, stride_sh,  # k_scale and v_scale share strides
    stride_tb, stride_tn,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,  # token positions per iteration
    IS_INT8: tl.constexpr,
    WIDEN_BF16: tl.constexpr,  # interpreter workaround, see _dot_operand
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 queries (no TF32), the default for 16-bit ones
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    OP_DTYPE: tl.constexpr = q_ptr.dtype.element_ty  # dot operands are in the query dtype

    g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]: row i is query head kv_head * GROUP + i
    d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    n = tl.arange(0, TILE_N)  # [TILE_N]
    g_valid = g < GROUP

    # q: [GROUP_PAD, HEAD_DIM] (padding rows are zero and never stored)
    q_offs = seq * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :] * stride_qd
    q = _dot_operand(tl.load(q_ptr + q_offs, mask=g_valid[:, None], other=0.0), OP_DTYPE, WIDEN_BF16)

    # Positions past the block table are not part of the context (the reference masks them the same way).
    # (int32 positions: a context never nears 2**31 tokens, and 32-bit index math is cheaper)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks * BLOCK_SIZE).to(tl.int32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max of the base-2 logits
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)  # running sum of weights * values

    lo = tl.where((window > 0) & (seq_len > window), seq_len - window, 0)  # the first key read
    for start in range(lo // TILE_N * TILE_N, seq_len, TILE_N):
        pos = start + n  # [TILE_N] token positions of this tile
        valid = (pos < seq_len) & (pos >= lo)
        kv_offs, scale_offs = _kv_tile(block_tables_ptr + seq * stride_tb, pos, valid, kv_head, d, stride_tn,
                                       stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
                                       BLOCK_SIZE, HEAD_DIM)
        s = _tile_logits(q, k_cache_ptr, k_scale_ptr, kv_offs, scale_offs, valid, qk_scale, IS_INT8, OP_DTYPE,
                         WIDEN_BF16, DOT_PRECISION)  # [GROUP_PAD, TILE_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds at least one valid position, so the running max is finite.
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v_cache_ptr, v_scale_ptr, kv_offs, scale_offs, valid,
                                             IS_INT8, OP_DTYPE, WIDEN_BF16, DOT_PRECISION)

    out = acc / l_i[:, None]
    out_offs = seq * stride_ob + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(out_ptr + out_offs, _cast(out, out_ptr.dtype.element_ty), mask=g_valid[:, None])


@triton.jit
def _round_half_even(y):
    """Round float32 ``y`` to the nearest integer, ties to even (torch.round's rule), exactly."""
    r = tl.floor(y)
    frac = y - r  # exact: the fraction of a float32 is a float32
    r_is_odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & r_is_odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # shared by both caches
    stride_sb, stride_ss, stride_sh,  # shared by both scale tensors
    HEADS_PAD: tl.constexpr,  # num_kv_heads rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    h_valid = h < num_kv_heads
    mask = h_valid[:, None]  # [HEADS_PAD, 1]

    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # cache_offs: [HEADS_PAD, HEAD_DIM]
    row_offs = tl.multiple_of(block * stride_cb + offset * stride_cs + h * stride_ch, HEAD_DIM)  # [HEADS_PAD]
    cache_offs = row_offs[:, None] + d[None, :] * stride_cd

    # k, v: [HEADS_PAD, HEAD_DIM] rows of this token
    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask, other=0.0)
    if IS_INT8:
        scale_offs = block * stride_sb + offset * stride_ss + h * stride_sh  # [HEADS_PAD]
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        # IEEE divisions (div_rn), not Triton's default fast division, to match the reference bit for bit.
        k_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(k), axis=1), AMAX_FLOOR), INT8_MAX)  # [HEADS_PAD]
        v_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), AMAX_FLOOR), INT8_MAX)
        kq = _round_half_even(tl.math.div_rn(k, k_scale[:, None]))
        vq = _round_half_even(tl.math.div_rn(v, v_scale[:, None]))
        kq = tl.minimum(tl.maximum(kq, -INT8_MAX), INT8_MAX)
        vq = tl.minimum(tl.maximum(vq, -INT8_MAX), INT8_MAX)
        tl.store(k_cache_ptr + cache_offs, kq.to(tl.int8), mask=mask)
        tl.store(v_cache_ptr + cache_offs, vq.to(tl.int8), mask=mask)
        tl.store(k_scale_ptr + scale_offs, k_scale, mask=h_valid)
        tl.store(v_scale_ptr + scale_offs, v_scale, mask=h_valid)
    else:
        tl.store(k_cache_ptr + cache_offs, _cast(k, k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offs, _cast(v, v_cache_ptr.dtype.element_ty), mask=mask)


# ---- host wrappers ----------------------------------------------------------------------------------

INTERPRETED = not isinstance(_paged_decode_kernel, triton.runtime.JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1 (kernels run on CPU tensors in the interpreter)."""


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, starts_ptr, lens_ptr, ctxs_ptr, block_tables_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    max_blocks,
    window,  # sliding window: the query at position p sees keys p - window + 1 .. p; 0 for full attention
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # k_cache and v_cache share strides (checked by the wrapper)
    stride_sb, stride_ss, stride_sh,  # k_scale and v_scale share strides
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # key positions per iteration
    IS_INT8: tl.constexpr,
    WIDEN_BF16: tl.constexpr,  # interpreter workaround, see _dot_operand
    DOT_PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    OP_DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    length = tl.load(lens_ptr + chunk).to(tl.int32)
    if q_tile * TILE_M < length:
        start = tl.load(starts_ptr + chunk)
        ctx = tl.load(ctxs_ptr + chunk).to(tl.int32)
        m_idx = q_tile * TILE_M + tl.arange(0, TILE_M)  # [TILE_M] query index inside the chunk
        m_valid = m_idx < length
        q_pos = ctx - length + m_idx  # each query's position in its sequence
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, TILE_N)
        q_offs = (start + m_idx)[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd
        q = _dot_operand(tl.load(q_ptr + q_offs, mask=m_valid[:, None], other=0.0), OP_DTYPE, WIDEN_BF16)

        m_i = tl.full([TILE_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([TILE_M], dtype=tl.float32)
        acc = tl.zeros([TILE_M, HEAD_DIM], dtype=tl.float32)
        first_pos = ctx - length + q_tile * TILE_M  # the tile's first query: every key up to it is seen by all
        last_pos = tl.minimum(first_pos + TILE_M, ctx)  # one past the tile's last query's position
        full_end = (first_pos + 1) // TILE_N * TILE_N  # key tiles before this need no mask
        # With a window: each query's first key; tiles from the first query's are read, those before the
        # last query's are masked too
        q_lo = tl.where(window > 0, q_pos - window + 1, 0)
        lo_end = tl.where(window > 0, last_pos - window, 0)
        for kstart in range(tl.maximum(tl.where(window > 0, first_pos - window + 1, 0), 0) // TILE_N * TILE_N,
                            last_pos, TILE_N):
            pos = kstart + n
            valid = pos < last_pos
            kv_offs, scale_offs = _kv_tile(block_tables_ptr + chunk * stride_tb, pos, valid, kv_head, d, stride_tn,
                                           stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss,
                                           stride_sh, BLOCK_SIZE, HEAD_DIM)
            s = _tile_logits(q, k_cache_ptr, k_scale_ptr, kv_offs, scale_offs, valid, qk_scale, IS_INT8, OP_DTYPE,
                             WIDEN_BF16, DOT_PRECISION)  # [TILE_M, TILE_N]
            if (kstart >= full_end) | (kstart < lo_end):  # the diagonal (or the window's edge)
                s = tl.where((pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= q_lo[:, None]), s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v_cache_ptr, v_scale_ptr, kv_offs, scale_offs,
                                                 valid, IS_INT8, OP_DTYPE, WIDEN_BF16, DOT_PRECISION)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows past the chunk may see no key
        out_offs = (start + m_idx)[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od
        tl.store(out_ptr + out_offs, _cast(out, out_ptr.dtype.element_ty), mask=m_valid[:, None])


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_devices(tensors: dict[str, torch.Tensor | None]) -> None:
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    _require(len(devices) == 1, "all tensors must be on one device, got "
             + ", ".join(f"{name} on {t.device}" for name, t in present.items()))
    device = devices.pop()
    if not INTERPRETED and device.type != "cuda":
        raise ValueError(f"Triton kernels need CUDA tensors (got {device}); on CPU use the torch reference "
                         "(kernels/paged_attention.py) or set TRITON_INTERPRET=1 before importing triton")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> None:
    _require(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
             f"got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape "
             f"{tuple(k_cache.shape)}")
    _require(k_cache.dtype in CACHE_DTYPES, f"cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
    _require(v_cache.dtype == k_cache.dtype, f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    head_dim = k_cache.shape[3]
    _require(_is_pow2(head_dim) and head_dim >= 16,
             f"head_dim must be a power of two >= 16 (64 and 128 are the tested ones), got {head_dim}")
    if k_cache.dtype == torch.int8:
        want = tuple(k_cache.shape[:3])
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            _require(s is not None, f"int8 caches need {name} [num_blocks, block_size, num_kv_heads] float32")
            _require(tuple(s.shape) == want, f"{name} must have shape {want}, got {tuple(s.shape)}")
            _require(s.dtype == torch.float32, f"{name} must be float32, got {s.dtype}")
            _require(s.is_contiguous(), f"{name} must be contiguous")
    else:
        _require(k_scale is None and v_scale is None,
                 f"k_scale/v_scale are for int8 caches only; this cache is {k_cache.dtype}")


def _scale_strides(k_scale: torch.Tensor | None) -> tuple[int, ...]:
    # Float caches pass the caches themselves as never-read stand-ins for the scale pointers.
    return tuple(k_scale.stride()) if k_scale is not None else (0, 0, 0)


def _decode_launch_config(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple[int, int]:
    """(tile_n, num_warps) per dtype pair, picked so that ptxas needs no spills for sm_90 at head_dim 64
    and 128 and any group size (checked by compiling ahead of time; the speed of each is not tuned)."""
    if q_dtype == torch.float32:
        # float32 dots run on FMA units ("ieee"), which keep whole rows of the operands in registers.
        return (16, 8) if cache_dtype == torch.int8 else (32, 4)
    return (32, 4) if cache_dtype == torch.int8 else (64, 4)


def paged_attention_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                  tile_n: int | None = None, window: int | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache; the same result as ``paged_attention_decode``.

    q: [batch, num_heads, head_dim] float32/float16/bfloat16 (num_heads a multiple of num_kv_heads;
    query head i reads KV head i // (num_heads // num_kv_heads)); k_cache/v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim]; block_tables: [batch, max_blocks] int64; seq_lens: [batch]
    int64 >= 1 (the context length including the query token, whose K/V must already be written;
    positions past max_blocks * block_size are ignored, as in the reference). k_scale/v_scale:
    [num_blocks, block_size, num_kv_heads] float32 for int8 caches. tile_n: token positions per
    iteration (a power of two >= 16; by default per dtype pair, see _decode_launch_config). window: a
    sliding window (each sequence sees its last ``window`` keys), None for full attention.
    Returns [batch, num_heads, head_dim] in q's dtype; the arithmetic is float32 (dot products of
    q-dtype operands with float32 accumulation, online softmax in float32).
    """
    _require(q.dim() == 3, f"q must be [batch, num_heads, head_dim], got shape {tuple(q.shape)}")
    _require(q.dtype in QUERY_DTYPES, f"q dtype must be one of {QUERY_DTYPES}, got {q.dtype}")
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    _require(head_dim == cache_head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    _require(num_heads % num_kv_heads == 0,
             f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    _require(block_tables.dim() == 2 and block_tables.shape[0] == batch,
             f"block_tables must be [batch={batch}, max_blocks], got shape {tuple(block_tables.shape)}")
    _require(block_tables.dtype == torch.int64, f"block_tables must be int64, got {block_tables.dtype}")
    _require(block_tables.shape[1] >= 1, "block_tables needs at least one column")
    _require(tuple(seq_lens.shape) == (batch,), f"seq_lens must be [batch={batch}], got {tuple(seq_lens.shape)}")
    _require(seq_lens.dtype == torch.int64, f"seq_lens must be int64, got {seq_lens.dtype}")
    _require(tile_n is None or (_is_pow2(tile_n) and tile_n >= 16),
             f"tile_n must be a power of two >= 16, got {tile_n}")
    _require(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
             f"scale must be a positive finite number, got {scale!r}")
    _require(window is None or window >= 1, f"window must be None or at least 1, got {window!r}")
    _check_devices({"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
                    "seq_lens": seq_lens, "k_scale": k_scale, "v_scale": v_scale})

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    is_int8 = k_cache.dtype == torch.int8
    default_tile, num_warps = _decode_launch_config(q.dtype, k_cache.dtype)
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache,
        k_scale if is_int8 else k_cache, v_scale if is_int8 else v_cache,
        block_tables, seq_lens, out,
        float(scale) * LOG2_E, block_tables.shape[1], window or 0,
        *q.stride(), *k_cache.stride(), *_scale_strides(k_scale), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE_N=tile_n or default_tile, IS_INT8=is_int8, WIDEN_BF16=INTERPRETED and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    return out


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Scatter new keys and values into their slots (slot = block * block_size + offset), in place.

    k, v: [num_tokens, num_kv_heads, head_dim] float (any strides); slot_mapping: [num_tokens] int64
    of distinct slots. Float caches get k/v cast to their dtype; int8 caches get the values quantized
    per token and head (scale = amax / 127, round half to even, clamp to +-127) and their scales
    written to k_scale/v_scale. Same result as ``write_kv``: float caches bit for bit, int8 values and
    scales bit for bit too (IEEE division and exact round-half-even; see tests/test_kernels.py).
    """
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        _require(t.dim() == 3 and tuple(t.shape[1:]) == (num_kv_heads, head_dim),
                 f"{name} must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], "
                 f"got shape {tuple(t.shape)}")
        _require(t.dtype in QUERY_DTYPES, f"{name} dtype must be one of {QUERY_DTYPES}, got {t.dtype}")
    _require(k.shape == v.shape, f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    num_tokens = k.shape[0]
    _require(tuple(slot_mapping.shape) == (num_tokens,),
             f"slot_mapping must be [num_tokens={num_tokens}], got shape {tuple(slot_mapping.shape)}")
    _require(slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}")
    _check_devices({"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "slot_mapping": slot_mapping,
                    "k_scale": k_scale, "v_scale": v_scale})
    if num_tokens == 0:
        return
    is_int8 = k_cache.dtype == torch.int8
    heads_pad = triton.next_power_of_2(num_kv_heads)
    # One program per token: a warp per 256 elements of its rows (1 to 4 warps).
    num_warps = max(1, min(4, heads_pad * head_dim // 256))
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache,
        k_scale if is_int8 else k_cache, v_scale if is_int8 else v_cache,
        slot_mapping, num_kv_heads,
        *k.stride(), *v.stride(), *k_cache.stride(), *_scale_strides(k_scale),
        HEADS_PAD=heads_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, IS_INT8=is_int8, num_warps=num_warps,
    )


def _prefill_launch_config(q_dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps): 16-bit queries on the tensor cores in 64 x 64 tiles (32 keys at head
    size 128 and above); float32 in smaller tiles for the FMA units."""
    if q_dtype == torch.float32:
        return 32, 32, 4
    return 64, (64 if head_dim <= 64 else 32), 4


def paged_attention_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   starts: torch.Tensor, lens: torch.Tensor, ctxs: torch.Tensor,
                                   block_tables: torch.Tensor, max_len: int, scale: float, out: torch.Tensor,
                                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                   window: int | None = None) -> None:
    """Causal attention of prompt chunks over their paged context (their own K/V already written), as
    query tiles against key tiles with an online softmax: chunk i is rows starts[i] .. starts[i] +
    lens[i] - 1 of q [num_rows, num_heads, head_dim], the last lens[i] positions of a sequence of
    ctxs[i] tokens held in the blocks of block_tables[i] ([num_chunks, max_blocks] int64); max_len:
    the longest chunk (given by the caller, which built the chunks on the host: no device read). Writes
    those rows of ``out`` (q's shape and dtype); the same result as TorchAttention.prefill per chunk.
    One program per (chunk, query tile, query head); only key tiles on the diagonal are masked. window: a
    sliding window (the query at position p sees keys p - window + 1 .. p; key tiles wholly before a tile's
    windows are not read, those on a window's edge are masked), None for full attention."""
    _require(q.dim() == 3, f"q must be [num_rows, num_heads, head_dim], got shape {tuple(q.shape)}")
    _require(q.dtype in QUERY_DTYPES, f"q dtype must be one of {QUERY_DTYPES}, got {q.dtype}")
    _require(out.shape == q.shape and out.dtype == q.dtype, "out must have q's shape and dtype")
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    _require(head_dim == cache_head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    _require(num_heads % num_kv_heads == 0,
             f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    num_chunks = starts.shape[0]
    for name, t in (("starts", starts), ("lens", lens), ("ctxs", ctxs)):
        _require(tuple(t.shape) == (num_chunks,) and t.dtype == torch.int64, f"{name} must be [{num_chunks}] int64")
    _require(block_tables.dim() == 2 and block_tables.shape[0] == num_chunks and block_tables.dtype == torch.int64,
             f"block_tables must be [num_chunks={num_chunks}, max_blocks] int64, got {tuple(block_tables.shape)}")
    _require(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
             f"scale must be a positive finite number, got {scale!r}")
    _require(window is None or window >= 1, f"window must be None or at least 1, got {window!r}")
    _check_devices({"q": q, "k_cache": k_cache, "v_cache": v_cache, "starts": starts, "block_tables": block_tables,
                    "out": out, "k_scale": k_scale, "v_scale": v_scale})
    if num_chunks == 0:
        return
    tile_m, tile_n, num_warps = _prefill_launch_config(q.dtype, head_dim)
    _require(max_len >= 1, f"max_len must be the longest chunk's length, got {max_len}")
    is_int8 = k_cache.dtype == torch.int8
    _paged_prefill_kernel[(num_chunks, triton.cdiv(max_len, tile_m), num_heads)](
        q, k_cache, v_cache,
        k_scale if is_int8 else k_cache, v_scale if is_int8 else v_cache,
        starts, lens, ctxs, block_tables, out,
        float(scale) * LOG2_E, block_tables.shape[1], window or 0,
        *q.stride(), *k_cache.stride(), *_scale_strides(k_scale), *block_tables.stride(), *out.stride(),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE_M=tile_m, TILE_N=tile_n,
        IS_INT8=is_int8, WIDEN_BF16=INTERPRETED and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
