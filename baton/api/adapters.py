"""LoRA adapter folders in the PEFT format, read without torch: the router checks an adapter here before
it lists it, and workers load its tensors (baton/model/lora.py) after the same checks.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors``. It is known by its content id (a
hash of both files), not by its name: the prefix cache chains block hashes from it (baton/api/prefix.py
``adapter_root``), so KV computed under one adapter is never served to another, to the base model, or to
other weights loaded under the same name.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from baton.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 20  # a safetensors header (JSON) larger than this is refused
# PEFT's module names -> (fused projection, part index)
MODULES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the file, field or tensor to fix."""


@dataclass(frozen=True)
class AdapterRef:
    """What a request carries to a worker: the adapter's name, its folder and its content id."""

    name: str
    path: str
    content_id: str


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter folder: everything but the tensor values."""

    ref: AdapterRef
    rank: int
    alpha: float
    scale: float  # alpha / rank (alpha / sqrt(rank) with rsLoRA)
    targets: frozenset[str]  # PEFT module names, e.g. {"q_proj", "v_proj"}
    # safetensors key -> (layer, PEFT module, True for lora_A)
    tensors: dict[str, tuple[int, str, bool]]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Fused projection -> (input width, output width of each part), in the fused weights' order."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]), "down": (inter, [h])}


def content_id(path: str | Path) -> str:
    """The adapter's identity: sha256 over its config and weight files (24 hex digits)."""
    folder = Path(path)
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(folder / name, "rb") as f:
            h.update(name.encode() + b"\0")
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:24]


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraError(f"adapter folder {str(folder)!r} does not exist")
    if not file.is_file():
        raise LoraError(f"{file}: missing; a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoraError(f"{file}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LoraError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{file}: expected a JSON object")
    return cfg


def _check_config(cfg: dict, file: Path, max_rank: int) -> tuple[int, float, frozenset[str], bool]:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"{file}: peft_type {peft_type!r} is not served; only LORA adapters are")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{file}: 'r' must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(f"{file}: rank {r} is above the server's bound of {max_rank} (--max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < 1e6:
        raise LoraError(f"{file}: 'lora_alpha' must be a positive number, got {alpha!r}")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if cfg.get(key):
            raise LoraError(f"{file}: {key} is set; {why} are not served")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoraError(f"{file}: bias {cfg['bias']!r} is not served; train with bias='none'")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise LoraError(f"{file}: {key} is not served (one rank and alpha for every module, no full modules)")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(MODULES)
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise LoraError(f"{file}: target_modules must be a list of module names (or 'all-linear'), got {targets!r}")
    unknown = sorted(str(t) for t in targets if t not in MODULES)
    if unknown:
        raise LoraError(f"{file}: target modules {', '.join(unknown)} are not projections of this model; "
                        f"LoRA is served on {', '.join(MODULES)}")
    return r, float(alpha), frozenset(targets), bool(cfg.get("use_rslora"))


def _safetensors_header(file: Path) -> dict:
    """name -> {"dtype", "shape", ...} from a safetensors file's JSON header, without reading its tensors."""
    if not file.is_file():
        raise LoraError(f"{file}: missing (only safetensors weights are read)")
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if n is None or not 2 <= n <= MAX_HEADER_BYTES:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise LoraError(f"{file}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


def check_folder(path: str | Path, max_rank: int) -> None:
    """The checks that need no model: the folder, its config and its weight file's header (LoraError)."""
    folder = Path(path)
    _check_config(_read_config(folder), folder / CONFIG_FILE, max_rank)
    _safetensors_header(folder / WEIGHTS_FILE)


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> AdapterSpec:
    """Check a PEFT LoRA folder against the model's shapes (no tensor is read); LoraError names what to fix."""
    folder = Path(path)
    cfile = folder / CONFIG_FILE
    rank, alpha, targets, rslora = _check_config(_read_config(folder), cfile, max_rank)
    wfile = folder / WEIGHTS_FILE
    header = _safetensors_header(wfile)
    shapes = projection_shapes(config)
    tensors: dict[str, tuple[int, str, bool]] = {}
    pairs: dict[tuple[int, str], set[bool]] = {}
    for key, info in header.items():
        parts = key.split(".")
        if "lora_A" not in parts and "lora_B" not in parts:
            if "lora_embedding_A" in parts or "lora_magnitude_vector" in parts:
                raise LoraError(f"{wfile}: tensor {key!r} is not served (embedding LoRA or DoRA)")
            continue
        try:
            layer = int(parts[parts.index("layers") + 1])
            module = next(p for p in parts if p in MODULES)
        except (ValueError, IndexError, StopIteration):
            raise LoraError(f"{wfile}: tensor {key!r} names no layer projection of this model") from None
        if not 0 <= layer < config.num_layers:
            raise LoraError(f"{wfile}: tensor {key!r} is for layer {layer}; the model has {config.num_layers}")
        if module not in targets:
            raise LoraError(f"{wfile}: holds {module} weights that target_modules in {CONFIG_FILE} does not list")
        kind, part = MODULES[module]
        in_dim, outs = shapes[kind]
        is_a = "lora_A" in parts
        want = (rank, in_dim) if is_a else (outs[part], rank)
        shape = tuple(info.get("shape", ())) if isinstance(info, dict) else ()
        if shape != want:
            raise LoraError(f"{wfile}: tensor {key!r} has shape {shape}, expected {want} "
                            f"(rank {rank}, the model's {module})")
        tensors[key] = (layer, module, is_a)
        pairs.setdefault((layer, module), set()).add(is_a)
    if not tensors:
        raise LoraError(f"{wfile}: holds no lora_A / lora_B tensors")
    for (layer, module), kinds in pairs.items():
        if len(kinds) != 2:
            raise LoraError(f"{wfile}: layer {layer} {module} has lora_{'A' if True not in kinds else 'B'} missing")
    scale = alpha / (rank ** 0.5 if rslora else rank)
    return AdapterSpec(AdapterRef(name, str(folder), content_id(folder)), rank, alpha, scale, targets, tensors)
