"""Choosing the device and the default dtype."""

from __future__ import annotations

import functools

import torch

from baton.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {name!r}: {e}") from None


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX); elsewhere bf16 matmuls
    are emulated and several times slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("float16 is for CUDA; on CPU use float32 or bfloat16")
    return dtype
