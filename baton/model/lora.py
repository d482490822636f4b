"""LoRA adapters in the model: their tensors, the slots a model keeps them in, and the batched delta.

The folder format (PEFT), its checks and an adapter's identity (its content id) are in baton/api/adapters.py,
which the router reads without torch; ``load_adapter`` here reads the tensors after the same checks.

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

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton.api.adapters import (
    MODULES,
    PROJECTIONS,
    WEIGHTS_FILE,
    AdapterRef,
    AdapterSpec,
    LoraError,
    projection_shapes,
    read_adapter,
)
from baton.config import ModelConfig
from baton.kernels import cpu as cpu_kernels
from baton.model.linear import Linear

__all__ = ["AdapterCache", "AdapterRef", "LoraAdapter", "LoraBatch", "LoraError", "LoraSlots", "SlotTable",
           "load_adapter", "lora_delta_reference"]

@dataclass(eq=False)
class LoraAdapter:
    """An adapter's tensors: (layer, PEFT module) -> (A [r, in], B scaled [r, out]), float32."""

    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def ref(self) -> AdapterRef:
        return self.spec.ref

    @property
    def content_id(self) -> str:
        return self.spec.ref.content_id

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Check a PEFT LoRA folder (baton/api/adapters.py read_adapter) and read its tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    spec = read_adapter(name, path, config, max_rank)
    wfile = Path(path) / WEIGHTS_FILE
    try:
        tensors = load_file(str(wfile))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{wfile}: not a readable safetensors file ({e})") from None
    parts: dict[tuple[int, str], dict[bool, torch.Tensor]] = {}
    for key, (layer, module, is_a) in spec.tensors.items():
        if key not in tensors:
            raise LoraError(f"{wfile}: changed while it was read; load it again")
        t = tensors[key].float()
        parts.setdefault((layer, module), {})[is_a] = t if is_a else t.t().mul(spec.scale).contiguous()
    return LoraAdapter(spec, {k: (v[True], v[False]) for k, v in parts.items()})


def write_random_adapter(folder: str | Path, config: ModelConfig, rank: int, targets: list[str], seed: int = 0,
                         b_scale: float = 0.01) -> Path:
    """A PEFT LoRA folder of random weights for ``config``'s projections (benchmarks and tests): A scaled to
    keep activations' size, B times ``b_scale`` (small: answers stay text, yet differ from the base model's)."""
    import json

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            kind, part = MODULES[module]
            in_dim, outs = shapes[kind]
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if kind in ('qkv', 'o') else 'mlp'}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=g) / in_dim ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(outs[part], rank, generator=g) * b_scale
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}))
    return folder


class LoraBatch:
    """One pass's rows -> slots, built once per pass by the model runner. rows: [num_tokens] int64, -1 for
    rows of the base model."""

    def __init__(self, rows: torch.Tensor, num_slots: int, dtype: torch.dtype) -> None:
        self.rows = rows
        used = sorted(set(rows.tolist()) - {-1})
        self.slots = frozenset(used)
        self.single = used[0] if len(used) == 1 else None
        # [num_tokens, slots, 1]: 1 where a row uses a slot
        self.onehot = torch.nn.functional.one_hot(rows + 1, num_slots + 1)[:, 1:, None].to(dtype)
        # one slot: [num_tokens, 1], 1 for its rows, 0 for base rows (None: every row is the slot's)
        self.mask = None
        if self.single is not None and not bool((rows >= 0).all()):
            self.mask = (rows >= 0).to(dtype)[:, None]


class LoraSlots:
    """The model's adapter slots (see the module docstring for the layout). Written on the engine thread."""

    def __init__(self, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, triton: bool | None = None) -> None:
        """triton: run the delta with the Triton kernel (default: on CUDA)."""
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
        # (projection, part) -> slots whose adapter targets that part (q, k or v of qkv; gate or up of gate_up)
        self.part_targeting: dict[tuple[str, int], set[int]] = {
            (k, p): set() for k, (_, outs) in self.shapes.items() for p in range(len(outs))}
        self.use_triton = device.type == "cuda" if triton is None else triton
        # bfloat16 on AVX512-BF16 CPUs: the products by the packed bfloat16 C matmul (the base layers' kernel),
        # over every slot at once: one shrink per projection and one expand per part of it (q, k, v: B's zero
        # blocks between parts are never read); in decode-only passes inside the whole-layer C call
        # (LlamaModel). Rebuilt from a and b when a slot changes (repack); ``version`` counts the rebuilds.
        self.packed = (not self.use_triton and device.type == "cpu" and dtype == torch.bfloat16
                       and cpu_kernels.has_bf16_gemm() and max_rank % 2 == 0
                       and all(i % 2 == 0 for i, _ in self.shapes.values()))
        self.shrink: list[dict[str, Linear]] = []
        self.expand: list[dict[str, list[tuple[int, Linear]]]] = []  # per part: (first output column, its B^T)
        self.version = 0
        if self.packed:
            self.repack()

    def repack(self) -> None:
        """The packed layouts from a and b (after install, or after writing a and b directly)."""
        if not self.packed:
            return
        r, n = self.max_rank, self.num_slots
        self.shrink = [{k: Linear(a[k]) for k in PROJECTIONS} for a in self.a]
        self.expand = []
        for b in self.b:
            layer = {}
            for k in PROJECTIONS:
                w, col, parts = self.width[k], 0, []
                for p, out in enumerate(self.shapes[k][1]):  # part p of every slot: [slots * rank, out]
                    rows = torch.cat([b[k][s * w + p * r:s * w + (p + 1) * r, col:col + out] for s in range(n)])
                    parts.append((col, Linear(rows.t().contiguous())))
                    col += out
                layer[k] = parts
            self.expand.append(layer)
        self.version += 1

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (*self.a, *self.b) for t in d.values())

    def install(self, slot: int, adapter: LoraAdapter) -> None:
        for k in PROJECTIONS:
            self.targeting[k].discard(slot)
        for slots in self.part_targeting.values():
            slots.discard(slot)
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
            self.part_targeting[(k, part)].add(slot)
        self.repack()

    def add(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> None:
        """y [num_tokens, out] += the LoRA delta of x [num_tokens, in] for each row's slot, in place."""
        if not self.targeting[kind] & batch.slots:
            return
        a, b, w = self.a[layer][kind], self.b[layer][kind], self.width[kind]
        if self.use_triton:
            from baton.kernels.triton_lora import lora_delta_triton
            lora_delta_triton(x, a, b, batch.rows, w, y)
            return
        n = x.shape[0]
        if self.packed:
            z = self.shrink[layer][kind](x.to(torch.bfloat16)).view(n, self.num_slots, w) * batch.onehot
            z = z.view(n, self.num_slots, -1, self.max_rank)
            for p, (col, lin) in enumerate(self.expand[layer][kind]):
                if self.part_targeting[(kind, p)] & batch.slots:
                    y[:, col:col + lin.out_features] += lin(z[:, :, p].reshape(n, -1)).to(y.dtype)
            return
        if batch.single is not None:
            s = batch.single
            z = x @ a[s * w:(s + 1) * w].t()  # [num_tokens, width]
            if batch.mask is not None:
                z *= batch.mask
            y += (z @ b[s * w:(s + 1) * w]).to(y.dtype)
            return
        z = (x @ a.t()).view(n, self.num_slots, w) * batch.onehot
        y += (z.view(n, -1) @ b).to(y.dtype)


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
        self.on_load: Callable[[float], None] | None = None  # seconds one load took (a worker's metrics)
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
            seconds = time.perf_counter() - start
            if self.on_load is not None:
                self.on_load(seconds)
            with self._lock:
                self.loads += 1
                self.load_seconds += seconds
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
        self.on_evict: Callable[[], None] | None = None

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
                if self.on_evict is not None:
                    self.on_evict()
            self.slots.install(slot, adapter)
            self._held[slot], self._of[adapter.content_id] = adapter.content_id, slot
        self._pins[slot] += 1
        self._lru.pop(slot, None)
        return slot

    def holds(self, content_id: str) -> bool:
        return content_id in self._of

    def release(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._lru[slot] = None  # most recently used: reused last

    def holding(self) -> list[str]:
        return [c for c in self._held if c is not None]
