"""Phi-3: q/k/v in one fused qkv_proj and gate/up in one gate_up_proj in the file (kept fused: the layout Baton's
kernels take), and a sliding window (each query attends to its last 24 positions). Greedy output token-identical to
transformers in float32 (near-tie rule) for prompts and answers shorter and longer than the window, from the Hugging
Face folder and from the GGUF llama.cpp would write; one at a time, batched, chunked across the window's edge, from
the prefix cache, across the hand-off and on the torch reference backend; in bfloat16 the whole-layer decode call
gives the per-layer loop's tokens and log-probs bit for bit past the window."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from baton.api import SamplingParams
from baton.config import ConfigError, EngineConfig, ModelConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import assert_greedy_match, assert_int8_kv_paths_agree, handed_off, tiny_case

WINDOW = 24
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# within the window, reaching past it while answering, at its edge, and prompts of one to two windows
LENGTHS = [1, 5, 14, 23, 24, 25, 40, 57]


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
def test_one_at_a_time_past_the_window(phi3, source):
    folder, loaded, prompts, refs = phi3
    if source == "gguf":
        loaded = load_model(str(folder / "model.gguf"))
    engine = _engine(loaded, enable_prefix_caching=False)
    assert engine.max_model_len > max(LENGTHS) + GREEDY.max_tokens  # the window does not cap the context
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        (out,) = engine.generate([p], GREEDY)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")


@pytest.mark.parametrize("attention", ["cpu", "torch"])
@pytest.mark.parametrize("block_size,budget", [(4, 1024), (16, 7)])
def test_batched_chunked_and_from_the_prefix_cache(phi3, block_size, budget, attention):
    _, loaded, prompts, refs = phi3
    engine = _engine(loaded, block_size=block_size, max_num_batched_tokens=budget, attention=attention)
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


def test_the_window_changes_the_answer(phi3):
    """The long prompts' references differ from what full attention gives (transformers with the window switched
    off), so the tests above do check the window."""
    folder, loaded, prompts, refs = phi3
    from tests.oracle import hf_greedy

    full = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=None).eval()
    assert full.config.sliding_window is None
    vocab = loaded.tokenizer.vocab_size
    differ = [i for i, p in enumerate(prompts)
              if hf_greedy(full, p, GREEDY.max_tokens, vocab).token_ids != refs[i].token_ids]
    assert differ and all(len(prompts[i]) + GREEDY.max_tokens > WINDOW for i in differ)


def test_whole_layer_decode_takes_the_window(phi3):
    """bfloat16 decode-only passes run every layer in one C call: with the window, the same tokens and log-probs,
    bit for bit, as the per-layer loop."""
    from baton.kernels import cpu as cpu_kernels

    if not cpu_kernels.has_bf16_gemm():
        pytest.skip("bfloat16 layers use oneDNN without AVX512-BF16: no whole-layer call to compare")
    _, loaded, prompts, _ = phi3
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, logprobs=True, ignore_eos=True)
    results = []
    for whole in (True, False):
        engine = _engine(loaded, dtype="bfloat16")
        assert engine.model.whole_layer_decode and engine.model._layer_specs is not None
        if not whole:
            engine.model._layer_specs = None
        results.append([(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)])
    assert results[0] == results[1]


def test_the_window_from_each_config():
    """Mistral's sliding_window is read too; Qwen2/3 configs carry one that use_sliding_window turns off;
    a partial rotary embedding (Phi-4-mini) is refused by name."""
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096)
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 1024}).sliding_window == 1024
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    qwen = {**base, "model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen).sliding_window is None
    with pytest.raises(ConfigError, match="partial rotary"):
        ModelConfig.from_hf({**base, "model_type": "phi3", "partial_rotary_factor": 0.75})


def test_blocks_behind_the_window_are_given_back(phi3):
    """Every layer has the window, so a decoding sequence gives back each block once its next query's window has
    passed it: it holds at most the window's blocks, a pool smaller than the whole sequence serves it (57 + 40
    tokens in 20 blocks of 4: 80 positions), greedy output token-identical to transformers, and the pool ends whole.
    A dropped block stays in the prefix cache."""
    from tests.oracle import hf_greedy

    folder, loaded, prompts, _ = phi3
    assert loaded.config.kv_window == WINDOW
    prompt = prompts[-1]
    hf = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf_greedy(hf, prompt, 40, loaded.tokenizer.vocab_size)
    probe = _engine(loaded)
    per_block = (4 << 20) // probe.pool.num_blocks + 1
    engine = _engine(loaded, kv_cache_memory=20 * per_block + per_block // 2)
    assert engine.pool.num_blocks == 20 < -(-(len(prompt) + 40) // 4)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    seq = engine._requests[rid].seq
    tokens, held = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
        engine.scheduler.check_integrity()
        if engine.has_unfinished():
            held.append(len(seq.held_block_ids))
    assert_greedy_match(tokens, ref, "in a pool smaller than the sequence")
    assert seq.finish_reason.value == "length" and len(tokens) == 40
    assert max(held[1:]) <= -(-WINDOW // 4) + 1 < held[0]  # after the first token: the window's blocks only
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    # Dropped blocks stay cached: in a roomy pool, every full block of the prompt; in this one, those that the
    # decoding sequence's own new blocks did not evict.
    assert engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].cached_prompt_tokens > 0
    roomy = _engine(loaded)
    roomy.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    again = roomy.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.cached_prompt_tokens == (len(prompt) - 1) // 4 * 4


def test_a_model_with_global_layers_keeps_its_blocks():
    gemma_like = ModelConfig(architecture="gemma3", vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_layers=6, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128,
                             sliding_window=8, layer_types=("sliding_attention",) * 5 + ("full_attention",))
    assert gemma_like.kv_window is None
    assert dataclasses.replace(gemma_like, layer_types=None).kv_window == 8


def test_int8_kv_cache(phi3):
    *_, loaded, prompts, _ = phi3
    assert_int8_kv_paths_agree(lambda **kw: _engine(loaded, **kw), prompts)
