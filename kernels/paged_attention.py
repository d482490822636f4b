"""Paged attention: torch reference implementations.

The KV cache of one layer is two tensors ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset``; a sequence's keys live in the slots named by its block table.
These functions are the reference every faster kernel is checked against, and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys and values into their slots.

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    # index_copy_ on a flat view writes every token in one op (no Python loop over blocks).
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read the keys (or values) at ``slots`` ([...]) -> [..., num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = cache.shape[-2:]
    return cache.view(-1, num_kv_heads, head_dim)[slots]


def context_slots(block_tables: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """Slot of every position < max_len for each row of ``block_tables`` ([batch, max_blocks])."""
    pos = torch.arange(max_len, device=block_tables.device)
    # slots: [batch, max_len]
    return block_tables[:, pos // block_size] * block_size + pos % block_size


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context (grouped-query attention).

    q: [batch, num_heads, head_dim]; block_tables: [batch, max_blocks] int64; seq_lens: [batch] int64
    (context length including the query token, whose K/V must already be written).
    key_mask: optional precomputed ``decode_key_mask(block_tables, seq_lens, block_size)``, so that
    a model calls it once per forward instead of once per layer.
    Returns [batch, num_heads, head_dim] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * block_size
    # Whole blocks by index_select: one contiguous copy per block, several times faster on CPU
    # than gathering token slots. k, v: [batch, num_kv_heads, width, head_dim]
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
    valid = decode_key_mask(block_tables, seq_lens, block_size) if key_mask is None else key_mask
    # Grouped-query attention as plain attention: each KV head serves its `group` query heads as
    # `group` query rows (q: [batch, num_kv_heads, group, head_dim]); no K/V repeat, no GQA path.
    out = F.scaled_dot_product_attention(q.view(batch, num_kv_heads, group, head_dim), k.to(q.dtype),
                                         v.to(q.dtype), attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def decode_key_mask(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """[batch, width] bool: which gathered key positions are inside each sequence's context."""
    width = block_tables.shape[1] * block_size
    return torch.arange(width, device=block_tables.device)[None, :] < seq_lens[:, None]
