"""Llama-family decoder over a paged KV cache (Llama 2/3, SmolLM, Mistral, Qwen2).

One forward pass serves both phases: the batch is a flat list of tokens from many sequences
(decode tokens first, then prefill chunks), described by :class:`AttentionMetadata`.
Weights are plain tensors, not nn.Modules: a decode step is dominated by per-op overhead on CPU,
so each layer is a short, fixed list of fused ops (one QKV matmul, one gate-up matmul).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.config import ModelConfig
from baton.kernels import cpu as cpu_kernels
from baton.model.attention import AttentionBackend, AttentionMetadata, LayerCache
from baton.model.linear import Linear
from baton.model.rope import RotaryEmbedding, apply_rotary


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q_size + 2 * kv_size
    o: Linear  # q_size -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Half precision: normalize in float32, round, then scale (the order transformers uses).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _linear_spec(lin: Linear) -> cpu_kernels.LinearSpec | None:
    if lin.block_kind == "bf16":
        return cpu_kernels.bf16_linear_spec(*lin.blocks, lin.out_features, lin.block_bias)
    if lin.block_kind == "q4_1":
        return cpu_kernels.q4_1_linear_spec(*lin.blocks, lin.out_features, lin.block_bias, lin.block_rows,
                                            lin.dense, lin.dense_bias)
    return None


def _spec_rows(lin: Linear) -> float:
    """Largest pass the whole-layer call can give this layer (bfloat16 blocks take any: BLOCK_ROWS)."""
    return math.inf if lin.dense is not None else lin.block_rows


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend, max_positions: int | None = None,
                 weight_mode: str = "auto") -> None:
        """weight_mode (see baton.model.linear.WEIGHT_MODES): "int8" keeps every linear layer and the LM head
        in int8 with per-channel scales; "q4" keeps the layers in q4_1 blocks (the default model file's own
        scheme) and the LM head in the model dtype."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.scale = config.head_dim**-0.5

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"model weights lack {name!r}")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        int8 = weight_mode == "int8"

        def blocks(kind: str, weight: torch.Tensor) -> str | None:
            return kind if weight_mode == "q4" and weight.shape[1] % cpu_kernels.QK == 0 else None

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str = "q4_1") -> Linear:
            return Linear(weight, bias, int8=int8, blocks=blocks(kind, weight))

        head = self.embed if tied else w("lm_head.weight")
        if weight_mode == "q4":
            # The LM head keeps the model dtype (the packed bfloat16 kernel where the CPU has it): it reads
            # the last norm's output, whose few large channels int8 blocks round badly.
            self.lm_head = linear(head, kind="bf16" if cpu_kernels.has_bf16_gemm() else None)
        else:
            self.lm_head = linear(head)
        self.norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=linear(torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                           bias),
                o=linear(w(a + "o_proj.weight")),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear(torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")])),
                down=linear(w(m + "down_proj.weight")),
            ))
        # With the CPU backend, residual adds and RMSNorms go to one C kernel per pair and SiLU-mul to
        # another (fewer small ops per layer); the torch backend keeps the all-torch reference path.
        self.fused_norm = (hasattr(backend, "fused_decode") and dtype in cpu_kernels.PAGED_DTYPES
                           and config.hidden_size <= 8192)
        # Decode-only passes run every layer in one C call when each linear layer has a C kernel for them
        # (bfloat16: any pass; q4_1: its block_rows, any with its packed bfloat16 copy).
        self._layer_specs = None
        self._plan_rows = 0.0  # largest decode pass the whole-layer call takes: every layer's kernel takes it
        self._plan_key: tuple[int, int] | None = None
        self._plan: ctypes.Array | None = None
        if self.fused_norm:
            specs = [[_linear_spec(lin) for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)] for ly in self.layers]
            if all(sp is not None for layer_specs in specs for sp in layer_specs):
                self._layer_specs = specs
                self._plan_rows = min(_spec_rows(lin) for ly in self.layers
                                      for lin in (ly.qkv, ly.o, ly.gate_up, ly.down))
        self.rope = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                    config.rope_theta, config.rope_scaling, dtype, device)

    def _decode_plan(self, kv_caches: list[LayerCache]) -> ctypes.Array | None:
        """The LayerSpec array for cpu_kernels.decode_layers, or None when a layer's weights or caches
        are not in a form it takes (int8 weights or caches, float32 weights without q4)."""
        if self._layer_specs is None:
            return None
        key = (id(kv_caches), kv_caches[0].k.data_ptr())
        if self._plan_key != key:
            if not all(c.k.dtype in cpu_kernels.PAGED_DTYPES and c.k.is_contiguous() and c.v.is_contiguous()
                       for c in kv_caches):
                return None
            plan = (cpu_kernels.LayerSpec * len(self.layers))()
            for i, (layer, specs, cache) in enumerate(zip(self.layers, self._layer_specs, kv_caches)):
                plan[i] = cpu_kernels.LayerSpec(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *specs,
                                                cache.k.data_ptr(), cache.v.data_ptr())
            self._plan_key, self._plan = key, plan
        return self._plan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerCache], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns float32 logits [len(logits_indices), vocab]."""
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        eps, inter = c.rms_norm_eps, c.intermediate_size
        x = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        fused = self.fused_norm
        # A decode-only pass on CPU: rotary, K/V write and attention in one C call per layer.
        fused_decode = getattr(self.backend, "fused_decode", None) if fused and not meta.prefills else None
        plan = self._decode_plan(kv_caches) if fused_decode is not None and x.shape[0] <= self._plan_rows else None
        if plan is not None and meta.decode is not None:
            # ... and one every layer's C kernel takes: all layers in one C call, the same kernels in the same order.
            d = meta.decode
            cpu_kernels.decode_layers(plan, x, nh, nkv, hd, inter, eps, self.rope.cos, self.rope.sin, positions,
                                      kv_caches[0].k.dtype, kv_caches[0].k.shape[1], meta.slot_mapping,
                                      d.block_tables, d.seq_lens, self.scale)
            x = _rms_norm(x[logits_indices], self.norm, eps)
            return self.lm_head(x, torch.float32)
        cos, sin = self.rope.tables(positions)
        layers = self.layers
        h = cpu_kernels.add_rms_norm(x, None, layers[0].input_norm, eps) if fused else None
        for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
            if not fused:
                h = _rms_norm(x, layer.input_norm, eps)
            qkv = layer.qkv(h)
            attn = None
            if fused_decode is not None:
                attn = fused_decode(qkv, nh, nkv, self.rope.cos, self.rope.sin, positions, cache, meta, self.scale)
            if attn is None:
                qkv = qkv.view(-1, nh + 2 * nkv, hd)
                # Rotate q and k heads together: one rope op per layer instead of two.
                qk = apply_rotary(qkv[:, : nh + nkv], cos, sin)
                q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
                attn = self.backend.forward(q, k, v, cache, meta, self.scale).reshape(-1, nh * hd)
            o = layer.o(attn)
            if fused:  # x += o in place, then the post-attention norm, in one C call
                h = cpu_kernels.add_rms_norm(x, o, layer.post_norm, eps)
            else:
                x = x + o
                h = _rms_norm(x, layer.post_norm, eps)
            gu = layer.gate_up(h)
            down = layer.down(cpu_kernels.silu_mul(gu) if fused else F.silu(gu[:, :inter]) * gu[:, inter:])
            if fused and i + 1 < len(layers):  # the residual add and the next layer's input norm
                h = cpu_kernels.add_rms_norm(x, down, layers[i + 1].input_norm, eps)
            else:
                x = x + down
        x = _rms_norm(x[logits_indices], self.norm, eps)
        return self.lm_head(x, torch.float32)
