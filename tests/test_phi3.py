"""Phi-3: q/k/v in one fused qkv_proj and gate/up in one gate_up_proj in the file (kept fused: the layout Baton's
kernels take), a sliding window. Baton has no windowed attention yet, so an engine caps the context at the window,
where windowed and full attention agree: greedy output token-identical to transformers in float32 (near-tie rule)
within it, from the Hugging Face folder and from the GGUF llama.cpp would write; one at a time, batched, chunked,
from the prefix cache and across the hand-off. Longer requests are refused naming the limit."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.api import InvalidRequestError, SamplingParams
from baton.config import ConfigError, EngineConfig, ModelConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import assert_greedy_match, handed_off, tiny_case

WINDOW = 24
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LENGTHS = [1, 3, 4, 5, 9, 14]  # with 10 new tokens, all within the window


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, model_builders):
    folder = model_builders.build_tiny_phi3(tmp_path_factory.mktemp("phi3") / "tiny-phi3", sliding_window=WINDOW)
    _, loaded, prompts, refs = tiny_case(transformers.Phi3ForCausalLM, folder, LENGTHS, 5, GREEDY.max_tokens)
    return folder, loaded, prompts, refs


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def test_the_fused_weights_load_as_they_are(phi3):
    folder, loaded, _, _ = phi3
    c = loaded.config
    assert (c.architecture, c.fused_projections, c.sliding_window) == ("phi3", True, WINDOW)
    assert loaded.weights["model.layers.0.self_attn.qkv_proj.weight"].shape == (c.q_size + 2 * c.kv_size, 64)
    gguf = load_model(str(folder / "model.gguf"))
    assert (gguf.config.architecture, gguf.config.sliding_window) == ("phi3", WINDOW)
    for name, w in loaded.weights.items():
        assert torch.equal(gguf.weights[name], w), name


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_one_at_a_time_within_the_window(phi3, source):
    folder, loaded, prompts, refs = phi3
    if source == "gguf":
        loaded = load_model(str(folder / "model.gguf"))
    engine = _engine(loaded, enable_prefix_caching=False)
    assert engine.max_model_len == WINDOW
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        (out,) = engine.generate([p], GREEDY)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")


@pytest.mark.parametrize("block_size,budget", [(4, 1024), (4, 5)])
def test_batched_chunked_and_from_the_prefix_cache(phi3, block_size, budget):
    _, loaded, prompts, refs = phi3
    engine = _engine(loaded, block_size=block_size, max_num_batched_tokens=budget)
    for i, (out, ref) in enumerate(zip(engine.generate(prompts, GREEDY), refs)):
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    again = engine.generate(prompts[-1:], GREEDY)[0]  # its full blocks now come from the prefix cache
    assert again.cached_prompt_tokens > 0 and again.token_ids == engine.generate(prompts[-1:], GREEDY)[0].token_ids
    assert_greedy_match(again.token_ids, refs[-1], "cached")


def test_across_the_hand_off(phi3):
    _, loaded, prompts, refs = phi3
    prefill, decode = _engine(loaded), _engine(loaded)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        assert_greedy_match(handed_off(prefill, decode, p, GREEDY), ref, f"prompt {i}")


def test_past_the_window_is_refused_or_cut(phi3):
    """A prompt longer than the window is refused naming the limit; a request that would grow past it ends there
    (finish reason length), as at any context limit."""
    _, loaded, _, _ = phi3
    engine = _engine(loaded)
    with pytest.raises(InvalidRequestError, match=str(WINDOW)):
        engine.add_request(list(range(5, 5 + WINDOW + 1)), GREEDY)
    (out,) = engine.generate([list(range(5, 25))], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "length" and 20 + len(out.token_ids) <= WINDOW


def test_the_window_from_each_config():
    """Mistral's sliding_window caps the context too; Qwen2/3 configs carry one that use_sliding_window turns off;
    a partial rotary embedding (Phi-4-mini) is refused by name."""
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096)
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 1024}).sliding_window == 1024
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    qwen = {**base, "model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen).sliding_window is None
    with pytest.raises(ConfigError, match="partial rotary"):
        ModelConfig.from_hf({**base, "model_type": "phi3", "partial_rotary_factor": 0.75})
