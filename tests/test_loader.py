"""baton.loader: GGUF and Hugging Face folders -> config + HF-named weights + tokenizer.

Oracles: transformers (its GGUF weight conversion, LlamaForCausalLM.from_pretrained) and the weights a
test wrote itself (tiny GGUFs converted the llama.cpp way, with q/k rows permuted).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace as Builders

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from baton.config import ModelConfig
from baton.loader import LoadedModel, ModelLoadError, check_weights, expected_weight_shapes, load_model
from baton.loader.gguf import SUPPORTED_TENSOR_TYPES, rope_scaling_from_freq_factors, unpermute_qk
from baton.loader.hf import tokenizer_from_hf_folder

# ---- the default model -------------------------------------------------------------------------------


def test_default_model_path_is_a_gguf(default_model_path: str) -> None:
    assert default_model_path.endswith(".gguf")
    with open(default_model_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_config(default_model: LoadedModel) -> None:
    c = default_model.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        "llama", 49152, 576, 1536, 30)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert "lm_head.weight" not in default_model.weights
    assert all(w.dtype == torch.float32 for w in default_model.weights.values())
    assert set(default_model.weights) == set(expected_weight_shapes(c))


@pytest.fixture(scope="module")
def transformers_gguf_weights(default_model: LoadedModel, default_model_path: str):
    """transformers' own GGUF conversion of the default model (dequantized, q/k un-permuted).

    AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) needs `accelerate`, which Baton does not
    install, so we call the function it uses, load_gguf_checkpoint, with a meta-device model for the
    parameter names.
    """
    import functools

    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = default_model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    with torch.device("meta"):
        names_only = transformers.LlamaForCausalLM(hf_config)
    # gguf's tensor-name table is rebuilt for every submodule (~15 s); cache it, results are unchanged.
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    try:
        return load_gguf_checkpoint(default_model_path, return_tensors=True, model_to_load=names_only)
    finally:
        mp.undo()


@pytest.mark.slow
def test_default_model_weights_equal_transformers(default_model: LoadedModel, transformers_gguf_weights) -> None:
    theirs = transformers_gguf_weights["tensors"]
    assert set(theirs) == set(default_model.weights)
    for name, ours in default_model.weights.items():
        ref = torch.as_tensor(theirs[name]).float()
        # Same dequantization, and un-permuting only moves rows: bit-identical.
        assert torch.equal(ours, ref), name


@pytest.mark.slow
def test_default_model_config_matches_transformers(default_model: LoadedModel, transformers_gguf_weights) -> None:
    hf = transformers_gguf_weights["config"]
    c = default_model.config
    assert hf["model_type"] == c.architecture
    assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]) == (
        c.hidden_size, c.intermediate_size, c.num_layers)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"]) == (c.num_heads, c.num_kv_heads)
    assert hf["max_position_embeddings"] == c.max_position_embeddings
    assert hf["vocab_size"] == c.vocab_size
    assert hf["tie_word_embeddings"] == c.tie_word_embeddings
    assert math.isclose(hf["rope_theta"], c.rope_theta)
    assert math.isclose(hf["rms_norm_eps"], c.rms_norm_eps, rel_tol=1e-6)


# ---- the llama.cpp q/k permutation --------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n_heads=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(0, 5))
def test_unpermute_inverts_llamacpp_permute(model_builders: Builders, n_heads: int, half: int, cols: int) -> None:
    rows = n_heads * 2 * half
    shape = (rows,) if cols == 0 else (rows, cols)
    w = np.random.default_rng(rows * 7 + cols).standard_normal(shape).astype(np.float32)
    permuted = model_builders.llamacpp_permute(w, n_heads)
    assert np.array_equal(unpermute_qk(permuted, n_heads), w)
    # What the permutation means: llama.cpp puts each rotary pair (i, i + d/2) of a head side by side.
    d = 2 * half
    for h in range(n_heads):
        for i in range(half):
            assert np.array_equal(permuted[h * d + 2 * i], w[h * d + i])
            assert np.array_equal(permuted[h * d + 2 * i + 1], w[h * d + i + half])


def test_unpermute_rejects_odd_head_size() -> None:
    with pytest.raises(ValueError, match="heads"):
        unpermute_qk(np.zeros((6, 2), np.float32), 2)


# ---- tiny GGUFs written here ---------------------------------------------------------------------------

# Per-tensor types for the round trip; 1-D tensors (norms) stay F32, blk.1 stays F32 throughout.
ROUND_TRIP_TYPES = {
    "token_embd.weight": Q.Q8_0, "output.weight": Q.F16,
    "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1, "blk.0.attn_v.weight": Q.Q5_0,
    "blk.0.attn_output.weight": Q.Q5_1, "blk.0.ffn_gate.weight": Q.BF16, "blk.0.ffn_up.weight": Q.F16,
    "blk.0.ffn_down.weight": Q.Q8_0,
}
# Mean |error| / mean |weight| that quantization may cause; a wrong row order gives ~1.4.
QUANT_REL_ERROR = {Q.Q8_0: 0.01, Q.Q4_0: 0.15, Q.Q4_1: 0.12, Q.Q5_0: 0.08, Q.Q5_1: 0.06, Q.F16: 1e-3,
                   Q.BF16: 5e-3}


def _gguf_contents(path: Path) -> tuple[dict, list]:
    """(metadata, tensors) of a GGUF file in write_gguf's input form, to rewrite it with changes."""
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", "general.arch"))}
    return meta, [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, model_builders: Builders) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return model_builders.build_tiny_llama_gguf(path, tiny_llama_dir, types=ROUND_TRIP_TYPES)


def test_tiny_gguf_config_matches_hf_config(tiny_gguf: Path, tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_gguf)
    hf = ModelConfig.from_hf(json.loads((tiny_llama_dir / "config.json").read_text()), name="tiny-llama")
    assert loaded.config == hf
    assert loaded.config.rope_scaling is None and loaded.path == str(tiny_gguf)


def test_tiny_gguf_weights_round_trip(tiny_gguf: Path, tiny_llama_dir: Path, model_builders: Builders) -> None:
    loaded = load_model(tiny_gguf)
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    cfg = loaded.config
    assert set(loaded.weights) == set(original)
    for name, w in original.items():
        ours = loaded.weights[name]
        assert ours.dtype == torch.float32 and ours.shape == w.shape, name
        qtype = ROUND_TRIP_TYPES.get(model_builders.gguf_name(name), Q.F32) if w.ndim == 2 else Q.F32
        if qtype == Q.F32:
            assert torch.equal(ours, w), name
            continue
        # Exactly what llama.cpp's layout + this quantization hold, put back in HF row order ...
        heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads if "k_proj" in name else None
        stored = w.numpy() if heads is None else model_builders.llamacpp_permute(w.numpy(), heads)
        dq = gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype).astype(np.float32)
        if heads is not None:
            inverse = np.empty_like(dq)
            inverse[model_builders.llamacpp_permute(np.arange(dq.shape[0]), heads)] = dq
            dq = inverse
        assert torch.equal(ours, torch.from_numpy(dq)), name
        # ... and close to the original weights.
        rel = float((ours - w).abs().mean() / w.abs().mean())
        assert rel < QUANT_REL_ERROR[qtype], (name, qtype.name, rel)


def test_tiny_gguf_tokenizer_matches_hf_folder(tiny_gguf: Path, tiny_llama_dir: Path) -> None:
    ours = load_model(tiny_gguf).tokenizer
    ref = tokenizer_from_hf_folder(tiny_llama_dir)
    text = "Hello, world! 2024-05-17 <|eot_id|> naïve 🙂"
    assert ours.encode(text) == ref.encode(text)
    assert ours.encode(text)[0] == ours.bos_token_id  # add_bos_token = true in this file
    msgs = [{"role": "user", "content": "Hi"}]
    assert ours.encode_chat(msgs) == ref.encode_chat(msgs)


def test_tied_gguf_has_no_lm_head(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    path = model_builders.build_tiny_llama_gguf(tmp_path / "tied.gguf", tiny_llama_dir, tie=True)
    loaded = load_model(path)
    assert loaded.config.tie_word_embeddings
    assert "lm_head.weight" not in loaded.weights


def _random_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Random encoded blocks of `qtype` whose every f16 field is finite (no byte >= 0x78)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(seed).integers(0, 0x78, (rows, cols // block * size), dtype=np.uint8)


def test_k_quant_tensors_load(tmp_path: Path, tiny_llama_dir: Path, model_builders: Builders) -> None:
    # One layer, hidden 256 (K-quant blocks are 256 wide), 4 heads of 64, 2 KV heads.
    hidden, inter, heads, kv_heads, head_dim = 256, 256, 4, 2, 64
    meta = model_builders.gguf_tokenizer_metadata(tiny_llama_dir / "tokenizer.json")
    vocab = len(meta["tokenizer.ggml.tokens"])
    meta.update({
        "llama.block_count": 1, "llama.context_length": 128, "llama.embedding_length": hidden,
        "llama.feed_forward_length": inter, "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    })
    plan = {  # GGUF name: (rows, cols, type, heads to un-permute)
        "token_embd.weight": (vocab, hidden, Q.Q6_K, None),
        "blk.0.attn_q.weight": (heads * head_dim, hidden, Q.Q4_K, heads),
        "blk.0.attn_k.weight": (kv_heads * head_dim, hidden, Q.Q5_K, kv_heads),
        "blk.0.attn_v.weight": (kv_heads * head_dim, hidden, Q.Q3_K, None),
        "blk.0.attn_output.weight": (hidden, heads * head_dim, Q.Q2_K, None),
        "blk.0.ffn_gate.weight": (inter, hidden, Q.Q4_K, None),
        "blk.0.ffn_up.weight": (inter, hidden, Q.Q6_K, None),
        "blk.0.ffn_down.weight": (hidden, inter, Q.Q5_K, None),
    }
    tensors = [(name, _random_blocks(r, c, t, i), t) for i, (name, (r, c, t, _)) in enumerate(plan.items())]
    ones = np.ones(hidden, np.float32)
    tensors += [(n, ones, Q.F32) for n in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")]
    path = model_builders.write_gguf(tmp_path / "kquants.gguf", "llama", meta, tensors)

    loaded = load_model(path)
    assert loaded.config.tie_word_embeddings
    for (name, raw, qtype), (_, _, _, h) in zip(tensors, plan.values()):
        expect = gguf.quants.dequantize(raw, qtype)
        if h is not None:
            inverse = np.empty_like(expect)
            inverse[model_builders.llamacpp_permute(np.arange(expect.shape[0]), h)] = expect
            expect = inverse
        hf_name = {"token_embd.weight": "model.embed_tokens.weight"}.get(name) or next(
            k for k in loaded.weights if model_builders.gguf_name(k) == name)
        ours = loaded.weights[hf_name]
        assert torch.isfinite(ours).all() and ours.abs().max() > 0, name
        assert torch.equal(ours, torch.from_numpy(expect)), (name, qtype.name)


def _llama3_divisors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """llama.cpp's rope_freqs values for Llama 3 rope scaling (convert_hf_to_gguf's formula)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_scaling_recovered_from_freq_factors() -> None:
    # Llama 3.1's settings.
    divisors = _llama3_divisors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    s = rope_scaling_from_freq_factors(divisors, 128, 500000.0)
    assert s is not None and s["rope_type"] == "llama3"
    assert (s["factor"], s["low_freq_factor"], s["original_max_position_embeddings"]) == (8.0, 1.0, 8192)
    assert math.isclose(s["high_freq_factor"], 4.0, rel_tol=1e-4)
    assert rope_scaling_from_freq_factors(np.ones(64, np.float32), 128, 500000.0) is None
    with pytest.raises(ValueError, match="llama3"):
        rope_scaling_from_freq_factors(np.linspace(1, 8, 64)[::-1].copy(), 128, 500000.0)


def test_gguf_rope_freqs_tensor_becomes_config(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    meta, tensors = _gguf_contents(model_builders.build_tiny_llama_gguf(tmp_path / "l3.gguf", tiny_llama_dir))
    tensors.append(("rope_freqs.weight", _llama3_divisors(10000.0, 16, 4.0, 1.0, 8.0, 1024), Q.F32))
    out = model_builders.write_gguf(tmp_path / "l3b.gguf", "llama", meta, tensors)
    s = load_model(out).config.rope_scaling
    assert s is not None and s["rope_type"] == "llama3"
    assert (s["factor"], s["original_max_position_embeddings"]) == (4.0, 1024)
    assert math.isclose(s["high_freq_factor"], 8.0, rel_tol=1e-3)


def test_gguf_linear_rope_scaling_metadata(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    path = model_builders.build_tiny_llama_gguf(
        tmp_path / "lin.gguf", tiny_llama_dir,
        metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    assert load_model(path).config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_qwen2_gguf_keeps_rows_and_biases(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    """qwen2 files are not permuted by llama.cpp, and carry q/k/v biases."""
    meta, tensors = _gguf_contents(model_builders.build_tiny_llama_gguf(tmp_path / "l.gguf", tiny_llama_dir))
    meta = {k.replace("llama.", "qwen2.", 1): v for k, v in meta.items()}
    meta["tokenizer.ggml.pre"] = "qwen2"
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    rng = np.random.default_rng(3)
    biases = {f"blk.{i}.attn_{p}.bias": rng.standard_normal(n).astype(np.float32)
              for i in range(2) for p, n in (("q", 64), ("k", 32), ("v", 32))}
    hf_names = {model_builders.gguf_name(k): k for k in original}
    # Back to HF row order: build_tiny_llama_gguf permuted q/k as llama.cpp does for llama, not qwen2.
    unpermuted = [(name, original[hf_names[name]].numpy(), qtype) if name.endswith(("attn_q.weight", "attn_k.weight"))
                  else (name, data, qtype) for name, data, qtype in tensors]
    out = model_builders.write_gguf(tmp_path / "q.gguf", "qwen2", meta,
                                    unpermuted + [(n, b, Q.F32) for n, b in biases.items()])
    loaded = load_model(out)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    for name, w in original.items():
        assert torch.equal(loaded.weights[name], w), name
    assert torch.equal(loaded.weights["model.layers.1.self_attn.k_proj.bias"],
                       torch.from_numpy(biases["blk.1.attn_k.bias"]))


# ---- Hugging Face folders --------------------------------------------------------------------------------


def test_hf_folder_weights_identical_to_transformers(tiny_llama_dir: Path) -> None:
    import transformers

    loaded = load_model(tiny_llama_dir)
    ref = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).state_dict()
    assert set(loaded.weights) == set(ref)
    for name, w in loaded.weights.items():
        assert torch.equal(w, ref[name]), name
    assert loaded.config == ModelConfig.from_hf(json.loads((tiny_llama_dir / "config.json").read_text()),
                                                name=tiny_llama_dir.name)
    assert (loaded.config.num_heads, loaded.config.num_kv_heads) == (4, 2)
    assert loaded.tokenizer.eos_token_ids == {1, 4}


def test_hf_sharded_folder_loads_same_weights(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    sharded = model_builders.build_tiny_llama(tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a, b = load_model(sharded).weights, load_model(tiny_llama_dir).weights
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hf_tied_folder_has_no_lm_head(tmp_path: Path, model_builders: Builders) -> None:
    loaded = load_model(model_builders.build_tiny_llama(tmp_path / "tied", tie_word_embeddings=True))
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights


def test_hf_folder_keeps_stored_dtype(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "bf16"))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(folder / "model.safetensors"))
    loaded = load_model(folder)
    assert all(w.dtype == torch.bfloat16 for w in loaded.weights.values())
    assert torch.equal(loaded.weights["model.norm.weight"], weights["model.norm.weight"].to(torch.bfloat16))


# ---- errors -----------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "nope.gguf")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_folder_without_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(tmp_path)


def test_sharded_folder_with_missing_shard(tmp_path: Path, model_builders: Builders) -> None:
    folder = model_builders.build_tiny_llama(tmp_path / "sharded", max_shard_size="20KB")
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"shard {victim.name}.*missing"):
        load_model(folder)


def test_unsupported_architecture_in_config_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "gpt2"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt2'"):
        load_model(folder)


def test_corrupt_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "bad"))
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_model(folder)


def test_truncated_gguf(default_model_path: str, tmp_path: Path) -> None:
    data = Path(default_model_path).read_bytes()
    cut = tmp_path / "half.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        load_model(cut)
    assert str(cut) in str(e.value)


def test_truncated_gguf_header(tiny_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "header.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:2000])  # inside the tokenizer metadata
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(cut)


def test_metadata_reads_as_ggufs_own_reader(default_model_path: str, tiny_gguf: Path) -> None:
    """Baton's reader takes each metadata array whole (numbers as one view, strings decoded in one pass): the same
    values as gguf's GGUFReader element by element, and the same tensors."""
    import gguf

    from baton.loader.gguf import _open, reader_metadata

    for path in (default_model_path, str(tiny_gguf)):
        ours, theirs = _open(path), gguf.GGUFReader(path)
        assert reader_metadata(ours) == reader_metadata(theirs)
        assert len(ours.string_arrays["tokenizer.ggml.tokens"]) > 100
        assert ours.data_offset == theirs.data_offset
        assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == [
            (t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors]


def test_gguf_cut_inside_the_vocabulary(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    at = data.index(b"tokenizer.ggml.tokens") + 200  # inside the array of strings
    for cut in (at, at + 1, at + 7):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="corrupt or truncated"):
            load_model(bad)


def test_random_bytes_named_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(junk)
    junk.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_model(junk)


def test_unsupported_gguf_architecture(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    meta = model_builders.gguf_tokenizer_metadata(tiny_llama_dir / "tokenizer.json")
    path = model_builders.write_gguf(tmp_path / "phi.gguf", "phi2", meta,
                                     [("token_embd.weight", np.zeros((320, 32), np.float32), Q.F32)])
    with pytest.raises(ModelLoadError, match="architecture 'phi2' is not supported"):
        load_model(path)


def test_unsupported_tensor_type(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    assert Q.TQ1_0 not in SUPPORTED_TENSOR_TYPES
    meta, tensors = _gguf_contents(model_builders.build_tiny_llama_gguf(tmp_path / "tq.gguf", tiny_llama_dir))
    tensors = [t for t in tensors if t[0] != "blk.1.ffn_down.weight"]
    # One TQ1_0 block (54 bytes, 256 values) per row; the type is refused before any shape check.
    tensors.append(("blk.1.ffn_down.weight", np.zeros((64, 54), np.uint8), Q.TQ1_0))
    out = model_builders.write_gguf(tmp_path / "tq1.gguf", "llama", meta, tensors)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.1\.ffn_down\.weight has type TQ1_0"):
        load_model(out)


def test_gguf_missing_unexpected_and_misshapen_tensors(tiny_llama_dir: Path, tmp_path: Path,
                                                        model_builders: Builders) -> None:
    meta, tensors = _gguf_contents(model_builders.build_tiny_llama_gguf(tmp_path / "full.gguf", tiny_llama_dir))
    missing = model_builders.write_gguf(tmp_path / "missing.gguf", "llama", meta,
                                        [t for t in tensors if t[0] != "blk.1.attn_k.weight"])
    with pytest.raises(ModelLoadError, match=r"missing 1 weight.*layers\.1\.self_attn\.k_proj"):
        load_model(missing)
    extra = model_builders.write_gguf(tmp_path / "extra.gguf", "llama", meta,
                                      [*tensors, ("blk.0.mystery.weight", np.ones(64, np.float32), Q.F32)])
    with pytest.raises(ModelLoadError, match=r"unexpected tensor blk\.0\.mystery\.weight"):
        load_model(extra)
    wrong = model_builders.write_gguf(tmp_path / "wrong.gguf", "llama",
                                      {**meta, "llama.feed_forward_length": 96}, tensors)
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight has shape \(128, 64\), the config implies \(96, 64\)"):
        load_model(wrong)


def test_check_weights_rejects_wrong_shape() -> None:
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=2, tie_word_embeddings=True)
    weights = {k: torch.zeros(s) for k, s in expected_weight_shapes(cfg).items()}
    check_weights(cfg, weights, "ok")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \(4, 4\), the config implies \(2, 4\)"):
        check_weights(cfg, weights, "here")
