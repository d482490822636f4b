"""Attention over the paged KV cache, behind a small backend interface.

The model runner builds one :class:`AttentionMetadata` per forward pass; every layer reuses it.
In the flattened batch, decode tokens (one per sequence) come first, then prefill chunks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.kernels.paged_attention import gather_kv, paged_attention_decode, write_kv


@dataclass(frozen=True)
class DecodeBatch:
    """Rows ``0..num_seqs-1`` of the batch: one new token per sequence."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor  # [num_seqs] int64, context length including the new token
    key_mask: torch.Tensor  # [num_seqs, max_blocks * block_size] bool, from decode_key_mask


@dataclass(frozen=True)
class PrefillSpan:
    """A chunk of one sequence's prompt: rows ``start..start+length-1``."""

    start: int
    length: int
    # Slots of the whole context (cached prefix + earlier chunks + this chunk), or None when the
    # context is exactly this chunk (then keys come straight from the projection, no gather).
    context_slots: torch.Tensor | None  # [context_len] int64
    # mask[i, j]: query i may see key j. None with context_slots None (plain causal).
    mask: torch.Tensor | None  # [length, context_len] bool

    def __post_init__(self) -> None:
        if (self.context_slots is None) != (self.mask is None):
            raise ValueError("context_slots and mask come together")


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    decode: DecodeBatch | None
    prefills: tuple[PrefillSpan, ...]


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the new K/V into the paged cache.

    Preconditions: q is [num_tokens, num_heads, head_dim]; k and v are [num_tokens, num_kv_heads,
    head_dim] for the same tokens; caches are [num_blocks, block_size, num_kv_heads, head_dim];
    ``meta`` describes every row of q exactly once. Returns [num_tokens, num_heads, head_dim].
    """

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class TorchAttention(AttentionBackend):
    """Reference backend: gathers blocks with indexing and calls scaled_dot_product_attention."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        parts: list[torch.Tensor] = []
        if meta.decode is not None:
            d = meta.decode
            parts.append(paged_attention_decode(q[: d.num_seqs], k_cache, v_cache, d.block_tables,
                                                d.seq_lens, scale, d.key_mask))
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            qs = q[rows].transpose(0, 1)  # [num_heads, length, head_dim]
            if span.context_slots is None:
                ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ks = gather_kv(k_cache, span.context_slots).transpose(0, 1).to(q.dtype)
                vs = gather_kv(v_cache, span.context_slots).transpose(0, 1).to(q.dtype)
                out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale,
                                                     enable_gqa=True)
            parts.append(out.transpose(0, 1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
