"""Engine-level KV hand-off (what prefill and decode workers do, without Ray): export, import, continue."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.api import SamplingParams
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.model_runner import KVCache
from baton.loader import load_model


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


def _engine(loaded, kv_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4,
                                  kv_dtype=kv_dtype), loaded=loaded)


def _handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams):
    rid = prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), export_kv=True)
    (out,) = [o for o in prefill.step() if o.request_id == rid]
    assert out.finished and out.kv is not None and out.kv.num_tokens == len(prompt)
    assert prefill.pool.num_free_blocks == prefill.pool.num_blocks  # exported, then freed
    blocks = decode.reserve_blocks(len(prompt))
    decode.add_prefilled(prompt, out.token_ids[0], params, blocks, out.kv, sampler_state=out.sampler_state)
    tokens = []
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.token_ids
    return tokens, out.kv


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 5)])
def test_handoff_continues_exactly(loaded, kv_dtype, temperature, seed):
    prompt = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=seed, ignore_eos=True)
    single = _engine(loaded, kv_dtype).generate([prompt], params)[0].token_ids
    decode = _engine(loaded, kv_dtype)
    tokens, kv = _handoff(_engine(loaded, kv_dtype), decode, prompt, params)
    assert tokens == single
    assert (kv.scales is not None) == (kv_dtype == "int8")
    assert decode.pool.num_free_blocks == decode.pool.num_blocks
    decode.scheduler.check_integrity()


def test_handoff_between_dtypes_converts(loaded):
    """A float32 export lands in an int8 pool (quantized on the way) and decoding goes on."""
    prompt = list(range(5, 30))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens, _ = _handoff(_engine(loaded, "float32"), _engine(loaded, "int8"), prompt, params)
    assert len(tokens) == 6


def test_int8_kv_halves_the_bytes_of_bfloat16():
    # The default model's shape: 30 layers, 3 KV heads of 64.
    int8 = KVCache.bytes_per_block(30, 16, 3, 64, torch.int8)
    bf16 = KVCache.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert bf16 / 16 == 2 * 30 * 3 * 64 * 2  # 23,040 bytes per token
    assert int8 / bf16 == pytest.approx((64 + 4) / 128)  # int8 values plus a float32 scale per head


def test_int8_snapshot_is_smaller(loaded):
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    sizes = {}
    for kv_dtype in ("float32", "int8"):
        e = _engine(loaded, kv_dtype)
        rid = e.add_request(prompt, params, export_kv=True)
        (out,) = [o for o in e.step() if o.request_id == rid]
        sizes[kv_dtype] = out.kv.nbytes
    hd = loaded.config.head_dim
    assert sizes["int8"] / sizes["float32"] == pytest.approx((hd + 4) / (4 * hd))
