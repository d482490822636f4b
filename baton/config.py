"""Model and engine configuration: frozen dataclasses that check themselves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


class ConfigError(ValueError):
    """A model or engine setting that Baton cannot serve; the message says which and why."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style: {"rope_type": "llama3", "factor": 8.0, ...} or {"rope_type": "linear", "factor": 2.0}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported model architecture {self.architecture!r}; "
                f"Baton serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported model architecture {model_type or archs!r}; "
                f"Baton serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moved rope settings into rope_parameters.
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            name=name,
        )
