"""LoRA adapters: reading PEFT folders, the slots a model keeps them in, and the batched delta.

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``). It is known by its
*content id* (a hash of both files), not by its name: the prefix cache chains its block hashes from the
content id (baton/api/prefix.py ``adapter_root``), so KV computed under one adapter is never served to
another, to the base model, or to different weights reloaded under the same name.

The model keeps ``max_loras`` adapters in *slots*: per layer and per fused projection (qkv, o, gate_up,
down), one stacked A [slots * width, in] and one stacked B [slots * width, out], where width is the
projection's parts (3 for qkv, 2 for gate_up, else 1) times ``max_rank``. Part p of slot s fills rows
``s * width + p * max_rank`` onwards of A, and the same rows of B in its part's output columns, with the
adapter's scale (alpha / r) folded into B; unused rows stay zero. A pass adds, for every token row,

    y += ((x @ A.T) masked to the row's slot) @ B

two matrix products over the whole pass, whatever mix of adapters and base rows it holds (no loop over
adapters). A pass whose adapter rows all use one slot multiplies by that slot's rows only. CUDA runs the
same sum in one Triton kernel (``lora_delta_triton`` in kernels/triton_lora.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# PEFT's module names -> (fused projection, part index)
MODULES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the file, field or tensor to fix."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Fused projection -> (input width, output width of each part), in the fused weights' order."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]), "down": (inter, [h])}


@dataclass(frozen=True)
class AdapterRef:
    """What a request carries to a worker: the adapter's name, its folder and its content id."""

    name: str
    path: str
    content_id: str


@dataclass(eq=False)
class LoraAdapter:
    name: str
    path: str
    content_id: str
    rank: int
    alpha: float
    targets: frozenset[str]  # PEFT module names, e.g. {"q_proj", "v_proj"}
    # (layer, PEFT module) -> (A [r, in], B scaled [r, out]) float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, self.path, self.content_id)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


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


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA folder against the model's shapes; LoraError names what to fix."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    cfg = _read_config(folder)
    cfile = folder / CONFIG_FILE
    rank, alpha, targets, rslora = _check_config(cfg, cfile, max_rank)
    wfile = folder / WEIGHTS_FILE
    if not wfile.is_file():
        raise LoraError(f"{wfile}: missing (only safetensors weights are read)")
    cid = content_id(folder)
    try:
        tensors = load_file(str(wfile))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{wfile}: not a readable safetensors file ({e})") from None
    scale = alpha / (rank ** 0.5 if rslora else rank)
    shapes = projection_shapes(config)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, tensor in tensors.items():
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
        kind, part = MODULES[module]
        in_dim, outs = shapes[kind]
        is_a = "lora_A" in parts
        want = (rank, in_dim) if is_a else (outs[part], rank)
        if tuple(tensor.shape) != want:
            raise LoraError(f"{wfile}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {want} "
                            f"(rank {rank}, the model's {module})")
        a, b = weights.get((layer, module), (None, None))
        t = tensor.float()
        weights[(layer, module)] = (t, b) if is_a else (a, t.t().mul(scale).contiguous())
    if not weights:
        raise LoraError(f"{wfile}: holds no lora_A / lora_B tensors")
    for (layer, module), (a, b) in weights.items():
        if a is None or b is None:
            raise LoraError(f"{wfile}: layer {layer} {module} has lora_{'A' if a is None else 'B'} missing")
        if module not in targets:
            raise LoraError(f"{wfile}: holds {module} weights that target_modules in {CONFIG_FILE} does not list")
    return LoraAdapter(name, str(folder), cid, rank, alpha, targets, weights)


class LoraBatch:
    """One pass's rows -> slots, built once per pass by the model runner. rows: [num_tokens] int64, -1 for
    rows of the base model."""

    def __init__(self, rows: torch.Tensor, num_slots: int, dtype: torch.dtype) -> None:
        self.rows = rows
        used = sorted(set(rows.tolist()) - {-1})
        self.slots = frozenset(used)
        self.single = used[0] if len(used) == 1 else None
        if self.single is not None:
            # [num_tokens, 1]: 1 for the slot's rows, 0 for base rows (None: every row is the slot's)
            self.mask = None if bool((rows >= 0).all()) else (rows >= 0).to(dtype)[:, None]
        else:
            self.mask = torch.nn.functional.one_hot(rows.clamp(min=-1) + 1, num_slots + 1)[:, 1:].to(dtype)


class LoraSlots:
    """The model's adapter slots (see the module docstring for the layout). Written on the engine thread."""

    def __init__(self, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.shapes = projection_shapes(config)
        self.width = {k: len(outs) * max_rank for k, (_, outs) in self.shapes.items()}
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(config.num_layers):
            self.a.append({k: torch.zeros(num_slots * self.width[k], i, dtype=dtype, device=device)
                           for k, (i, _) in self.shapes.items()})
            self.b.append({k: torch.zeros(num_slots * self.width[k], sum(o), dtype=dtype, device=device)
                           for k, (_, o) in self.shapes.items()})
        # projection -> slots whose adapter targets it (others add nothing: skipped)
        self.targeting: dict[str, set[int]] = {k: set() for k in PROJECTIONS}
        self.use_triton = device.type == "cuda"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (*self.a, *self.b) for t in d.values())

    def install(self, slot: int, adapter: LoraAdapter) -> None:
        for k in PROJECTIONS:
            self.targeting[k].discard(slot)
        for layer_a, layer_b in zip(self.a, self.b):
            for k in PROJECTIONS:
                w = self.width[k]
                layer_a[k][slot * w:(slot + 1) * w].zero_()
                layer_b[k][slot * w:(slot + 1) * w].zero_()
        r = adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            k, part = MODULES[module]
            row = slot * self.width[k] + part * self.max_rank
            col = sum(self.shapes[k][1][:part])
            self.a[layer][k][row:row + r] = a.to(self.dtype)
            self.b[layer][k][row:row + r, col:col + b.shape[1]] = b.to(self.dtype)
            self.targeting[k].add(slot)

    def add(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> None:
        """y [num_tokens, out] += the LoRA delta of x [num_tokens, in] for each row's slot, in place."""
        if not self.targeting[kind] & batch.slots:
            return
        a, b, w = self.a[layer][kind], self.b[layer][kind], self.width[kind]
        if self.use_triton:
            from baton.kernels.triton_lora import lora_delta_triton
            lora_delta_triton(x, a, b, batch.rows, w, y)
            return
        if batch.single is not None:
            s = batch.single
            z = x @ a[s * w:(s + 1) * w].t()  # [num_tokens, width]
            if batch.mask is not None:
                z *= batch.mask
            y += (z @ b[s * w:(s + 1) * w]).to(y.dtype)
            return
        z = (x @ a.t()).view(x.shape[0], self.num_slots, w) * batch.mask[:, :, None]
        y += (z.view(x.shape[0], -1) @ b).to(y.dtype)


def lora_delta_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                         width: int) -> torch.Tensor:
    """The delta one row at a time, in float32 (the kernels' reference): [num_tokens, out]."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for t, s in enumerate(rows.tolist()):
        if s >= 0:
            z = a[s * width:(s + 1) * width].float() @ x[t].float()
            out[t] = z @ b[s * width:(s + 1) * width].float()
    return out


class AdapterCache:
    """The adapters a worker holds: at most ``capacity``, least recently used dropped first; each loaded
    from its folder on first use (any thread) and checked against the content id the request names."""

    def __init__(self, config: ModelConfig, capacity: int, max_rank: int) -> None:
        self.config, self.capacity, self.max_rank = config, capacity, max_rank
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self.loads = 0
        self.load_seconds = 0.0
        self.evictions = 0

    def get(self, ref: AdapterRef) -> LoraAdapter:
        with self._lock:
            held = self._held.get(ref.content_id)
            if held is not None:
                self._held.move_to_end(ref.content_id)
                return held
            gate = self._loading.setdefault(ref.content_id, threading.Lock())
        with gate:  # one load per adapter at a time; others wait for it
            with self._lock:
                held = self._held.get(ref.content_id)
            if held is not None:
                return held
            start = time.perf_counter()
            try:
                adapter = load_adapter(ref.name, ref.path, self.config, self.max_rank)
            finally:
                with self._lock:
                    self._loading.pop(ref.content_id, None)
            if adapter.content_id != ref.content_id:
                raise LoraError(f"adapter {ref.name!r} changed on disk since it was loaded (content "
                                f"{adapter.content_id}, expected {ref.content_id}); load it again")
            with self._lock:
                self.loads += 1
                self.load_seconds += time.perf_counter() - start
                self._held[adapter.content_id] = adapter
                while len(self._held) > self.capacity:
                    self._held.popitem(last=False)
            return adapter

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)


class SlotTable:
    """Which adapter each model slot holds, and how many live sequences use it (engine thread only). A
    sequence pins its slot from admission to its end; an unpinned slot is reused least recently used first."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self._of: dict[str, int] = {}  # content id -> slot
        self._held: list[str | None] = [None] * slots.num_slots
        self._pins = [0] * slots.num_slots
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(slots.num_slots))  # unpinned slots
        self.evictions = 0

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """A slot holding ``adapter``, pinned; None when every slot is pinned by other adapters."""
        slot = self._of.get(adapter.content_id)
        if slot is None:
            if not self._lru:
                return None
            slot = next(iter(self._lru))
            old = self._held[slot]
            if old is not None:
                del self._of[old]
                self.evictions += 1
            self.slots.install(slot, adapter)
            self._held[slot], self._of[adapter.content_id] = adapter.content_id, slot
        self._pins[slot] += 1
        self._lru.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._lru[slot] = None  # most recently used: reused last

    def holding(self) -> list[str]:
        return [c for c in self._held if c is not None]
