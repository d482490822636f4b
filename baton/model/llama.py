"""Llama-family decoder over a paged KV cache (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3).

One forward pass serves both phases: the batch is a flat list of tokens from many sequences
(decode tokens first, then prefill chunks), described by :class:`AttentionMetadata`.
Weights are plain tensors, not nn.Modules: a decode step is dominated by per-op overhead on CPU,
so each layer is a short, fixed list of fused ops (one QKV matmul, one gate-up matmul).

One layer loop (:meth:`LlamaModel.forward`) serves every backend; the few ops with a C kernel on CPU
(residual add + RMSNorm, SiLU-mul, rotary + K/V write + attention) go through small helpers that pick
the C call or the torch ops from flags set once, at construction, from the backend's declared
capabilities. Beside it, decode-only passes on CPU may run every layer in one C call
(``cpu_kernels.decode_layers``, the same kernels in the same order) when ``whole_layer_decode`` is on.

Adding a layer feature (q/k-norm, a LoRA delta on a projection, ...): its weights go into
:class:`LayerWeights`, its op into the loop or the helper it belongs to, and its name into
:meth:`LlamaModel.layer_features`. The C paths that do not implement it switch themselves off for
the model (see WHOLE_LAYER_FEATURES and FUSED_ATTENTION_FEATURES), so the loop's torch ops run it.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.api.adapters import PROJECTIONS
from baton.config import ModelConfig
from baton.kernels import cpu as cpu_kernels
from baton.model.attention import AttentionBackend, AttentionMetadata, LayerCache
from baton.model.linear import Linear, keeps_file_blocks
from baton.model.lora import LoraBatch, LoraSlots
from baton.model.rope import RotaryEmbedding, apply_rotary


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q_size + 2 * kv_size
    o: Linear  # q_size -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    q_norm: torch.Tensor | None = None  # [head_dim], with ModelConfig.qk_norm
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden], with ModelConfig.sandwich_norms: on o_proj's output
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: on down_proj's output


@dataclass
class ModelWeights:
    """Every tensor a LlamaModel reads, in the layout its kernels take: what ``prepare`` makes from the weights
    by Hugging Face name, and what a weight image (baton/model/image.py) stores and maps back."""

    embed: torch.Tensor | Linear  # [vocab, hidden], the model dtype; or the tiles of a file's blocks (rows looked up)
    lm_head: Linear  # hidden -> vocab
    norm: torch.Tensor  # [hidden]
    layers: list[LayerWeights]

    @classmethod
    def prepare(cls, config: ModelConfig, weights: dict[str, torch.Tensor | cpu_kernels.GqBlocks], dtype: torch.dtype,
                device: torch.device, weight_mode: str = "auto") -> ModelWeights:
        """weight_mode (see baton.model.linear.WEIGHT_MODES): "auto" keeps the matrices the loader kept in a file's
        block types (kernels/cpu.py GqBlocks; on CPU) in them, the rest in the model dtype; "dtype" dequantizes
        everything; "int8" keeps every linear layer and the LM head in int8 with per-channel scales; "q4" keeps the
        layers in q4_1 blocks (the default model file's own scheme) and the LM head in the model dtype. Fused QKV
        and gate-up weights. Norm weights that are offsets (Gemma: x * (1 + w)) are stored as 1 + w, added in
        float32, so that every norm is the same op."""

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"model weights lack {name!r}")
            value = weights[name]
            if isinstance(value, cpu_kernels.GqBlocks):
                value = value.values()
            return value.to(device=device, dtype=dtype).contiguous()

        # auto: matrices a GGUF file keeps in block types the CPU kernels take stay in them (the loader kept them)
        kept = keeps_file_blocks(weight_mode, device)

        def stored(names: list[str], bias: torch.Tensor | None = None) -> Linear | None:
            """The parts in their own block types as one layer, or None where they cannot be (some part is not
            kept, or a part of one type ends mid-tile before a part of another)."""
            parts = [weights.get(n) for n in names]
            if not kept or not all(isinstance(p, cpu_kernels.GqBlocks) for p in parts):
                return None
            perms = [p.perm for p in parts]
            if any((a is None) != (perms[0] is None) or (a is not None and not torch.equal(a, perms[0]))
                   for a in perms):
                return None  # GPTQ act-order parts in different input orders
            parts = cpu_kernels.gq_stack(parts)
            if any(p.q.shape[0] % cpu_kernels.Q4_TILE_ROWS for p in parts[:-1]):
                return None
            return Linear.from_gq(cpu_kernels.gq_weight(parts), None if bias is None else bias.float(), perms[0])

        def norm(name: str) -> torch.Tensor:
            if not config.norm_offset:
                return w(name)
            return (weights[name].to(device=device, dtype=torch.float32) + 1.0).to(dtype).contiguous()

        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        embed_rows = stored(["model.embed_tokens.weight"])  # lookups read the tiles' rows
        embed = embed_rows if embed_rows is not None else w("model.embed_tokens.weight")
        int8 = weight_mode == "int8"

        def blocks(kind: str, weight: torch.Tensor) -> str | None:
            return kind if weight_mode == "q4" and weight.shape[1] % cpu_kernels.QK == 0 else None

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str = "q4_1") -> Linear:
            return Linear(weight, bias, int8=int8, blocks=blocks(kind, weight))

        # A head the file keeps in a block type stays in it (tied: the embedding's own tiles, one copy): its
        # blocks read fewer bytes than the model dtype's, and the head is a large share of a small model's.
        head_stored = embed_rows if tied else stored(["lm_head.weight"])
        if head_stored is not None:
            lm_head = head_stored
        elif weight_mode == "q4":
            head = embed if tied else w("lm_head.weight")
            # The LM head keeps the model dtype (the packed bfloat16 kernel where the CPU has it): it reads
            # the last norm's output, whose few large channels int8 blocks round badly.
            lm_head = linear(head, kind="bf16" if cpu_kernels.has_bf16_gemm() else None)
        else:
            lm_head = linear(embed if tied else w("lm_head.weight"))
        layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            if config.fused_projections:  # the file's own fused layout is the one the kernels take
                qkv_names, gate_up_names = [a + "qkv_proj.weight"], [m + "gate_up_proj.weight"]
            else:
                qkv_names = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
                gate_up_names = [m + "gate_proj.weight", m + "up_proj.weight"]

            def layer(names: list[str], bias: torch.Tensor | None = None) -> Linear:
                return stored(names, bias) or linear(torch.cat([w(n) for n in names]), bias)

            sandwich = config.sandwich_norms  # Gemma's names: its pre-MLP norm is pre_feedforward_layernorm
            layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=layer(qkv_names, bias),
                o=layer([a + "o_proj.weight"]),
                post_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich
                                    else "post_attention_layernorm.weight")),
                gate_up=layer(gate_up_names),
                down=layer([m + "down_proj.weight"]),
                q_norm=norm(a + "q_norm.weight") if config.qk_norm else None,
                k_norm=norm(a + "k_norm.weight") if config.qk_norm else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
            ))
        return cls(embed, lm_head, norm("model.norm.weight"), layers)

    def layer_linears(self) -> list[Linear]:
        """Every layer's matrices, layer by layer: qkv, o, gate_up, down."""
        return [lin for ly in self.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)]

    def holds_file_blocks(self) -> bool:
        """Whether any linear layer keeps a quantized file's own block types (kernels/cpu.py GqWeight)."""
        return any(lin.block_kind == "gq" for lin in self.layer_linears())

    def describe(self) -> str:
        """How the weights are held, for the start-up log: each linear layer's (and the LM head's) storage."""
        def kind(lin: Linear) -> str:
            if lin.block_kind == "gq":
                return "+".join(lin.gq.kinds)
            return lin.block_kind or ("int8" if lin.int8 else str(lin.weight.dtype).removeprefix("torch."))

        counts: dict[str, int] = {}
        for lin in self.layer_linears():
            counts[kind(lin)] = counts.get(kind(lin), 0) + 1
        layers = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
        embed = "its tiles" if isinstance(self.embed, Linear) else str(self.embed.dtype).removeprefix("torch.")
        return f"layer matrices {layers}; LM head {kind(self.lm_head)}; embedding {embed}"

    def same_bits_rows(self) -> float:
        """Largest pass in which a row's result is the same as in a one-row pass: a linear layer whose C kernel
        takes only small passes (block_rows) computes larger ones another way, with other roundings."""
        linears = [self.lm_head, *self.layer_linears()]
        return min((lin.block_rows for lin in linears if lin.blocks is not None), default=math.inf)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, each once (the tied LM head may be the embedding itself)."""
        seen: dict[int, torch.Tensor] = {}
        linears = [self.lm_head, *self.layer_linears()]
        norms = [n for ly in self.layers for n in (ly.input_norm, ly.post_norm, ly.q_norm, ly.k_norm, ly.attn_out_norm,
                                                   ly.mlp_out_norm) if n is not None]
        embed = self.embed.tensors() if isinstance(self.embed, Linear) else [self.embed]
        for t in [*embed, self.norm, *norms,
                  *(t for lin in linears for t in lin.tensors())]:
            seen.setdefault(id(t), t)
        return list(seen.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


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
    if lin.block_kind == "gq":  # (an input order to gather first has no place in the whole-layer call)
        return cpu_kernels.gq_linear_spec(lin.gq, lin.block_bias) if lin.in_perm is None else None
    if lin.block_kind == "q4_1":
        return cpu_kernels.q4_1_linear_spec(*lin.blocks, lin.out_features, lin.block_bias, lin.block_rows,
                                            lin.dense, lin.dense_bias)
    return None


def _spec_rows(lin: Linear) -> float:
    """Largest pass the whole-layer call can give this layer (bfloat16 blocks take any: BLOCK_ROWS)."""
    return math.inf if lin.dense is not None else lin.block_rows


# Layer features (beyond plain Llama: see LlamaModel.layer_features) that each C path implements. A model
# with a feature a path does not list runs without that path: its layers go through forward's loop, whose
# torch ops apply the feature. So a new feature is safe by default; list it here only once the C path does it.
# decode_layers (the whole-layer C call; LayerSpec / LinearSpec in kernels/cpu.py): the q/k/v bias is in
# LinearSpec.bias.
WHOLE_LAYER_FEATURES = frozenset({"attention_bias"})
# backend.fused_decode (rotary + K/V write + attention in one call): it starts from the QKV projection's
# output, bias included; a feature between the projection and attention (q/k-norm) is not in it.
FUSED_ATTENTION_FEATURES = frozenset({"attention_bias"})


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor] | ModelWeights, dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend, max_positions: int | None = None,
                 weight_mode: str = "auto", whole_layer_decode: bool = True) -> None:
        """weights: by Hugging Face name (prepared here, see ModelWeights.prepare for weight_mode), or already
        prepared (a weight image mapped from a file, baton/model/image.py). whole_layer_decode False keeps
        decode-only passes in the per-layer loop (for comparisons: both give the same logits)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.weights = mw = (weights if isinstance(weights, ModelWeights)
                             else ModelWeights.prepare(config, weights, dtype, device, weight_mode))
        self.embed, self.lm_head, self.norm, self.layers = mw.embed, mw.lm_head, mw.norm, mw.layers
        # Which path each op takes, decided here once from the backend's declared capabilities (see
        # BackendCapabilities), the activations and the layer features; forward's helpers read these flags.
        caps = backend.capabilities
        features = self.layer_features()
        # Residual add + RMSNorm in one C call per pair, SiLU-mul in another (fewer small ops per layer);
        # off: torch ops (the torch backend keeps the all-torch reference path).
        self.cpu_layer_ops = caps.cpu_layer_ops and dtype in cpu_kernels.PAGED_DTYPES and config.hidden_size <= 8192
        # Decode-only passes: rotary, K/V write and attention in one backend call per layer (only beside the
        # C layer ops: a model runs the C path or the all-torch one).
        self.fused_attention = caps.fused_decode and self.cpu_layer_ops and features <= FUSED_ATTENTION_FEATURES
        # Decode-only passes run every layer in one C call (cpu_kernels.decode_layers over a plan of LayerSpec)
        # when the backend allows it, the per-layer C path is on (fused_attention implies cpu_layer_ops), each
        # linear layer has a C kernel for them (bfloat16: any pass; q4_1: its block_rows, any with its packed
        # bfloat16 copy), and the C plan implements every layer feature. A feature the plan does not implement
        # MUST switch this off (it is off for any feature missing from WHOLE_LAYER_FEATURES): decode_layers
        # would silently skip it.
        self.whole_layer_decode = False
        self._layer_specs: list[list[cpu_kernels.LinearSpec]] | None = None  # per layer: qkv, o, gate_up, down
        self._plan_rows = 0.0  # largest decode pass the whole-layer call takes: every layer's kernel takes it
        self._plan_key: tuple[int, int] | None = None
        self._plan: ctypes.Array | None = None
        if whole_layer_decode and caps.whole_layer_decode and self.fused_attention and features <= WHOLE_LAYER_FEATURES:
            specs = [[_linear_spec(lin) for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)] for ly in self.layers]
            if all(sp is not None for layer_specs in specs for sp in layer_specs):
                self.whole_layer_decode = True
                self._layer_specs = specs
                self._plan_rows = min(_spec_rows(lin) for lin in mw.layer_linears())
        # LoRA adapters (baton/model/lora.py): set by the engine when it serves adapters. Passes with adapter
        # rows run the loop below (the whole-layer C call has no LoRA); passes of base rows are untouched.
        self.lora: LoraSlots | None = None
        # Called between two layers of a per-layer pass (a worker that borrowed cores gives them back there
        # when their owner gets work: services/cores.py); None: nothing.
        self.between_layers: Callable[[], None] | None = None
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]  # per layer; None: full
        self.rope = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                    config.rope_theta, config.rope_scaling, dtype, device)
        # Gemma 3: the sliding layers rotate with their own base, unscaled
        self.rope_local = None if config.rope_local_theta is None else RotaryEmbedding(
            config.head_dim, max_positions or config.max_position_embeddings, config.rope_local_theta, None, dtype,
            device)

    def layer_features(self) -> frozenset[str]:
        """The layer features this model uses beyond plain Llama (names as in WHOLE_LAYER_FEATURES). A new
        feature is named here, so that the C paths that do not list it switch off."""
        c = self.config
        return frozenset(name for name, on in (
            ("attention_bias", c.attention_bias), ("qk_norm", c.qk_norm), ("sandwich_norms", c.sandwich_norms),
            ("gelu_tanh", c.hidden_act == "gelu_tanh"), ("local_rope", c.rope_local_theta is not None)) if on)

    def _decode_plan(self, kv_caches: list[LayerCache]) -> ctypes.Array | None:
        """The LayerSpec array for cpu_kernels.decode_layers, or None when a layer's weights or caches
        are not in a form it takes (int8 weights or caches, float32 weights without q4)."""
        if self._layer_specs is None:
            return None
        lora = self.lora if self.lora is not None and self.lora.packed else None
        key = (id(kv_caches), kv_caches[0].k.data_ptr(), lora.version if lora else 0)
        if self._plan_key != key:
            if not all(c.k.dtype in cpu_kernels.PAGED_DTYPES and c.k.is_contiguous() and c.v.is_contiguous()
                       for c in kv_caches):
                return None
            plan = (cpu_kernels.LayerSpec * len(self.layers))()
            for i, (layer, specs, cache) in enumerate(zip(self.layers, self._layer_specs, kv_caches)):
                plan[i] = cpu_kernels.LayerSpec(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *specs,
                                                cache.k.data_ptr(), cache.v.data_ptr())
                plan[i].window = self.windows[i] or 0
                for j, kind in enumerate(PROJECTIONS if lora else ()):
                    if not lora.targeting[kind]:
                        continue  # zeros: no adapter targets the projection
                    spec, shrink = plan[i].lora[j], lora.shrink[i][kind]
                    spec.shrink = cpu_kernels.bf16_linear_spec(shrink.blocks[0], shrink.out_features, None)
                    spec.parts = len(lora.expand[i][kind])
                    for p, (col, expand) in enumerate(lora.expand[i][kind]):
                        spec.col[p] = col
                        if lora.part_targeting[(kind, p)]:
                            spec.expand[p] = cpu_kernels.bf16_linear_spec(expand.blocks[0], expand.out_features,
                                                                          None)
            self._plan_key, self._plan = key, plan
        return self._plan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerCache], meta: AttentionMetadata,
                logits_indices: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns float32 logits [len(logits_indices), vocab].
        lora: the pass's rows -> adapter slots of ``self.lora`` (None: every row runs the base model)."""
        # [num_tokens, hidden]: the residual stream
        x = (F.embedding(input_ids, self.embed) if isinstance(self.embed, torch.Tensor)
             else self.embed.rows(input_ids, self.dtype))
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the model dtype first, as in its code
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        if lora is not None and self.lora is None:
            raise ValueError("a pass with LoRA rows on a model without adapter slots")
        # LoRA rows go into the whole-layer call when the slots are in its packed bfloat16 layout
        lora_in_plan = lora is None or (self.lora.packed and x.dtype == torch.bfloat16)
        if (lora_in_plan and self.whole_layer_decode and meta.decode is not None and not meta.prefills
                and x.shape[0] <= self._plan_rows):
            plan = self._decode_plan(kv_caches)
            if plan is not None:  # every layer in one C call: the loop below, same kernels in the same order
                self._decode_layers(plan, x, positions, kv_caches, meta, lora)
                return self._logits(x, logits_indices)
        rope = self.rope.tables(positions)  # cos, signed sin: [num_tokens, 1, head_dim] each
        rope_local = rope if self.rope_local is None else self.rope_local.tables(positions)
        layers = self.layers
        eps = self.config.rms_norm_eps
        # h: the normalized residual, the next sublayer's input [num_tokens, hidden]
        x, h = self._add_norm(x, None, layers[0].input_norm)
        # Each projection through _project: the layer's weight, plus each row's LoRA delta when the pass has one.
        for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
            qkv = self._project(layer.qkv, h, i, "qkv", lora)
            window = self.windows[i]
            attn = self._attention(qkv, rope if window is None else rope_local, positions, cache, meta, layer,
                                   window)  # [num_tokens, nh * hd]
            out = self._project(layer.o, attn, i, "o", lora)
            if layer.attn_out_norm is not None:  # sandwich norms: the sublayer's output normalized before the add
                out = _rms_norm(out, layer.attn_out_norm, eps)
            x, h = self._add_norm(x, out, layer.post_norm)  # x += o_proj(attn); h = norm(x)
            act = self._act(self._project(layer.gate_up, h, i, "gate_up", lora))
            down = self._project(layer.down, act, i, "down", lora)  # [num_tokens, hidden]
            if layer.mlp_out_norm is not None:
                down = _rms_norm(down, layer.mlp_out_norm, eps)
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else None
            x, h = self._add_norm(x, down, next_norm)  # x += mlp(h); h = the next layer's norm(x)
            if self.between_layers is not None and next_norm is not None:
                self.between_layers()
        return self._logits(x, logits_indices)

    def _project(self, lin: Linear, x: torch.Tensor, layer: int, kind: str, lora: LoraBatch | None) -> torch.Tensor:
        y = lin(x)
        if lora is not None:
            self.lora.add(layer, kind, x, y, lora)
        return y

    # ---- the ops with a C kernel: each helper picks the C call or the torch ops from the flags set in __init__

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [num_tokens, hidden] (+= delta, same shape, when given) -> (x, RMSNorm(x) * weight), the norm
        None when weight is None. The C kernel adds in place and normalizes in one call."""
        if self.cpu_layer_ops and weight is not None:
            return x, cpu_kernels.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            x = x + delta
        return x, None if weight is None else _rms_norm(x, weight, self.config.rms_norm_eps)

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        """The gated MLP's gate: gu [num_tokens, 2 * inter] (gate, up) -> act(gate) * up [num_tokens, inter], act
        SiLU (SwiGLU) or the tanh GELU (Gemma's GeGLU, torch ops: no C kernel)."""
        inter = self.config.intermediate_size
        if self.config.hidden_act == "gelu_tanh":
            return F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
        if self.cpu_layer_ops:
            return cpu_kernels.silu_mul(gu)
        return F.silu(gu[:, :inter]) * gu[:, inter:]

    def _attention(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                   cache: LayerCache, meta: AttentionMetadata, layer: LayerWeights,
                   window: int | None = None) -> torch.Tensor:
        """One layer's attention from its fused projection qkv [num_tokens, (nh + 2 * nkv) * hd]: each q and k
        head RMS-normalized (qk_norm models), rotary on them, the K/V write into ``cache``, paged attention
        (over the layer's sliding ``window`` when it has one) -> [num_tokens, nh * hd]."""
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        if self.fused_attention and not meta.prefills:  # the backend declines passes or caches it cannot take
            attn = self.backend.fused_decode(qkv, nh, nkv, self.rope.cos, self.rope.sin, positions, cache, meta,
                                             self.scale, window)
            if attn is not None:
                return attn
        cos, sin = rope
        qkv = qkv.view(-1, nh + 2 * nkv, hd)  # [num_tokens, heads, hd]
        qk = qkv[:, : nh + nkv]
        if layer.q_norm is not None:
            eps = c.rms_norm_eps
            qk = torch.cat([_rms_norm(qk[:, :nh], layer.q_norm, eps), _rms_norm(qk[:, nh:], layer.k_norm, eps)], 1)
        # Rotate q and k heads together: one rope op per layer instead of two.
        qk = apply_rotary(qk, cos, sin)
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        return self.backend.forward(q, k, v, cache, meta, self.scale, window).reshape(-1, nh * hd)

    def _decode_layers(self, plan: ctypes.Array, x: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[LayerCache], meta: AttentionMetadata, lora: LoraBatch | None = None) -> None:
        """Every layer of a decode-only pass in one C call on x [batch, hidden], updated in place (with each
        row's LoRA delta when ``lora`` is given: the plan holds the slots' packed layouts)."""
        c, d = self.config, meta.decode
        cpu_kernels.decode_layers(plan, x, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                                  c.rms_norm_eps, self.rope.cos, self.rope.sin, positions, kv_caches[0].k.dtype,
                                  kv_caches[0].k.shape[1], meta.slot_mapping, d.block_tables, d.seq_lens, self.scale,
                                  None if lora is None else lora.rows,
                                  0 if lora is None else self.lora.num_slots)

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head on the rows that sample: float32 [len(logits_indices), vocab]."""
        return self.lm_head(_rms_norm(x[logits_indices], self.norm, self.config.rms_norm_eps), torch.float32)
