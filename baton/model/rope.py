"""Rotary position embeddings (rotate-half layout) with the rope scalings Llama-family configs use."""

from __future__ import annotations

import math
from typing import Any

import torch

from baton.config import ConfigError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as the config asks."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    raise ConfigError(f"unsupported rope scaling type {kind!r}; Baton supports default, linear and llama3")


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)  # [max_positions, head_dim]
        # The first half carries the minus sign of rotate-half, so applying the rotation needs no negation.
        sin = emb.sin()
        self.sin = torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2:]], dim=-1).to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for these positions: [num_tokens, 1, head_dim], ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> rotated copy (rotate-half convention).

    rotate_half(x) * sin == roll(x, half) * signed_sin, where signed_sin is sin with its first half
    negated (as the tables store it): three ops instead of six."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)
