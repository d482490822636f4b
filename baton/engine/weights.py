"""Where an engine's weights come from: the model file, prepared in this process, or a weight image that
the CPU workers of a node share (baton/model/image.py), built by the first of them, or beforehand by
``python -m baton.engine.weights CONFIG_JSON`` (what ``baton serve`` runs while its local Ray starts).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from baton.config import EngineConfig, ModelConfig
from baton.engine.device import resolve_device, resolve_dtype
from baton.kernels import cpu as cpu_kernels
from baton.loader import LoadedModel, default_model_path, load_model
from baton.memory import release_free_memory
from baton.model.image import image_key, shared_weights
from baton.model.linear import keeps_file_blocks
from baton.model.llama import ModelWeights
from baton.tokenizer import Tokenizer

__all__ = ["config_json", "engine_weights", "keeps_blocks", "main", "shares_weights"]


def shares_weights(config: EngineConfig, device: torch.device) -> bool:
    """Whether an engine with this config maps its weights from a shared image (CPU workers given a folder)."""
    return config.shared_weights_dir is not None and device.type == "cpu"


def keeps_blocks(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine keeps a GGUF file's quantized tensors in their own block types (see
    baton.model.linear.keeps_file_blocks)."""
    return keeps_file_blocks(config.weights, device)


def _kernel_features() -> tuple[bool | str, ...]:
    available = cpu_kernels.available()
    return available, available and cpu_kernels.has_bf16_gemm(), cpu_kernels.gq_loop()


def _model_state(loaded: LoadedModel) -> dict:
    """What a weight image keeps of the model beside its weights: its config and tokenizer, as plain values."""
    return {"config": dataclasses.asdict(loaded.config), "tokenizer": loaded.tokenizer.state()}


def engine_weights(config: EngineConfig, loaded: LoadedModel | None = None
                   ) -> tuple[LoadedModel, ModelWeights | dict[str, torch.Tensor], str]:
    """The model (config, tokenizer; its weights only when they are to be prepared here) and the weights for a
    LlamaModel: prepared ones mapped from the shared image, or the file's by name. The third value says which
    ("mapped from a shared image", "built a shared image", "own copy"). A worker that maps an image reads the
    model's config and tokenizer from it too: the model file is parsed once per node."""
    device = resolve_device(config.device)
    keep = keeps_blocks(config, device)
    if loaded is not None or not shares_weights(config, device):
        loaded = loaded or load_model(config.model, keep_blocks=keep)
        return loaded, loaded.weights, "own copy"
    dtype = resolve_dtype(config.dtype, device)
    path = config.model if config.model is not None else default_model_path()
    key = image_key(path, dtype, config.weights, _kernel_features())

    def build() -> tuple[ModelWeights, dict]:
        full = load_model(path, keep_blocks=keep)
        return (ModelWeights.prepare(full.config, full.weights, dtype, device, config.weights),
                _model_state(full))

    weights, state, built = shared_weights(config.shared_weights_dir, key, build)
    if built:
        release_free_memory()  # the file's float32 weights and the packing's temporaries
    # Every image holds the state (its name hashes the code that writes and reads it).
    loaded = LoadedModel(config=ModelConfig(**state["config"]), weights={},
                         tokenizer=Tokenizer.from_state(state["tokenizer"]), path=path)
    return loaded, weights, "built a shared image" if built else "mapped from a shared image"


def main(argv: list[str] | None = None) -> int:
    """Build the shared weight image of an engine config given as JSON (its fields), unless it exists."""
    args = sys.argv[1:] if argv is None else argv
    config = EngineConfig(**json.loads(args[0]))
    if shares_weights(config, resolve_device(config.device)):
        engine_weights(config)
    return 0


def config_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


if __name__ == "__main__":
    sys.exit(main())
