"""Mistral: Llama with a sliding window on every layer (each query attends to its last 20 positions). Greedy output
token-identical to transformers in float32 (near-tie rule) for prompts and answers shorter and longer than the
window, from the Hugging Face folder: one at a time, batched, chunked across the window's edge, from the prefix
cache, across the hand-off, on the torch reference backend and with an int8 KV cache; the decoding sequences give
back the blocks behind the window. The GGUF llama.cpp writes for Mistral carries no window: it loads as Llama."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.api import SamplingParams
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import assert_greedy_match, assert_int8_kv_paths_agree, handed_off, hf_greedy, tiny_case

WINDOW = 20
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = [1, 6, 19, 20, 21, 33, 50]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, model_builders):
    folder = model_builders.build_tiny_mistral(tmp_path_factory.mktemp("mistral") / "tiny-mistral",
                                               sliding_window=WINDOW)
    hf, loaded, prompts, refs = tiny_case(transformers.MistralForCausalLM, folder, LENGTHS, 11, GREEDY.max_tokens)
    return folder, hf, loaded, prompts, refs


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def test_the_config(mistral):
    folder, _, loaded, _, _ = mistral
    c = loaded.config
    assert (c.architecture, c.sliding_window, c.kv_window) == ("mistral", WINDOW, WINDOW)
    gguf = load_model(str(folder / "model.gguf"))
    assert (gguf.config.architecture, gguf.config.sliding_window) == ("llama", None)
    for name, w in loaded.weights.items():  # the permuted q/k rows come back in Hugging Face order
        assert torch.equal(gguf.weights[name], w), name


def test_one_at_a_time(mistral):
    _, _, loaded, prompts, refs = mistral
    engine = _engine(loaded, enable_prefix_caching=False)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        assert_greedy_match(engine.generate([p], GREEDY)[0].token_ids, ref, f"prompt {i}")


@pytest.mark.parametrize("attention", ["cpu", "torch"])
@pytest.mark.parametrize("block_size,budget", [(4, 1024), (16, 7)])
def test_batched_chunked_and_from_the_prefix_cache(mistral, block_size, budget, attention):
    _, _, loaded, prompts, refs = mistral
    engine = _engine(loaded, block_size=block_size, max_num_batched_tokens=budget, attention=attention)
    for i, (out, ref) in enumerate(zip(engine.generate(prompts, GREEDY), refs)):
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    again = engine.generate(prompts[-1:], GREEDY)[0]
    assert again.cached_prompt_tokens > 0
    assert_greedy_match(again.token_ids, refs[-1], "cached")


def test_across_the_hand_off(mistral):
    _, _, loaded, prompts, refs = mistral
    prefill, decode = _engine(loaded), _engine(loaded)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        assert_greedy_match(handed_off(prefill, decode, p, GREEDY), ref, f"prompt {i}")
    assert decode.pool.num_free_blocks == decode.pool.num_blocks


def test_the_window_changes_the_answer(mistral):
    folder, _, loaded, prompts, refs = mistral
    full = transformers.MistralForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=None).eval()
    differ = [i for i, p in enumerate(prompts)
              if hf_greedy(full, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size).token_ids != refs[i].token_ids]
    assert differ and all(len(prompts[i]) + GREEDY.max_tokens > WINDOW for i in differ)


def test_int8_kv_cache(mistral):
    *_, loaded, prompts, _ = mistral
    assert_int8_kv_paths_agree(lambda **kw: _engine(loaded, **kw), prompts)
