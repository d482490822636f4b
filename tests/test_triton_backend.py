"""The engine with the Triton attention backend (run by Triton's interpreter on CPU) generates what the torch
backend generates."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from baton.api import SamplingParams  # noqa: E402
from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.loader import load_model  # noqa: E402
from baton.model.attention import TritonAttention  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_triton_backend_matches_torch(loaded, kv_dtype):
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 4, 9, 30)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        e = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=2 << 20, block_size=4,
                                   kv_dtype=kv_dtype, attention=backend), loaded=loaded)
        assert isinstance(e.model.backend, TritonAttention) == (backend == "triton")
        outs[backend] = [o.token_ids for o in e.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


def test_triton_lora_kernel_in_the_engine_matches_torch(loaded, tiny_llama_dir, tmp_path):
    """The Triton backend runs LoRA rows with the Triton kernel: same tokens as the torch backend, mixed with
    base rows in one batch."""
    import transformers

    from baton.model.lora import load_adapter
    from tests.conftest import make_peft_adapter

    base = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    folder = make_peft_adapter(base, tmp_path / "a", r=4, targets=["q_proj", "v_proj", "down_proj"], seed=3,
                               b_scale=4.0)
    g = torch.Generator().manual_seed(22)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 11)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        e = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=2 << 20, block_size=4,
                                   attention=backend), loaded=loaded)
        adapter = load_adapter("a", folder, e.model_config, 16)
        outs[backend] = [o.token_ids for o in e.generate(prompts * 2, params, [adapter, adapter, None, None])]
        assert e.model.lora.use_triton == (backend == "triton")
    assert outs["triton"] == outs["torch"]
    assert outs["torch"][0] != outs["torch"][2]  # the adapter changed the answer
