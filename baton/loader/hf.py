"""Hugging Face model folders -> LoadedModel: config.json, model.safetensors (or shards), tokenizer files.

Weights keep their stored dtype and their names (LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM
already use the names Baton expects). Non-weight buffers some older checkpoints carry (rotary inv_freq)
are dropped, and so is lm_head.weight when the config ties it to the embedding. The tokenizer comes from
tokenizer.json, with BOS/EOS, the chat template and the EOS set from tokenizer_config.json,
chat_template.jinja, generation_config.json and config.json (`tokenizer_from_hf_folder`).

AWQ (gemm layout) and GPTQ (v1 and v2, act-order included) 4-bit checkpoints, named by config.json's
quantization_config, are read into int4 blocks (kernels/cpu.py int4_blocks): the CPU kernels run them as stored
(``keep_blocks``), anything else gets their values dequantized to float32.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer as TokenizerBackend

from baton.config import ConfigError, ModelConfig
from baton.kernels.cpu import GqBlocks, int4_blocks
from baton.loader.base import LoadedModel, ModelLoadError
from baton.tokenizer import END_OF_TURN_TOKENS, Tokenizer, TokenizerError

__all__ = ["load_hf_folder", "read_hf_config", "safetensors_files", "tokenizer_from_hf_folder"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _read_json(file: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{file}: cannot read it as JSON: {e}") from e


def read_hf_config(path: str) -> ModelConfig:
    """ModelConfig from the folder's config.json."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ModelLoadError(f"{path}: not a model folder, it has no config.json")
    cfg = _read_json(cfg_file)
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file}: expected a JSON object")
    try:
        return ModelConfig.from_hf(cfg, name=os.path.basename(os.path.normpath(path)))
    except ConfigError as e:
        raise ModelLoadError(f"{cfg_file}: {e}") from e
    except KeyError as e:
        raise ModelLoadError(f"{cfg_file}: required setting {e.args[0]!r} is missing") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file}: malformed setting: {e}") from e


def safetensors_files(path: str) -> list[str]:
    """The weight files of a folder: model.safetensors, or the shards model.safetensors.index.json names."""
    index_file = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_file):
        index = _read_json(index_file)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_file}: has no weight_map")
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{path}: shard {os.path.basename(missing[0])} named in {INDEX_FILE} is missing")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ModelLoadError(f"{path}: no weights; expected {SINGLE_FILE} or {INDEX_FILE} (only safetensors are read)")


def _drop_non_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def tokenizer_from_hf_folder(path: str | os.PathLike[str]) -> Tokenizer:
    """The folder's tokenizer: tokenizer.json, with tokenizer_config.json, chat_template.jinja,
    generation_config.json and config.json for BOS/EOS, the EOS set and the chat template."""
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise TokenizerError(f"{path} has no tokenizer.json (Baton reads fast-tokenizer files only)")
    try:
        backend = TokenizerBackend.from_file(tok_file)
    except Exception as e:  # the Rust side raises plain Exception on malformed files
        raise TokenizerError(f"{tok_file} is not a valid tokenizer file: {e}") from e
    tcfg = _read_optional_json(os.path.join(path, "tokenizer_config.json"))
    gcfg = _read_optional_json(os.path.join(path, "generation_config.json"))
    mcfg = _read_optional_json(os.path.join(path, "config.json"))
    vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def token_id(value: Any, where: str) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return None
        if not isinstance(value, str):
            raise TokenizerError(f"{where} should be a token string, got {value!r}")
        tid = backend.token_to_id(value)
        if tid is None:
            raise TokenizerError(f"{where} {value!r} is not in the vocabulary of {path}")
        return tid

    def int_ids(value: Any) -> list[int]:
        if value is None:
            return []
        return [int(v) for v in (value if isinstance(value, list) else [value])]

    bos = token_id(tcfg.get("bos_token"), "tokenizer_config.json bos_token")
    if bos is None:
        bos = next(iter(int_ids(gcfg.get("bos_token_id")) or int_ids(mcfg.get("bos_token_id"))), None)
    eos = token_id(tcfg.get("eos_token"), "tokenizer_config.json eos_token")
    extra_eos = int_ids(gcfg.get("eos_token_id")) or int_ids(mcfg.get("eos_token_id"))
    if eos is None and extra_eos:
        eos = extra_eos[0]
    vocab = backend.get_vocab(with_added_tokens=True)
    eos_ids = {i for i in [eos, *extra_eos] if i is not None}
    eos_ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    # Does the model want BOS/EOS around a plain encode? tokenizer_config says so explicitly in
    # most models; otherwise ask tokenizer.json's post-processor.
    probe_plain = backend.encode("a", add_special_tokens=False).ids
    probe_full = backend.encode("a", add_special_tokens=True).ids
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:
        add_bos = bos is not None and len(probe_full) > len(probe_plain) and probe_full[0] == bos
    add_eos = tcfg.get("add_eos_token")
    if add_eos is None:
        add_eos = eos is not None and len(probe_full) > len(probe_plain) and probe_full[-1] == eos

    template = tcfg.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return Tokenizer(
        backend,
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=frozenset(eos_ids),
        special_token_ids=frozenset(special),
        add_bos=bool(add_bos) and bos is not None,
        add_eos=bool(add_eos) and eos is not None,
        chat_template=template if isinstance(template, str) and template else None,
    )


def _read_optional_json(file: str) -> dict[str, Any]:
    """A tokenizer-side JSON file as a dict ({} when absent); TokenizerError when unreadable."""
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {file}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} should hold a JSON object, got {type(data).__name__}")
    return data


# AWQ's GEMM layout packs 8 output columns per int32 in this order (nibble i holds column AWQ_ORDER[i]).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _quantization(path: str) -> dict[str, Any] | None:
    """config.json's quantization_config when it names AWQ or GPTQ (checked: 4-bit, a layout Baton reads)."""
    cfg = _read_json(os.path.join(path, "config.json"))
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    where = f"{path}: config.json quantization_config"
    if method not in ("awq", "gptq"):
        raise ModelLoadError(f"{where}: quant_method {method!r} is not supported; Baton reads awq and gptq "
                             "checkpoints (and GGUF files)")
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"{where}: {bits}-bit weights are not supported; Baton reads 4-bit {method}")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(f"{where}: AWQ version {q.get('version')!r} is not supported; Baton reads the gemm "
                             "layout")
    if method == "awq" and q.get("zero_point", True) is False:
        raise ModelLoadError(f"{where}: AWQ without zero points is not supported")
    group = q.get("group_size", q.get("q_group_size"))
    if not isinstance(group, int) or (group != -1 and (group < 32 or group % 32)):
        raise ModelLoadError(f"{where}: group_size {group!r} is not supported; it must be a multiple of 32 (or -1)")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{where}: checkpoint_format {fmt!r} is not supported; Baton reads gptq and gptq_v2")
    return {"method": method, "group": group, "zero_offset": 1 if method == "gptq" and fmt == "gptq" else 0}


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> its 8 nibbles each, low first: int64 [..., C * 8]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.to(torch.int32)[..., None] >> shifts) & 15).reshape(*packed.shape[:-1], -1).to(torch.int64)


def _int4_weight(tensors: dict[str, torch.Tensor], prefix: str, quant: dict[str, Any], file: str) -> GqBlocks:
    """One AWQ or GPTQ layer (prefix.qweight, qzeros, scales, g_idx) -> GqBlocks of kind i4, consumed."""
    try:
        qweight, qzeros, scales = (tensors.pop(prefix + name) for name in ("qweight", "qzeros", "scales"))
    except KeyError as e:
        raise ModelLoadError(f"{file}: {prefix}qweight comes without {e.args[0]}") from None
    g_idx = tensors.pop(prefix + "g_idx", None)
    if quant["method"] == "awq":  # qweight [K, N/8], qzeros [G, N/8], columns in AWQ_ORDER within each int32
        reorder = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])

        def columns(packed: torch.Tensor) -> torch.Tensor:
            nib = _nibbles(packed).reshape(packed.shape[0], -1, 8)
            return nib[..., reorder].reshape(packed.shape[0], -1)

        q, zeros = columns(qweight).T, columns(qzeros)
    else:  # GPTQ: qweight [K/8, N] packed along the inputs, qzeros [G, N/8]
        q = _nibbles(qweight.T.contiguous())  # [N, K]
        zeros = _nibbles(qzeros) + quant["zero_offset"]
    n, k = q.shape
    if scales.shape[1] != n or zeros.shape != scales.shape:
        raise ModelLoadError(f"{file}: {prefix}scales {tuple(scales.shape)} and qzeros do not fit qweight ({n} "
                             f"outputs, {k} inputs)")
    group = k if quant["group"] == -1 else quant["group"]
    groups = torch.arange(k) // group if g_idx is None else g_idx.to(torch.int64)
    if groups.shape != (k,) or int(groups.min()) < 0 or int(groups.max()) >= scales.shape[0]:
        raise ModelLoadError(f"{file}: {prefix}g_idx does not fit {k} inputs in {scales.shape[0]} groups")
    try:
        return int4_blocks(q, scales, zeros, groups)
    except ValueError as e:
        raise ModelLoadError(f"{file}: {prefix}: {e}") from None


def load_hf_folder(path: str | os.PathLike[str], weights: bool = True,
                   keep_blocks: bool = False) -> LoadedModel:
    """Load a Hugging Face model folder (safetensors weights, tokenizer.json); without the weights when
    ``weights`` is False. AWQ and GPTQ checkpoints (4-bit) are read into int4 blocks: kept as such with
    ``keep_blocks`` (the CPU kernels run them), else dequantized to float32."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: not a directory")
    config = read_hf_config(path)
    quant = _quantization(path)
    tensors: dict[str, torch.Tensor | GqBlocks] = {}
    for file in safetensors_files(path) if weights else ():
        try:
            shard = load_file(file)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file: {e}") from e
        dup = set(shard) & set(tensors)
        if dup:
            raise ModelLoadError(f"{file}: weight {sorted(dup)[0]} also appears in another shard")
        tensors.update(shard)
    if weights and quant is not None:
        for prefix in [name[: -len("qweight")] for name in tensors if name.endswith(".qweight")]:
            blocks = _int4_weight(tensors, prefix, quant, path)
            tensors[prefix + "weight"] = blocks if keep_blocks else blocks.values()
    tensors = _drop_non_weights(tensors, config) if weights else {}
    try:
        tokenizer = tokenizer_from_hf_folder(path)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return LoadedModel(config=config, weights=tensors, tokenizer=tokenizer, path=path)
