"""Hugging Face model folders -> LoadedModel: config.json, model.safetensors (or shards), tokenizer files.

Weights keep their stored dtype and their names (LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM
already use the names Baton expects). Non-weight buffers some older checkpoints carry (rotary inv_freq)
are dropped, and so is lm_head.weight when the config ties it to the embedding.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from baton.config import ConfigError, ModelConfig
from baton.loader import LoadedModel, ModelLoadError
from baton.tokenizer import Tokenizer, TokenizerError

__all__ = ["load_hf_folder", "read_hf_config", "safetensors_files"]

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


def load_hf_folder(path: str | os.PathLike[str]) -> LoadedModel:
    """Load a Hugging Face model folder (safetensors weights, tokenizer.json)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: not a directory")
    config = read_hf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            shard = load_file(file)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file: {e}") from e
        dup = set(shard) & set(weights)
        if dup:
            raise ModelLoadError(f"{file}: weight {sorted(dup)[0]} also appears in another shard")
        weights.update(shard)
    weights = _drop_non_weights(weights, config)
    try:
        tokenizer = Tokenizer.from_hf_folder(path)
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path)
