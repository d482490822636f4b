"""GGUF files (llama.cpp's format) -> LoadedModel, with weights dequantized to float32 in HF layout.

Three things differ from a Hugging Face checkpoint and are undone here:
  * tensor names (blk.0.attn_q.weight -> model.layers.0.self_attn.q_proj.weight);
  * quantization (Q4_1, Q8_0, K-quants, ...), dequantized with gguf.quants.dequantize;
  * for the llama architecture, llama.cpp's converter reorders the rows of attn_q / attn_k within each
    head so that rotary pairs are adjacent (interleaved rope). We put them back in HF's rotate-half order.

The tokenizer is rebuilt from the `tokenizer.*` metadata (`tokenizer_from_gguf`): a byte-level BPE
`tokenizers` backend with the pre-tokenizer llama.cpp names in tokenizer.ggml.pre.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as TokenizerBackend

from baton.config import ConfigError, ModelConfig
from baton.kernels.cpu import GQ_FORMATS, GqBlocks, gq_blocks
from baton.loader.base import LoadedModel, ModelLoadError, check_weight_shapes
from baton.tokenizer import END_OF_TURN_TOKENS, Tokenizer, TokenizerError

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUF_PRE_TOKENIZERS",
    "keeps_blocks",
    "SUPPORTED_TENSOR_TYPES",
    "load_gguf",
    "read_gguf_metadata",
    "reader_metadata",
    "rope_scaling_from_freq_factors",
    "tokenizer_from_gguf",
    "unpermute_qk",
]

T = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
})
_DENSE_TYPES = frozenset({T.F32, T.F16, T.BF16})
log = logging.getLogger(__name__)
# GGUF general.architecture -> ModelConfig.architecture. Mistral files say "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3"}
# Architectures whose q/k rows llama.cpp's converter permuted.
_PERMUTED_QK = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's sandwich norms: its attention-output norm, and ffn_norm is its pre-MLP norm (see ModelConfig).
_SANDWICH_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# What llama.cpp fixes for Gemma 3 in the file instead of its metadata: every sixth layer attends globally, the
# sliding layers rotate with base 10000.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA = 6, 10000.0
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope: per-frequency divisors instead of metadata

# The chat format of an architecture whose GGUF files often carry no tokenizer.chat_template (llama.cpp falls
# back to its own built-in template the same way). Gemma: turns of user and model; a system message opens the
# first user turn.
_GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] | trim + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if m['role'] not in ('user', 'assistant') -%}"
    "{{ raise_exception('Gemma takes system, user and assistant messages, not ' + m['role']) }}{%- endif -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma turns must alternate user, assistant, user, ... after an optional system "
    "message') }}{%- endif -%}"
    "{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + (first if loop.first else '')"
    " + m['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
ARCHITECTURE_CHAT_TEMPLATES = {"gemma3": _GEMMA_CHAT_TEMPLATE}

# llama.cpp's token_type values (gguf.TokenType).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# Pre-tokenizer split patterns, by the name llama.cpp writes to tokenizer.ggml.pre.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "llama-v3", "qwen2")


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of the file's memory map.

    GGUFReader slices its np.memmap once per metadata item; a 50k-token vocabulary means hundreds of
    thousands of slices, and each slice of an np.memmap subclass pays a Python-level __array_finalize__.
    Viewing the same mapping as a plain ndarray makes opening the default model about 3x faster; the
    mapping stays alive through the view's .base.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)

    def _build_fields(self, offs: int, count: int) -> int:
        """GGUFReader's, but an array is read whole instead of as one or two numpy views per element (Gemma's
        262,144-token vocabulary took seconds): numbers as one view, the field's single data part; strings decoded
        in one pass over the bytes into ``string_arrays[key]``, their field keeping only the array's header."""
        self.string_arrays: dict[str, list[str]] = {}
        if self.byte_order != "I":
            return super()._build_fields(offs, count)
        raw = memoryview(self._plain)
        for _ in range(count):
            orig_offs = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            kv_type = self._get(offs, np.uint32)
            offs += int(kv_type.nbytes)
            name = str(bytes(kdata), encoding="utf-8")
            if kv_type[0] != GGUFValueType.ARRAY:
                size, parts, idxs, types = self._get_field_parts(offs, kv_type[0])
                self._push_field(ReaderField(orig_offs, name, [klen, kdata, kv_type, *parts],
                                             [i + 3 for i in idxs], types), skip_sum=True)
                offs += size
                continue
            item_type, length = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
            itype, n, offs = GGUFValueType(item_type[0]), int(length[0]), offs + 12
            header = [klen, kdata, kv_type, item_type, length]
            if itype == GGUFValueType.STRING:
                strings = []
                for _ in range(n):
                    (size,) = struct.unpack_from("<Q", raw, offs)
                    if offs + 8 + size > len(raw):
                        raise ValueError(f"metadata {name}: a string runs past the end of the file")
                    strings.append(bytes(raw[offs + 8:offs + 8 + size]).decode("utf-8"))
                    offs += 8 + size
                self.string_arrays[name] = strings
                self._push_field(ReaderField(orig_offs, name, header, [], [GGUFValueType.ARRAY, itype]), skip_sum=True)
            elif itype in self.gguf_scalar_to_np:
                values = self._get(offs, self.gguf_scalar_to_np[itype], n)
                if values.shape[0] != n:
                    raise ValueError(f"metadata {name}: the array runs past the end of the file")
                self._push_field(ReaderField(orig_offs, name, [*header, values], [5] if n else [],
                                             [GGUFValueType.ARRAY, itype]), skip_sum=True)
                offs += int(values.nbytes)
            else:  # nested arrays: GGUFReader's own walk
                size, parts, idxs, types = self._get_field_parts(offs - 12, kv_type[0])
                self._push_field(ReaderField(orig_offs, name, [klen, kdata, kv_type, *parts],
                                             [i + 3 for i in idxs], types), skip_sum=True)
                offs += size - 12
        return offs


def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a plain Python value (str, int, float, bool, or a list of them)."""
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if not field.data:
            return []
        if len(types) != 2:
            return None  # nested arrays: no key Baton reads has them
        if types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _open(path: str) -> _Reader:
    try:
        reader = _Reader(path)
    except (OSError, MemoryError) as e:
        raise ModelLoadError(f"{path}: cannot read the file: {e}") from e
    except Exception as e:  # gguf/numpy raise ValueError, IndexError, KeyError, ... on bad bytes
        if os.path.getsize(path) < 24:
            raise ModelLoadError(f"{path}: too short to be a GGUF file ({os.path.getsize(path)} bytes)") from e
        raise ModelLoadError(
            f"{path}: corrupt or truncated GGUF file, its header cannot be parsed "
            f"({type(e).__name__}: {e})"
        ) from e
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {t.name} needs {t.n_bytes} bytes at offset "
                f"{reader.data_offset + t.data_offset}, but the file is {os.path.getsize(path)} bytes long"
            )
    return reader


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All metadata of a GGUF file as plain Python values (tokenizer arrays included)."""
    path = os.fspath(path)
    return reader_metadata(_open(path), path)


def reader_metadata(reader: GGUFReader, path: str = "GGUF file") -> dict[str, Any]:
    """All metadata of an open GGUFReader as plain Python values; `path` only names it in errors."""
    meta: dict[str, Any] = {}
    strings = getattr(reader, "string_arrays", {})  # _Reader's arrays of strings, decoded while opening
    for key, field in reader.fields.items():
        try:
            meta[key] = strings[key] if key in strings else _field_value(field)
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise ModelLoadError(f"{path}: metadata {key} is corrupt ({type(e).__name__}: {e})") from e
    return meta


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: interleaved rotary pairs -> HF rotate-half halves.

    llama.cpp (convert_hf_to_gguf) stores w.reshape(n_heads, 2, d // 2, ...).swapaxes(1, 2) per head;
    this is its inverse. Works for weights [rows, cols] and biases [rows].
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    # w: [n_heads, head_dim // 2, 2, ...] -> [n_heads, 2, head_dim // 2, ...]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_scaling_from_freq_factors(factors: np.ndarray, head_dim: int, rope_theta: float) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from the per-frequency divisors llama.cpp stores in rope_freqs.

    llama.cpp writes factor_i = 1 for short wavelengths, `factor` for long ones and a smooth blend
    1 / ((1 - s) / factor + s) in between, s linear in 1 / wavelength. We read `factor` off the largest
    divisor, fit s over the blend region and, taking low_freq_factor = 1 (every Llama 3.x uses it; the
    divisors pin only ratios), solve for high_freq_factor and original_max_position_embeddings. The
    result is checked by recomputing the divisors. None when every divisor is 1 (no scaling).
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"{_ROPE_FREQS} has {factors.shape[0]} values, expected head_dim / 2 = {head_dim // 2}")
    if np.allclose(factors, 1.0):
        return None
    factor = _f32(factors.max())
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    tol = 1e-4 * factor
    blend = (factors > 1 + tol) & (factors < factor - tol)
    if blend.sum() < 2:
        raise ValueError(f"{_ROPE_FREQS} has fewer than two blended frequencies; cannot recover llama3 scaling")
    s = (1 / factors[blend] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[blend], s, 1)  # s = slope / wavelen + intercept
    # With low_freq_factor = 1: intercept = -1 / (high - 1), slope = original / (high - 1).
    if intercept >= 0 or slope <= 0:
        raise ValueError(f"{_ROPE_FREQS} does not follow llama3 rope scaling")
    high = 1 - 1 / intercept
    original = round(-slope / intercept)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(f"{high:.6g}"), "original_max_position_embeddings": original}
    if not np.allclose(_llama3_divisors(scaling, wavelen), factors, rtol=1e-3):
        raise ValueError(f"{_ROPE_FREQS} does not follow llama3 rope scaling")
    return scaling


def _llama3_divisors(scaling: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    s = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - s) / factor + s)


def _rope_scaling(meta: dict[str, Any], arch: str, path: str) -> dict[str, Any] | None:
    key = f"{arch}.rope.scaling."
    kind = meta.get(key + "type")
    factor = meta.get(key + "factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:  # older files
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind is None or kind == "none":
        return None
    if factor is None:
        raise ModelLoadError(f"{path}: rope scaling type {kind!r} without {key}factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    original = meta.get(key + "original_context_length")
    if kind == "linear":
        return scaling
    if kind == "yarn":
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                   ("attn_factor", "attention_factor")):
            if meta.get(key + gguf_name) is not None:
                scaling[hf_name] = _f32(meta[key + gguf_name])
        return scaling
    if kind == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if meta.get(key + name) is None:
                raise ModelLoadError(f"{path}: llama3 rope scaling without {key}{name}")
            scaling[name] = _f32(meta[key + name])
        if original is None:
            raise ModelLoadError(f"{path}: llama3 rope scaling without {key}original_context_length")
        scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported (linear, yarn, llama3 are)")


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; Baton loads {', '.join(GGUF_ARCHITECTURES)}"
        )

    def need(name: str) -> Any:
        value = meta.get(f"{arch}.{name}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{name} is missing")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list) or isinstance(heads, list):
        raise ModelLoadError(f"{path}: per-layer head counts are not supported")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embedding (rope dimension {rope_dim}, head_dim {head_dim}) "
                             "is not supported")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")
    vocab = int(meta.get(f"{arch}.vocab_size") or int(embd.shape[-1]))  # ggml shape: [hidden, vocab]
    rope_theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = _rope_scaling(meta, arch, path)
    if _ROPE_FREQS in tensors:
        if scaling is not None:
            raise ModelLoadError(f"{path}: both {_ROPE_FREQS} and rope scaling metadata; which applies is unclear")
        try:
            scaling = rope_scaling_from_freq_factors(dequantize(tensors[_ROPE_FREQS].data,
                                                                tensors[_ROPE_FREQS].tensor_type),
                                                     head_dim, rope_theta)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from e
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        layers = int(need("block_count"))
        gemma = dict(layer_types=tuple("full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
                                       for i in range(layers)),
                     rope_local_theta=_GEMMA3_LOCAL_THETA, norm_offset=True, embed_scale=float(hidden) ** 0.5,
                     sandwich_norms=True, hidden_act="gelu_tanh", attention_scale=float(head_dim) ** -0.5)
    try:
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm=arch in ("qwen3", "gemma3"),
            sliding_window=int(meta.get(f"{arch}.attention.sliding_window") or 0) or None,
            **gemma,
            name=str(meta.get("general.name") or os.path.splitext(os.path.basename(path))[0]),
        )
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str, config: ModelConfig) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = {**_LAYER_NAMES, **_SANDWICH_NAMES} if config.sandwich_norms else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        hf = f"model.layers.{int(parts[1])}.{names[parts[2]]}"
        if config.fused_projections and hf.endswith("mlp.up_proj.weight"):
            hf = hf.replace("mlp.up_proj", "mlp.gate_up_proj")  # phi3's ffn_up holds gate and up, as its HF file does
        return hf
    return None


def _shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in numpy/torch order (ggml lists dims fastest-first: [cols, rows])."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _dequantize(t: Any, config: ModelConfig, permuted: bool, path: str) -> torch.Tensor:
    try:
        w = dequantize(t.data, t.tensor_type).reshape(_shape(t))
        if w.dtype != np.float32 or not w.flags.writeable:  # F32/F16 come back as views of the file
            w = w.astype(np.float32)
        if permuted and t.name.startswith("blk."):
            kind = t.name.split(".", 2)[2]
            if kind.startswith("attn_q."):
                w = unpermute_qk(w, config.num_heads)
            elif kind.startswith("attn_k."):
                w = unpermute_qk(w, config.num_kv_heads)
        if config.norm_offset and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w; the model adds the 1 itself
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {t.name} ({t.tensor_type.name}) cannot be converted: {e}") from e
    return torch.from_numpy(np.ascontiguousarray(w))


def _kept_blocks(t: Any, config: ModelConfig, permuted: bool) -> GqBlocks:
    """A tensor in a block type the kernels take, as stored (q/k rows put back in Hugging Face order)."""
    n, k = _shape(t)
    raw = torch.from_numpy(np.array(t.data, copy=True).reshape(n, -1))
    blocks = gq_blocks(t.tensor_type.name.lower(), raw, k)
    if permuted and t.name.startswith("blk."):
        kind = t.name.split(".", 2)[2]
        heads = config.num_heads if kind.startswith("attn_q.") else config.num_kv_heads
        if kind.startswith(("attn_q.", "attn_k.")):
            order = torch.from_numpy(unpermute_qk(np.arange(n)[:, None], heads)[:, 0].copy())
            blocks = GqBlocks(blocks.kind, *(None if f is None else f[order]
                                             for f in (blocks.q, blocks.d, blocks.m, blocks.sc, blocks.dmin)))
    return blocks


def keeps_blocks(t: Any) -> bool:
    """Whether the kernels take a tensor's block type as stored (a matrix in one of kernels/cpu.py GQ_FORMATS)."""
    return len(t.shape) == 2 and t.tensor_type.name.lower() in GQ_FORMATS and int(t.shape[0]) % 32 == 0


def _dequantize_all(items: list[tuple[str, Any]], config: ModelConfig, permuted: bool,
                    path: str, keep_blocks: bool = False) -> dict[str, torch.Tensor | GqBlocks]:
    # numpy drops the GIL in the big array operations dequantization is made of; a few threads help
    # even on two cores, since part of each tensor's work is Python holding the GIL.
    def one(t: Any) -> torch.Tensor | GqBlocks:
        if keep_blocks and keeps_blocks(t):
            return _kept_blocks(t, config, permuted)
        return _dequantize(t, config, permuted, path)

    if keep_blocks:
        unkept = [f"{t.name} ({t.tensor_type.name})" for _, t in items
                  if not keeps_blocks(t) and t.tensor_type not in _DENSE_TYPES and len(t.shape) == 2]
        if unkept:
            log.warning("%s: no kernel takes %d quantized tensor(s), dequantized: %s", path, len(unkept),
                        ", ".join(unkept[:8]) + (", ..." if len(unkept) > 8 else ""))
    workers = min(8, max(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        tensors = list(pool.map(lambda item: one(item[1]), items))
    return {name: w for (name, _), w in zip(items, tensors)}


# ---- the tokenizer, from tokenizer.* metadata --------------------------------------------------------


def tokenizer_from_gguf(source: Mapping[str, Any] | str | os.PathLike[str] | GGUFReader) -> Tokenizer:
    """Build from GGUF metadata: a dict of plain values ({"tokenizer.ggml.tokens": [...], ...}, as
    read_gguf_metadata returns), a gguf.GGUFReader, or a .gguf path.

    Supports tokenizer.ggml.model "gpt2" (byte-level BPE) with the pre-tokenizers in
    GGUF_PRE_TOKENIZERS.
    """
    if isinstance(source, Mapping):
        fields = source
    else:
        fields = (read_gguf_metadata(source) if isinstance(source, (str, os.PathLike))
                  else reader_metadata(source))
    model = fields.get("tokenizer.ggml.model")
    if model not in GGUF_TOKENIZER_MODELS:
        raise TokenizerError(
            f"GGUF tokenizer model {model!r} is not supported; Baton reads byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') vocabularies"
        )
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
    n = len(tokens)
    token_types = list(fields.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * n)
    if len(token_types) != n:
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")
    backend, vocab, control = (_byte_level_backend(fields, tokens, token_types) if model == "gpt2"
                               else _sentencepiece_backend(fields, tokens, token_types))

    def tid(key: str) -> int | None:
        value = fields.get(key)
        if value is None:
            return None
        value = int(value)
        if not 0 <= value < n:
            raise TokenizerError(f"{key} = {value} is outside the vocabulary of {n} tokens")
        return value

    bos = tid("tokenizer.ggml.bos_token_id")
    eos = tid("tokenizer.ggml.eos_token_id")
    eos_ids = {i for i in (eos, tid("tokenizer.ggml.eot_token_id"), tid("tokenizer.ggml.eom_token_id"))
               if i is not None}
    eos_ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    template = fields.get("tokenizer.chat_template")
    if not (isinstance(template, str) and template):
        template = ARCHITECTURE_CHAT_TEMPLATES.get(fields.get("general.architecture", ""))
    return Tokenizer(
        backend,
        vocab_size=n,
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=frozenset(eos_ids),
        special_token_ids=frozenset(control),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
        add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos is not None,
        chat_template=template if isinstance(template, str) and template else None,
    )


def _byte_level_backend(fields: Mapping[str, Any], tokens: list[str], token_types: list[int]
                        ) -> tuple[TokenizerBackend, dict[str, int], set[int]]:
    """Byte-level BPE ("gpt2"): the file's merges, llama.cpp's pre-tokenizer by its tokenizer.ggml.pre name."""
    merges = fields.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.merges, which a BPE vocabulary needs")
    pre = fields.get("tokenizer.ggml.pre", "default")

    # Normal tokens are spelled in the byte alphabet; one that is not (a mislabelled added token)
    # is respelled from its UTF-8 bytes. Added tokens keep their text: it is what they match.
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    control: set[int] = set()
    for i, (tok, ttype) in enumerate(zip(tokens, token_types)):
        if ttype in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added.append(AddedToken(tok, special=ttype == _TOKEN_CONTROL, normalized=False))
            if ttype == _TOKEN_CONTROL:
                control.add(i)
        elif not set(tok) <= spelled:
            tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)  # a duplicate spelling keeps its first id
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise TokenizerError(f"GGUF merge {m!r} is not two tokens separated by a space")
        pairs.append((left, right))

    normalizer, pre_tokenizer, ignore_merges = _gguf_pre_tokenizer(pre)
    backend = TokenizerBackend(models.BPE(vocab, pairs, ignore_merges=ignore_merges, fuse_unk=False,
                                          byte_fallback=False))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend, vocab, control



def _sentencepiece_backend(fields: Mapping[str, Any], tokens: list[str], token_types: list[int]
                           ) -> tuple[TokenizerBackend, dict[str, int], set[int]]:
    """SentencePiece ("llama"), as llama.cpp tokenizes it.

    llama.cpp first cuts the text at every user-defined token (and, with specials parsed, every control
    token), then runs SentencePiece's merge on each remaining piece: spaces become U+2581, the text starts
    as single characters, and the adjacent pair whose joined text is in the vocabulary with the highest
    score joins first (the leftmost among equals) until none is; a character no token holds is written
    as its UTF-8 bytes (<0xE2> tokens). That is BPE whose merges are every split of every normal token in
    two normal tokens, ranked by the joined token's score, with byte fallback: the `tokenizers` BPE model
    runs it. Added tokens (the cut) match the raw text, as llama.cpp's do.
    """
    scores = fields.get("tokenizer.ggml.scores")
    n = len(tokens)
    if scores is None or len(scores) != n:
        raise TokenizerError(f"a SentencePiece vocabulary needs tokenizer.ggml.scores for each of its {n} tokens")
    if fields.get("tokenizer.ggml.add_space_prefix", True):
        # A leading U+2581 on the first piece (Llama 2, Mistral v0.1) is not written yet; refuse rather than
        # tokenize differently from the model's training.
        raise TokenizerError("a SentencePiece vocabulary with tokenizer.ggml.add_space_prefix is not supported "
                             "yet (Gemma's, which adds none, is)")
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    control: set[int] = set()
    normal: dict[str, float] = {}
    for i, (tok, ttype) in enumerate(zip(tokens, token_types)):
        if ttype in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added.append(AddedToken(tok, special=ttype == _TOKEN_CONTROL, normalized=False))
            if ttype == _TOKEN_CONTROL:
                control.add(i)
        elif ttype == _TOKEN_NORMAL and tok not in normal:
            normal[tok] = float(scores[i])
        vocab.setdefault(tok, i)
    ranked = []
    for tok, score in normal.items():
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in normal and right in normal:
                ranked.append((-score, vocab[tok], k, left, right))
    ranked.sort()
    unk = tokens[int(fields["tokenizer.ggml.unknown_token_id"])] if "tokenizer.ggml.unknown_token_id" in fields \
        else None
    backend = TokenizerBackend(models.BPE(vocab, [(left, right) for *_, left, right in ranked], unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend, vocab, control


def _gguf_pre_tokenizer(pre: str) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer, bool]:
    """(normalizer, pre-tokenizer, BPE ignore_merges) for llama.cpp's tokenizer.ggml.pre name."""
    if pre in ("default", "gpt2"):
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre == "smollm":
        # Every digit on its own, then GPT-2's split.
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        # Llama 3 looks a whole word up in the vocabulary before merging (ignore_merges).
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), True
    if pre == "qwen2":
        return normalizers.NFC(), pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), False
    raise TokenizerError(
        f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
        f"Baton knows {', '.join(GGUF_PRE_TOKENIZERS)}"
    )


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 stand for themselves; the others (controls, space, ...) are
    moved, in order, to code points 256, 257, ...
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    mapping: dict[int, str] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def load_gguf(path: str | os.PathLike[str], weights: bool = True, keep_blocks: bool = False) -> LoadedModel:
    """Load a GGUF file: config from `{arch}.*` metadata, float32 weights in HF layout (none when ``weights``
    is False: the names and shapes are checked, nothing is dequantized), its tokenizer. ``keep_blocks``: the
    matrices in a block type the CPU kernels take stay as stored, as GqBlocks."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file")
    reader = _open(path)
    meta = reader_metadata(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    config = _config(meta, by_name, path)

    items: list[tuple[str, Any]] = []
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        hf = _hf_name(t.name, config)
        if t.name.startswith("rope_factors_"):
            raise ModelLoadError(f"{path}: {t.name}: long-context rope factors (Phi-3 128k's longrope) are not "
                                 "supported")
        if hf is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name} for architecture {config.architecture}")
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name} has type {t.tensor_type.name}, which Baton cannot dequantize; "
                f"supported: {', '.join(sorted(x.name for x in SUPPORTED_TENSOR_TYPES))}"
            )
        items.append((hf, t))
    check_weight_shapes(config, {hf: _shape(t) for hf, t in items}, path)  # before the costly part
    tensors = (_dequantize_all(items, config, meta["general.architecture"] in _PERMUTED_QK, path, keep_blocks)
               if weights else {})

    try:
        tokenizer = tokenizer_from_gguf(meta)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return LoadedModel(config=config, weights=tensors, tokenizer=tokenizer, path=path)
