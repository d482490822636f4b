"""Greedy output of the engine is token-identical to transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.api import SamplingParams
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import assert_greedy_match, hf_from_loaded, hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tiny_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    # Lengths around block boundaries (block size 4 and 16 below) and one long prompt.
    lengths = [1, 3, 4, 5, 16, 17, 33, 70]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    loaded = load_model(str(tiny_llama_dir))
    prompts = _tiny_prompts(loaded.config.vocab_size)
    refs = [hf_greedy(hf, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size) for p in prompts]
    return loaded, prompts, refs


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def test_tiny_one_at_a_time(tiny):
    loaded, prompts, refs = tiny
    engine = _engine(loaded, enable_prefix_caching=False)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        (out,) = engine.generate([p], GREEDY)
        assert out.finish_reason == "length"
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    engine.scheduler.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("block_size,budget", [(4, 1024), (16, 1024), (4, 7)])
def test_tiny_batched(tiny, block_size, budget):
    """All prompts in one continuous batch; budget 7 forces chunked prefill of the long prompts."""
    loaded, prompts, refs = tiny
    engine = _engine(loaded, block_size=block_size, max_num_batched_tokens=budget)
    outs = engine.generate(prompts, GREEDY)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    engine.scheduler.check_integrity()


def test_tiny_shared_prefix_from_cache(tiny, tiny_llama_dir):
    loaded, _, _ = tiny
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, loaded.config.vocab_size, (21,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist()
               for n in (1, 2, 5, 9, 13, 20, 30, 3)]
    engine = _engine(loaded)
    first = engine.generate(prompts[:1], GREEDY)[0]
    assert first.cached_prompt_tokens == 0
    outs = [first] + engine.generate(prompts[1:], GREEDY)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        if i:
            assert out.cached_prompt_tokens == 20, "the 5 full blocks of the shared prefix come from cache"
        ref = hf_greedy(hf, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    engine.scheduler.check_integrity()


def test_tiny_preemption_keeps_output(tiny):
    """A KV pool too small for the whole batch preempts and recomputes; output is unchanged."""
    loaded, prompts, refs = tiny
    mc = loaded.config
    per_block = 2 * mc.num_layers * 4 * mc.num_kv_heads * mc.head_dim * 4
    engine = _engine(loaded, kv_cache_memory=25 * per_block, enable_prefix_caching=False)
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    engine.scheduler.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


# -- the default model -------------------------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "hi",
    "Explain in one sentence why the sky is blue, and mention Rayleigh scattering by name.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7? Answer with the number only, then explain how you computed it step by step.",
    "Name a famous painting by Leonardo da Vinci.",
]
SYSTEM = ("You are a careful assistant for a logistics company. Answer briefly, cite no sources, and never "
          "invent tracking numbers. If you do not know, say so.")


@pytest.fixture(scope="module")
def smol():
    loaded = load_model(None)
    hf = hf_from_loaded(loaded)
    tok = loaded.tokenizer
    plain = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    shared = [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
              for q in QUESTIONS]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    refs = {tuple(p): hf_greedy(hf, p, params.max_tokens) for p in plain + shared}
    return loaded, plain, shared, params, refs


@pytest.mark.slow  # loads the default model
def test_default_model_one_at_a_time_and_batched(smol):
    loaded, plain, _, params, refs = smol
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=64 << 20,
                                    enable_prefix_caching=False), loaded=loaded)
    for i, p in enumerate(plain):
        (out,) = engine.generate([p], params)
        assert_greedy_match(out.token_ids, refs[tuple(p)], f"alone {i}")
    for i, (p, out) in enumerate(zip(plain, engine.generate(plain, params))):
        assert_greedy_match(out.token_ids, refs[tuple(p)], f"batched {i}")


def test_default_model_shared_prefix_from_cache(smol):
    loaded, _, shared, params, refs = smol
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=64 << 20), loaded=loaded)
    first = engine.generate(shared[:1], params)
    rest = engine.generate(shared[1:], params)
    common = min(len(p) for p in shared)
    while any(p[:common] != shared[0][:common] for p in shared):
        common -= 1
    for i, (p, out) in enumerate(zip(shared, first + rest)):
        if i:
            assert out.cached_prompt_tokens == common // 16 * 16 > 0
        assert_greedy_match(out.token_ids, refs[tuple(p)], f"shared {i}")
    engine.scheduler.check_integrity()


def test_tiny_bfloat16(tiny, tiny_llama_dir):
    """bfloat16 on CPU: same greedy tokens as transformers in bfloat16, near-ties judged at bf16 resolution."""
    loaded, prompts, _ = tiny
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    engine = _engine(loaded, dtype="bfloat16")
    assert engine.kv_cache.dtype == torch.bfloat16
    for i, (p, out) in enumerate(zip(prompts, engine.generate(prompts, GREEDY))):
        ref = hf_greedy(hf, p, GREEDY.max_tokens, loaded.tokenizer.vocab_size)
        assert_greedy_match(out.token_ids, ref, f"prompt {i}", gap=0.1)
