"""What every loader format shares: `LoadedModel`, `ModelLoadError` and the weight-shape checks.

A leaf of the package: gguf.py and hf.py import it, and baton/loader/__init__.py re-exports it, so the
imports within baton.loader run one way (__init__ -> gguf/hf -> base -> baton.config, baton.tokenizer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from baton.config import ModelConfig
from baton.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "check_weight_shapes", "check_weights", "expected_weight_shapes"]


class ModelLoadError(ValueError):
    """A model file or folder that cannot be loaded; the message names the path and the problem."""


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model with `config` has, by Hugging Face Llama name, with its shape."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.sandwich_norms:  # Gemma: post_attention_layernorm normalizes the attention output
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if config.fused_projections:
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        if config.fused_projections:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def check_weight_shapes(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], path: str) -> None:
    """Raise ModelLoadError unless `shapes` has exactly the expected weight names, with the expected shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ModelLoadError(f"{path}: missing {len(missing)} weight(s), e.g. {', '.join(missing[:3])}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{path}: unexpected weight(s) {', '.join(unexpected[:3])} for a {config.architecture} model "
            f"with {config.num_layers} layers"
        )
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(
                f"{path}: weight {name} has shape {tuple(shapes[name])}, the config implies {shape}"
            )


def check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], path: str) -> None:
    """Raise ModelLoadError unless `weights` holds exactly the expected names with the expected shapes."""
    check_weight_shapes(config, {name: tuple(w.shape) for name, w in weights.items()}, path)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready to run: its config, its weights (HF Llama names; empty when loaded without them, or once
    an engine has prepared them), its tokenizer, where it came from."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: str

    def __post_init__(self) -> None:
        if self.weights:
            check_weights(self.config, self.weights, self.path)
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ModelLoadError(
                f"{self.path}: the tokenizer has {self.tokenizer.vocab_size} tokens but the model's embedding "
                f"only {self.config.vocab_size} rows"
            )
