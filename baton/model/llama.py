"""Llama-family decoder over a paged KV cache (Llama 2/3, SmolLM, Mistral, Qwen2).

One forward pass serves both phases: the batch is a flat list of tokens from many sequences
(decode tokens first, then prefill chunks), described by :class:`AttentionMetadata`.
Weights are plain tensors, not nn.Modules: a decode step is dominated by per-op overhead on CPU,
so each layer is a short, fixed list of fused ops (one QKV matmul, one gate-up matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.config import ModelConfig
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


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend, max_positions: int | None = None,
                 int8_weights: bool = False) -> None:
        """int8_weights: every linear layer (and the LM head) keeps int8 weights with per-channel scales."""
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
        self.lm_head = Linear(self.embed if tied else w("lm_head.weight"), int8=int8_weights)
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
                qkv=Linear(torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                           bias, int8=int8_weights),
                o=Linear(w(a + "o_proj.weight"), int8=int8_weights),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=Linear(torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")]), int8=int8_weights),
                down=Linear(w(m + "down_proj.weight"), int8=int8_weights),
            ))
        self.rope = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                    config.rope_theta, config.rope_scaling, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerCache], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns float32 logits [len(logits_indices), vocab]."""
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        eps, inter = c.rms_norm_eps, c.intermediate_size
        cos, sin = self.rope.tables(positions)
        x = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        for layer, cache in zip(self.layers, kv_caches):
            h = _rms_norm(x, layer.input_norm, eps)
            qkv = layer.qkv(h).view(-1, nh + 2 * nkv, hd)
            # Rotate q and k heads together: one rope op per layer instead of two.
            qk = apply_rotary(qkv[:, : nh + nkv], cos, sin)
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
            attn = self.backend.forward(q, k, v, cache, meta, self.scale)
            x = x + layer.o(attn.reshape(-1, nh * hd))
            h = _rms_norm(x, layer.post_norm, eps)
            gu = layer.gate_up(h)
            x = x + layer.down(F.silu(gu[:, :inter]) * gu[:, inter:])
        x = _rms_norm(x[logits_indices], self.norm, eps)
        return self.lm_head(x).float()
