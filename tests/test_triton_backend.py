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
