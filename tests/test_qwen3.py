"""Qwen3 (dense): per-head q/k RMSNorm before rotary, a head size that does not divide the hidden size. Greedy output
token-identical to transformers in float32 (near-tie rule) on a tiny random model the test builds, from its Hugging
Face folder and from its GGUF: one at a time, batched, chunked, from the prefix cache, across the prefill/decode
hand-off and from a shared weight image; the C paths that lack the norm step aside."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.api import SamplingParams
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import assert_greedy_match, assert_int8_kv_paths_agree, handed_off, hf_greedy, tiny_case

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = [1, 3, 4, 5, 16, 17, 33, 70]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, model_builders):
    folder = model_builders.build_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3")
    hf, loaded, prompts, refs = tiny_case(transformers.Qwen3ForCausalLM, folder, LENGTHS, 7, GREEDY.max_tokens)
    return folder, hf, loaded, prompts, refs


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def test_the_config_and_the_weights(qwen3):
    folder, hf, loaded, _, _ = qwen3
    c = loaded.config
    assert (c.architecture, c.qk_norm, c.attention_bias, c.head_dim) == ("qwen3", True, False, 32)
    assert c.q_size == 128 and c.hidden_size == 64
    gguf = load_model(str(folder / "model.gguf"))
    assert (gguf.config.architecture, gguf.config.qk_norm, gguf.config.head_dim) == ("qwen3", True, 32)
    for name, w in loaded.weights.items():  # llama.cpp leaves qwen3's q/k rows in order: nothing to undo
        assert torch.equal(gguf.weights[name], w), name
    assert not torch.equal(loaded.weights["model.layers.0.self_attn.q_norm.weight"], torch.ones(32))


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_one_at_a_time(qwen3, source):
    folder, _, loaded, prompts, refs = qwen3
    if source == "gguf":
        loaded = load_model(str(folder / "model.gguf"))
    engine = _engine(loaded, enable_prefix_caching=False)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        (out,) = engine.generate([p], GREEDY)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("block_size,budget", [(4, 1024), (16, 1024), (4, 7)])
def test_batched_and_chunked(qwen3, block_size, budget):
    _, _, loaded, prompts, refs = qwen3
    engine = _engine(loaded, block_size=block_size, max_num_batched_tokens=budget)
    for i, (out, ref) in enumerate(zip(engine.generate(prompts, GREEDY), refs)):
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    engine.scheduler.check_integrity()


def test_from_the_prefix_cache(qwen3):
    _, hf, loaded, _, _ = qwen3
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, loaded.tokenizer.vocab_size, (21,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, loaded.tokenizer.vocab_size, (n,), generator=g).tolist() for n in (1, 5, 13)]
    engine = _engine(loaded)
    outs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert [o.cached_prompt_tokens for o in outs] == [0, 20, 20]
    for i, (p, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            ref = hf_greedy(hf, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")


def test_across_the_hand_off(qwen3):
    _, _, loaded, prompts, refs = qwen3
    prefill, decode = _engine(loaded), _engine(loaded)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        assert_greedy_match(handed_off(prefill, decode, p, GREEDY), ref, f"prompt {i}")
    assert decode.pool.num_free_blocks == decode.pool.num_blocks


def test_from_a_shared_weight_image(qwen3, tmp_path):
    """The weight image (what a node's workers map) holds the q/k norms: a mapped model decodes the same."""
    folder, _, _, prompts, refs = qwen3
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4, model=str(folder),
               shared_weights_dir=str(tmp_path))
    built = LLMEngine(EngineConfig(**cfg))
    mapped = LLMEngine(EngineConfig(**cfg))
    assert any(tmp_path.iterdir())
    for engine in (built, mapped):
        for i, (out, ref) in enumerate(zip(engine.generate(prompts[:4], GREEDY), refs[:4])):
            assert_greedy_match(out.token_ids, ref, f"prompt {i}")


def test_the_c_paths_without_the_norm_step_aside(qwen3):
    """Neither the whole-layer decode call nor the fused rotary + attention call has the q/k norm: a Qwen3 model
    runs its decode passes through the layer loop (with the C layer ops), and says so in its features."""
    _, _, loaded, _, _ = qwen3
    model = _engine(loaded).model
    assert model.layer_features() == {"qk_norm"}
    assert not model.whole_layer_decode and not model.fused_attention


def test_a_missing_norm_is_named(qwen3, tmp_path, model_builders):
    """A Qwen3 file without a layer's q/k norm is refused with the tensor's name, from a folder or a GGUF."""
    import shutil

    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file

    from baton.loader import ModelLoadError

    folder = qwen3[0]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.k_norm.weight"):
        load_model(str(broken))
    reader = GGUFReader(str(folder / "model.gguf"))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", "general.arch"))}
    tensors = [(t.name, t.data.copy(), t.tensor_type) for t in reader.tensors if t.name != "blk.0.attn_q_norm.weight"]
    path = model_builders.write_gguf(tmp_path / "broken.gguf", "qwen3", meta, tensors)
    with pytest.raises(ModelLoadError, match="attn_q_norm|q_norm"):
        load_model(str(path))


def test_bfloat16_with_the_c_layer_ops(qwen3):
    """bfloat16 on CPU (the C layer ops, the norm in float32 as transformers does it): the same greedy tokens as
    transformers in bfloat16, near-ties judged at bf16 resolution."""
    folder, _, loaded, prompts, _ = qwen3
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    engine = _engine(loaded, dtype="bfloat16")
    assert engine.model.cpu_layer_ops
    for i, (p, out) in enumerate(zip(prompts, engine.generate(prompts, GREEDY))):
        with torch.no_grad():
            ref = hf_greedy(hf, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}", gap=0.1)


def test_int8_kv_cache(qwen3):
    *_, loaded, prompts, _ = qwen3
    assert_int8_kv_paths_agree(lambda **kw: _engine(loaded, **kw), prompts)
