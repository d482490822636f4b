"""Paged attention: torch reference implementations (and the CPU path).

The KV cache of one layer is two tensors ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset``; a sequence's keys live in the slots named by its block table.

int8 caches carry per-token-per-head scales ``k_scale``/``v_scale`` of shape
``[num_blocks, block_size, num_kv_heads]`` (float32): value = int8 * scale, with
scale = max(|x|) / 127 over the head dimension (symmetric, round to nearest).
These functions are the reference every faster kernel is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] -> (int8 values [..., head_dim], float32 scales [...])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX
    q = torch.round(xf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter new keys and values into their slots, quantizing when the cache is int8.

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None, "int8 caches need scale tensors"
        kq, ks = quantize_int8(k)
        vq, vs = quantize_int8(v)
        flat_k.index_copy_(0, slot_mapping, kq)
        flat_v.index_copy_(0, slot_mapping, vq)
        k_scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, ks)
        v_scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, vs)
        return
    # index_copy_ on a flat view writes every token in one op (no Python loop over blocks).
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """Read the keys (or values) at ``slots`` ([...]) -> [..., num_kv_heads, head_dim] in ``dtype``
    (dequantized for int8 caches)."""
    num_kv_heads, head_dim = cache.shape[-2:]
    out = cache.view(-1, num_kv_heads, head_dim)[slots]
    if cache.dtype == torch.int8:
        assert scale is not None, "int8 caches need a scale tensor"
        out = out.float() * scale.view(-1, num_kv_heads)[slots].unsqueeze(-1)
    return out if dtype is None else out.to(dtype)


def decode_key_mask(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    window: int | None = None) -> torch.Tensor:
    """[batch, width] bool: which gathered key positions are inside each sequence's context (its last
    ``window`` positions with a sliding window)."""
    width = block_tables.shape[1] * block_size
    pos = torch.arange(width, device=block_tables.device)[None, :]
    mask = pos < seq_lens[:, None]
    return mask if window is None else mask & (pos >= seq_lens[:, None] - window)


def causal_mask(n: int, ctx: int, window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, ctx] bool for the last n positions of a sequence of ctx tokens as queries: query i (position
    ctx - n + i) sees keys 0 .. ctx - n + i, only the last ``window`` of them with a sliding window."""
    pos = ctx - n + torch.arange(n, device=device)[:, None]
    keys = torch.arange(ctx, device=device)[None, :]
    mask = keys <= pos
    return mask if window is None else mask & (keys > pos - window)


def _gather_blocks(cache: torch.Tensor, flat_tables: torch.Tensor, scale: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    # Whole blocks by index_select: one contiguous copy per block, several times faster on CPU
    # than gathering token slots.
    blocks = cache.index_select(0, flat_tables)
    if cache.dtype == torch.int8:
        assert scale is not None, "int8 caches need a scale tensor"
        return (blocks.float() * scale.index_select(0, flat_tables).unsqueeze(-1)).to(dtype)
    return blocks.to(dtype)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           key_mask: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context (grouped-query attention).

    q: [batch, num_heads, head_dim]; block_tables: [batch, max_blocks] int64; seq_lens: [batch] int64
    (context length including the query token, whose K/V must already be written).
    key_mask: optional precomputed ``decode_key_mask(block_tables, seq_lens, block_size)``, so that
    a model calls it once per forward instead of once per layer (without the window: a window narrows
    it here). k_scale/v_scale: for int8 caches. window: each sequence sees its last ``window`` keys.
    Returns [batch, num_heads, head_dim] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1)
    # k, v: [batch, num_kv_heads, width, head_dim]
    k = _gather_blocks(k_cache, flat, k_scale, q.dtype).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather_blocks(v_cache, flat, v_scale, q.dtype).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
    valid = decode_key_mask(block_tables, seq_lens, block_size) if key_mask is None else key_mask
    if window is not None:
        valid = valid & (torch.arange(width, device=q.device)[None, :] >= seq_lens[:, None] - window)
    # Grouped-query attention as plain attention: each KV head serves its `group` query heads as
    # `group` query rows (q: [batch, num_kv_heads, group, head_dim]); no K/V repeat, no GQA path.
    out = F.scaled_dot_product_attention(q.view(batch, num_kv_heads, group, head_dim), k, v,
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)


@dataclass(frozen=True)
class Chunks:
    """The prompt chunks of one pass, as the prefill kernel takes them: chunk i is rows starts[i] ..
    starts[i] + lens[i] - 1 of the pass, the last lens[i] positions of a sequence of ctxs[i] tokens held
    in the blocks of tables[i] (zero-padded to the widest)."""

    starts: torch.Tensor  # [n] int64
    lens: torch.Tensor  # [n] int64
    ctxs: torch.Tensor  # [n] int64
    tables: torch.Tensor  # [n, max_blocks] int64

    @classmethod
    def of(cls, spans: list[tuple[int, int, torch.Tensor]], block_size: int) -> Chunks:
        """spans: (first row, length, slots of the sequence's tokens 0..ctx - 1, block-aligned)."""
        tables = [(slots[::block_size] // block_size).to(torch.int64) for _, _, slots in spans]
        out = torch.zeros(len(spans), max(t.shape[0] for t in tables), dtype=torch.int64)
        for i, t in enumerate(tables):
            out[i, :t.shape[0]] = t
        return cls(torch.tensor([s for s, _, _ in spans], dtype=torch.int64),
                   torch.tensor([n for _, n, _ in spans], dtype=torch.int64),
                   torch.tensor([slots.shape[0] for _, _, slots in spans], dtype=torch.int64), out)

    def to(self, device: torch.device | str) -> Chunks:
        return Chunks(*(t.to(device) for t in (self.starts, self.lens, self.ctxs, self.tables)))


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: Chunks,
                            scale: float, out: torch.Tensor, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, window: int | None = None) -> None:
    """The prefill kernels' reference: each chunk's rows of ``out`` = causal attention of its queries
    (q [num_rows, num_heads, head_dim]) over its sequence's keys and values gathered through its block
    table (dequantized to q's dtype for int8 caches), by scaled_dot_product_attention; with a sliding
    window, over each query's last ``window`` keys."""
    block_size = k_cache.shape[1]
    for i in range(chunks.starts.shape[0]):
        start, n, ctx = (int(chunks.starts[i]), int(chunks.lens[i]), int(chunks.ctxs[i]))
        pos = torch.arange(ctx, device=q.device)
        slots = chunks.tables[i, pos // block_size] * block_size + pos % block_size
        keys = gather_kv(k_cache, slots, k_scale, q.dtype).transpose(0, 1)
        values = gather_kv(v_cache, slots, v_scale, q.dtype).transpose(0, 1)
        mask = causal_mask(n, ctx, window, q.device)
        out[start:start + n] = F.scaled_dot_product_attention(
            q[start:start + n].transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
            enable_gqa=True).transpose(0, 1)
