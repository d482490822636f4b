"""Attention over the paged KV cache, behind a small backend interface.

The model runner builds one :class:`AttentionMetadata` per forward pass; every layer reuses it.
In the flattened batch, decode tokens (one per sequence) come first, then prefill chunks.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from baton.kernels import cpu as cpu_kernels
from baton.kernels.paged_attention import (
    Chunks,
    causal_mask,
    decode_key_mask,
    gather_kv,
    paged_attention_decode,
    write_kv,
)


@dataclass(frozen=True)
class LayerCache:
    """One layer's paged K/V: [num_blocks, block_size, num_kv_heads, head_dim] each; int8 caches also
    carry per-token-per-head scales [num_blocks, block_size, num_kv_heads] (float32)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.k.dtype == torch.int8) != (self.k_scale is not None and self.v_scale is not None):
            raise ValueError("int8 caches, and only they, carry scales")


@dataclass(frozen=True)
class DecodeBatch:
    """Rows ``0..num_seqs-1`` of the batch: one new token per sequence."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor  # [num_seqs] int64, context length including the new token
    block_size: int

    @functools.cached_property
    def key_mask(self) -> torch.Tensor:
        """[num_seqs, max_blocks * block_size] bool (decode_key_mask): built once a pass, by the first layer that
        reads it (the torch path; the C and Triton kernels read the lengths)."""
        return decode_key_mask(self.block_tables, self.seq_lens, self.block_size)


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


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend offers beyond :meth:`AttentionBackend.forward`, declared on its class: the model
    reads these once, when it is built, and never probes a backend for methods. All off by default
    (the all-torch reference path around ``forward``).

    ``fused_decode``: the backend implements :meth:`AttentionBackend.fused_decode`, a decode-only
    pass's rotary embedding, K/V write and attention in one call on the fused QKV rows. Preconditions:
    CPU tensors, rope tables in the activations' dtype. It may still decline a pass or a cache (returns
    None: prefill rows, int8 caches, dtypes outside ``cpu_kernels.PAGED_DTYPES``); the caller then runs
    ``apply_rotary`` and ``forward``, which give the same values.

    ``cpu_layer_ops``: the model may run the ops around this backend with the C kernels of kernels/cpu.py
    (residual add + RMSNorm in one call, SiLU-mul) instead of torch ops. Preconditions: CPU tensors and
    the C kernels built (``make_backend`` checks), activations in ``cpu_kernels.PAGED_DTYPES`` and a hidden
    size of at most 8192 (the model checks these two).

    ``whole_layer_decode``: ``cpu_kernels.decode_layers`` may stand in for this backend's attention, and
    for the whole layer around it, in decode-only passes: the backend's attention is that call's math (the
    C paged decode over this cache layout, read in place through the block tables). Needs both flags
    above: decode_layers fuses the same kernels. The model adds its own conditions (every linear layer
    in a C kernel's layout, every layer feature implemented by the C plan: see LlamaModel).
    """

    fused_decode: bool = False
    cpu_layer_ops: bool = False
    whole_layer_decode: bool = False

    def __post_init__(self) -> None:
        if self.whole_layer_decode and not (self.fused_decode and self.cpu_layer_ops):
            raise ValueError("whole_layer_decode runs the fused decode and the C layer ops: it needs both")


class ChunkCache:
    """The prefill spans of the last pass as the prefill kernels take them (``Chunks``, on ``device``):
    built on the host once per pass, every layer reuses them."""

    def __init__(self) -> None:
        self._last: tuple[AttentionMetadata, Chunks] | None = None

    def get(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> Chunks:
        if self._last is None or self._last[0] is not meta:
            spans = [(span.start, span.length, meta.slot_mapping[span.start:span.start + span.length].cpu()
                      if span.context_slots is None else span.context_slots.cpu()) for span in meta.prefills]
            self._last = (meta, Chunks.of(spans, block_size).to(device))
        return self._last[1]


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the new K/V into the paged cache.

    Preconditions: q is [num_tokens, num_heads, head_dim]; k and v are [num_tokens, num_kv_heads,
    head_dim] for the same tokens; ``cache`` is the layer's paged cache (see LayerCache);
    ``meta`` describes every row of q exactly once. ``window``: the layer's sliding window (a query at
    position p sees keys p - window + 1 .. p), None for full attention. Returns [num_tokens, num_heads,
    head_dim].

    ``capabilities`` (a class attribute) declares what else the backend offers (BackendCapabilities).
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor: ...

    def fused_decode(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos_table: torch.Tensor,
                     sin_table: torch.Tensor, positions: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                     scale: float, window: int | None = None) -> torch.Tensor | None:
        """A decode-only pass's attention from the fused projection: qkv [batch, (num_heads + 2 * num_kv_heads)
        * head_dim] -> [batch, num_heads * head_dim], or None when this pass or cache needs the general path.
        cos_table/sin_table: the full [positions, head_dim] rope tables. Only for backends whose
        ``capabilities.fused_decode`` is set."""
        raise NotImplementedError(f"{type(self).__name__} declares no fused_decode")

    @staticmethod
    def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, span: PrefillSpan,
                scale: float, window: int | None = None) -> torch.Tensor:
        """Attention for one prefill chunk, reading earlier context from the cache (dequantized)."""
        rows = slice(span.start, span.start + span.length)
        qs = q[rows].transpose(0, 1)  # [num_heads, length, head_dim]
        if span.context_slots is None:
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            if window is None or window >= span.length:
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = causal_mask(span.length, span.length, window, q.device)
                out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            ks = gather_kv(cache.k, span.context_slots, cache.k_scale, q.dtype).transpose(0, 1)
            vs = gather_kv(cache.v, span.context_slots, cache.v_scale, q.dtype).transpose(0, 1)
            mask = span.mask if window is None else span.mask & causal_mask(span.length, ks.shape[1], window, q.device)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)


class TorchAttention(AttentionBackend):
    """Reference backend: gathers blocks with indexing and calls scaled_dot_product_attention."""

    # The all-torch reference: no fused calls, the model's ops around it stay torch ops too.
    capabilities = BackendCapabilities()

    def forward(self, q, k, v, cache, meta, scale, window=None):
        write_kv(cache.k, cache.v, k, v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        parts: list[torch.Tensor] = []
        if meta.decode is not None:
            parts.append(self.decode(q[: meta.decode.num_seqs], cache, meta.decode, scale, window))
        parts.extend(self.prefill_span(q, k, v, cache, meta, span, scale, window) for span in meta.prefills)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def decode(self, q: torch.Tensor, cache: LayerCache, d: DecodeBatch, scale: float,
               window: int | None = None) -> torch.Tensor:
        """The decode rows' attention over their paged context (K/V already written)."""
        return paged_attention_decode(q, cache.k, cache.v, d.block_tables, d.seq_lens, scale, d.key_mask,
                                      cache.k_scale, cache.v_scale, window)

    def prefill_span(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
                     meta: AttentionMetadata, span: PrefillSpan, scale: float,
                     window: int | None = None) -> torch.Tensor:
        """One prefill chunk's attention (K/V already written)."""
        return self.prefill(q, k, v, cache, span, scale, window)


class TritonAttention(AttentionBackend):
    """CUDA backend: Triton kernels write the KV (quantizing for int8 caches) and run paged decode and
    prefill attention in place through the block tables, without gathering blocks."""

    capabilities = BackendCapabilities()  # CUDA: none of the CPU calls

    def __init__(self) -> None:
        from baton.kernels import triton_attention  # imports triton: only when this backend is chosen

        self._kernels = triton_attention
        self._chunks = ChunkCache()

    def forward(self, q, k, v, cache, meta, scale, window=None):
        kern = self._kernels
        kern.write_kv_triton(cache.k, cache.v, k, v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            d = meta.decode
            out[:d.num_seqs] = kern.paged_attention_decode_triton(q[: d.num_seqs], cache.k, cache.v, d.block_tables,
                                                                  d.seq_lens, scale, cache.k_scale, cache.v_scale,
                                                                  window=window)
        if meta.prefills:
            c = self._chunks.get(meta, cache.k.shape[1], q.device)
            kern.paged_attention_prefill_triton(q, cache.k, cache.v, c.starts, c.lens, c.ctxs, c.tables,
                                                max(span.length for span in meta.prefills), scale, out,
                                                cache.k_scale, cache.v_scale, window)
        return out


class CpuAttention(TorchAttention):
    """CPU backend: C kernels (kernels/cpu.py) that read K/V in place through the block tables. Prefill
    chunks: the tiled prefill kernel (query tiles against key tiles, online softmax; every chunk of a
    pass in one call per layer; float32, bfloat16 and int8 caches) where it runs (AVX-512, see
    ``cpu_kernels.has_prefill_attention``), else each chunk row as a decode query of the paged decode
    kernel. Decode rows: the paged decode kernel for float32 and bfloat16 caches; int8 caches use the
    torch path. ``fused_decode`` does a decode-only pass's rotary embedding, K/V write and attention in
    one call."""

    capabilities = BackendCapabilities(fused_decode=True, cpu_layer_ops=True, whole_layer_decode=True)

    def __init__(self) -> None:
        # The last pass's per-row block tables and lengths: every layer of a pass shares them.
        self._rows: tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self._chunks = ChunkCache()  # the same for the prefill kernel

    def forward(self, q, k, v, cache, meta, scale, window=None):
        if meta.prefills and cache.k.dtype in cpu_kernels.CACHE_KINDS \
                and cpu_kernels.has_prefill_attention(q.shape[-1], q.dtype):
            write_kv(cache.k, cache.v, k, v, meta.slot_mapping, cache.k_scale, cache.v_scale)
            q = q.contiguous()
            out = torch.empty_like(q)
            if meta.decode is not None:
                n = meta.decode.num_seqs
                out[:n] = self.decode(q[:n], cache, meta.decode, scale, window)
            cpu_kernels.prefill_chunks(q, cache.k, cache.v, self._chunks.get(meta, cache.k.shape[1], q.device), scale,
                                       out, cache.k_scale, cache.v_scale, window)
            return out
        rows = None
        if meta.prefills and cache.k.dtype in cpu_kernels.PAGED_DTYPES and q.dtype in cpu_kernels.PAGED_DTYPES:
            rows = self.query_rows(meta, cache.k.shape[1], q.shape[0])
        if rows is None:
            return super().forward(q, k, v, cache, meta, scale, window)
        write_kv(cache.k, cache.v, k, v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        return cpu_kernels.paged_decode(q, cache.k, cache.v, *rows, scale, window)

    def query_rows(self, meta: AttentionMetadata, block_size: int,
                   num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row of the pass as a decode query: its block table [num_rows, max_blocks] and context
        length [num_rows] (a prefill row at position p sees p + 1 keys). None unless the decode rows
        and the spans cover the rows exactly (then the per-span path runs)."""
        if self._rows is not None and self._rows[0] is meta:
            return self._rows[1]
        parts: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (first row, tables, lens)
        if meta.decode is not None:
            parts.append((0, meta.decode.block_tables, meta.decode.seq_lens))
        for span in meta.prefills:
            slots = (meta.slot_mapping[span.start:span.start + span.length] if span.context_slots is None
                     else span.context_slots)
            parts.append((span.start, *cpu_kernels.chunk_query_rows(slots, span.length, block_size)))
        result = None
        covered = sorted((start, start + t.shape[0]) for start, t, _ in parts)
        if covered[0][0] == 0 and covered[-1][1] == num_rows and all(
                a[1] == b[0] for a, b in zip(covered, covered[1:])):
            tables = torch.zeros(num_rows, max(t.shape[1] for _, t, _ in parts), dtype=torch.int64)
            lens = torch.empty(num_rows, dtype=torch.int64)
            for start, t, n in parts:
                tables[start:start + t.shape[0], :t.shape[1]] = t
                lens[start:start + t.shape[0]] = n
            result = (tables, lens)
        self._rows = (meta, result)
        return result

    def fused_decode(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos_table: torch.Tensor,
                     sin_table: torch.Tensor, positions: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                     scale: float, window: int | None = None) -> torch.Tensor | None:
        """[batch, num_heads * head_dim], or None when this pass or cache needs the general path
        (prefill rows, int8 caches, other dtypes)."""
        d = meta.decode
        if (meta.prefills or d is None or cache.k.dtype not in cpu_kernels.PAGED_DTYPES
                or cos_table.dtype != qkv.dtype or qkv.dtype not in cpu_kernels.PAGED_DTYPES):
            return None
        return cpu_kernels.decode_attention(qkv, num_heads, num_kv_heads, cos_table, sin_table, positions, cache.k,
                                            cache.v, meta.slot_mapping, d.block_tables, d.seq_lens, scale, window)

    def decode(self, q, cache, d, scale, window=None):
        if cache.k.dtype not in cpu_kernels.PAGED_DTYPES:
            return super().decode(q, cache, d, scale, window)
        return cpu_kernels.paged_decode(q, cache.k, cache.v, d.block_tables, d.seq_lens, scale, window)

    def prefill_span(self, q, k, v, cache, meta, span, scale, window=None):
        if cache.k.dtype not in cpu_kernels.PAGED_DTYPES or q.dtype not in cpu_kernels.PAGED_DTYPES:
            return super().prefill_span(q, k, v, cache, meta, span, scale, window)
        rows = slice(span.start, span.start + span.length)
        # The chunk's K/V are in the cache now, so each query row is a decode query over its own
        # prefix: query i (position start + i) sees keys 0..start + i, the span's causal mask.
        slots = meta.slot_mapping[rows] if span.context_slots is None else span.context_slots
        return cpu_kernels.prefill_attention(q[rows], cache.k, cache.v, slots, scale, window=window)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: Triton on CUDA; on CPU the C kernels when they build here, else torch.
    ``triton`` on CPU needs TRITON_INTERPRET=1 (tests)."""
    if name == "auto" and device.type == "cuda":
        name = "triton"
    elif name == "auto":
        name = "cpu" if cpu_kernels.available() else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on CPU only")
        cpu_kernels.library()  # raises KernelBuildError with the reason
        return CpuAttention()
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, cpu, torch or triton")
