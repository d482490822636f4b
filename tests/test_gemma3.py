"""Gemma 3 (text): five sliding-window layers to each global one, each kind with its own rope base; q/k norms; norm
weights that are offsets from 1; the attention and MLP outputs normalized before the residual add (sandwich norms);
embeddings scaled by sqrt(hidden); the tanh-GELU gate; a softmax scale from query_pre_attn_scalar; tied embeddings.
Greedy output token-identical to transformers in float32 (near-tie rule) on a tiny random model the test builds, for
prompts and answers shorter and longer than the 16-token window, from its Hugging Face folder and from the GGUF
llama.cpp would write: one at a time, batched, chunked across the window's edge, on the C and torch backends, from the
prefix cache, across the hand-off and from a shared weight image; bfloat16 against transformers in bfloat16."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.api import SamplingParams
from baton.config import ConfigError, EngineConfig, ModelConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import assert_greedy_match, assert_int8_kv_paths_agree, handed_off, hf_greedy, tiny_case

WINDOW = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = [1, 5, 15, 16, 17, 33, 70]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, model_builders):
    folder = model_builders.build_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3")
    hf, loaded, prompts, refs = tiny_case(transformers.Gemma3ForCausalLM, folder, LENGTHS, 3, GREEDY.max_tokens)
    return folder, hf, loaded, prompts, refs


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def test_the_config_from_the_folder_and_the_gguf(gemma3):
    folder, _, loaded, _, _ = gemma3
    c = loaded.config
    assert (c.architecture, c.sliding_window, c.rope_theta, c.rope_local_theta) == ("gemma3", WINDOW, 1e6, 1e4)
    assert [c.layer_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert (c.norm_offset, c.sandwich_norms, c.hidden_act, c.embed_scale) == (True, True, "gelu_tanh", 8.0)
    assert c.tie_word_embeddings and c.qk_norm and c.attention_scale == 32 ** -0.5
    gguf = load_model(str(folder / "model.gguf"))
    assert gguf.config == ModelConfig(**{**vars(c), "name": gguf.config.name})
    for name, w in loaded.weights.items():  # norms come back from 1 + w (a float32 rounding); the rest exactly
        if name.endswith("norm.weight"):
            assert torch.allclose(gguf.weights[name], w, atol=1e-6), name
        else:
            assert torch.equal(gguf.weights[name], w), name


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_one_at_a_time(gemma3, source):
    folder, _, loaded, prompts, refs = gemma3
    if source == "gguf":
        loaded = load_model(str(folder / "model.gguf"))
    engine = _engine(loaded, enable_prefix_caching=False)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        (out,) = engine.generate([p], GREEDY)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("attention", ["cpu", "torch"])
@pytest.mark.parametrize("block_size,budget", [(4, 1024), (16, 7)])
def test_batched_and_chunked(gemma3, block_size, budget, attention):
    _, _, loaded, prompts, refs = gemma3
    engine = _engine(loaded, block_size=block_size, max_num_batched_tokens=budget, attention=attention)
    for i, (out, ref) in enumerate(zip(engine.generate(prompts, GREEDY), refs)):
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    engine.scheduler.check_integrity()


def test_from_the_prefix_cache(gemma3):
    _, hf, loaded, _, _ = gemma3
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, loaded.tokenizer.vocab_size, (21,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, loaded.tokenizer.vocab_size, (n,), generator=g).tolist() for n in (1, 5, 13)]
    engine = _engine(loaded)
    outs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert [o.cached_prompt_tokens for o in outs] == [0, 20, 20]
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(hf, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")


def test_across_the_hand_off(gemma3):
    _, _, loaded, prompts, refs = gemma3
    prefill, decode = _engine(loaded), _engine(loaded)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        assert_greedy_match(handed_off(prefill, decode, p, GREEDY), ref, f"prompt {i}")
    assert decode.pool.num_free_blocks == decode.pool.num_blocks


def test_from_a_shared_weight_image(gemma3, tmp_path):
    """The weight image holds the sandwich norms and its config the layer kinds: a mapped model decodes the same."""
    folder, _, _, prompts, refs = gemma3
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4, model=str(folder),
               shared_weights_dir=str(tmp_path))
    built = LLMEngine(EngineConfig(**cfg))
    mapped = LLMEngine(EngineConfig(**cfg))
    assert any(tmp_path.iterdir())
    assert mapped.model_config.layer_types == built.model_config.layer_types
    for engine in (built, mapped):
        for i, (out, ref) in enumerate(zip(engine.generate(prompts[-3:], GREEDY), refs[-3:])):
            assert_greedy_match(out.token_ids, ref, f"prompt {i}")


def test_the_window_changes_the_answer(gemma3):
    """The long prompts' references differ from transformers' with a window wider than every prompt (the layers
    keep their kinds and rope bases), so the tests above do check the windows."""
    folder, _, loaded, prompts, refs = gemma3
    vocab = loaded.tokenizer.vocab_size
    wide = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=4096).eval()
    differ = [i for i, p in enumerate(prompts)
              if hf_greedy(wide, p, GREEDY.max_tokens, vocab).token_ids != refs[i].token_ids]
    assert differ and all(len(prompts[i]) + GREEDY.max_tokens > WINDOW for i in differ)


def test_the_c_paths_without_its_features_step_aside(gemma3):
    _, _, loaded, _, _ = gemma3
    model = _engine(loaded).model
    assert model.layer_features() == {"qk_norm", "sandwich_norms", "gelu_tanh", "local_rope"}
    assert not model.whole_layer_decode and not model.fused_attention


def test_bfloat16_with_the_c_layer_ops(gemma3):
    """bfloat16 on CPU: the same greedy tokens as transformers in bfloat16, near-ties judged at bf16 resolution
    (Baton rounds 1 + w to bfloat16 once, where transformers adds it in float32 at every norm)."""
    folder, _, loaded, prompts, _ = gemma3
    hf = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    engine = _engine(loaded, dtype="bfloat16")
    assert engine.model.cpu_layer_ops
    for i, (p, out) in enumerate(zip(prompts, engine.generate(prompts, GREEDY))):
        ref = hf_greedy(hf, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}", gap=0.1)


def test_configs_baton_cannot_serve_are_named():
    base = dict(model_type="gemma3_text", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                sliding_window=16, hidden_activation="gelu_pytorch_tanh")
    old = ModelConfig.from_hf({**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 3})
    assert old.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert (old.rope_theta, old.rope_local_theta) == (1e6, 1e4)
    assert ModelConfig.from_hf({**base, "query_pre_attn_scalar": 144}).attention_scale == 144 ** -0.5
    with pytest.raises(ConfigError, match="multimodal"):
        ModelConfig.from_hf({**base, "model_type": "gemma3"})
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        ModelConfig.from_hf({**base, "final_logit_softcapping": 30.0})
    with pytest.raises(ConfigError, match="activation"):
        ModelConfig.from_hf({**base, "hidden_activation": "relu"})


def test_int8_kv_cache(gemma3):
    *_, loaded, prompts, _ = gemma3
    assert_int8_kv_paths_agree(lambda **kw: _engine(loaded, **kw), prompts)
