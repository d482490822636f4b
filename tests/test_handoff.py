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


def _migrate(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], done: list[int], params: SamplingParams,
             seed: bytes):
    """What a migration does: prefill the prompt and the tokens generated so far but the last (KV only, greedy),
    then a decode engine goes on after them."""
    known = prompt + done[:-1]
    rid = prefill.add_request(known, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    (out,) = [o for o in prefill.step() if o.request_id == rid]
    blocks = decode.reserve_blocks(len(known))
    decode.add_prefilled(prompt, done, params, blocks, out.kv, sampler_state=seed)
    outs = []
    while decode.has_unfinished():
        outs += decode.step()
    return outs


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 5), (0.8, None)])
def test_a_migrated_request_goes_on_exactly(loaded, kv_dtype, temperature, seed):
    """Cut anywhere, a request continued on another engine from its prompt, its tokens so far and its seed gives
    what the undisturbed run gives: greedy, seeded, and unseeded (the seed its first prefill drew travels)."""
    prompt = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True,
                            presence_penalty=0.5)
    first = _engine(loaded, kv_dtype)
    rid = first.add_request(prompt, params, export_kv=True)
    outs = []
    while first.has_unfinished():
        outs += first.step()
    whole = [t for o in outs for t in o.token_ids]
    seed_bytes = next(o.sampler_state for o in outs if o.kv is not None)
    assert len(seed_bytes) == (0 if temperature == 0 else 8) and len(whole) == 12
    for cut in (1, 2, 7, 11):
        decode = _engine(loaded, kv_dtype)
        got = _migrate(_engine(loaded, kv_dtype), decode, prompt, whole[:cut], params, seed_bytes)
        assert got[0].token_ids == whole[:cut]  # the echo of what the client has, alone
        assert [t for o in got[1:] for t in o.token_ids] == whole[cut:], cut
        assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 12
        assert decode.pool.num_free_blocks == decode.pool.num_blocks
    del rid


def test_a_migrated_request_stops_on_a_stop_string_across_the_break(default_model):
    """The old worker streamed the stop string's first word (the detokenizer held it back), the new one makes the
    rest: it stops there, and the text the client gets is the undisturbed run's."""
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=32 << 20), loaded=default_model)
    prompt = engine.encode_prompt("Count from one to twenty in words, separated by commas:")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    whole = engine.generate([prompt], params)[0]
    lines = whole.text.split("\n")
    assert len(lines) >= 5, whole.text
    start = len(lines[0]) + len(lines[1]) + 2  # the stop string: lines 2 and 3, from here
    stop = f"{lines[2]}\n{lines[3]}"
    stopped = dataclasses.replace(params, stop=(stop,))
    reference = engine.generate([prompt], stopped)[0]
    assert reference.finish_reason == "stop" and stop not in reference.text
    # The cut: the old worker streamed tokens that end inside the stop string.
    ends = [len(engine.tokenizer.decode(whole.token_ids[:i])) for i in range(1, len(whole.token_ids) + 1)]
    cut = next(i + 1 for i, e in enumerate(ends) if start < e < start + len(stop))
    got = _migrate(engine, LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=32 << 20), loaded=default_model),
                   prompt, reference.token_ids[:cut], stopped, b"")
    assert got[-1].finish_reason == "stop"
    assert reference.token_ids[:cut] + [t for o in got[1:] for t in o.token_ids] == reference.token_ids
    assert "".join(o.text for o in got) == reference.text


def test_a_migrated_request_refuses_more_tokens_than_it_may_have(loaded):
    engine = _engine(loaded, "float32")
    from baton.engine.model_runner import KVSnapshot
    kv = KVSnapshot(torch.zeros(0), None)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_prefilled([1, 2, 3], [4, 5, 6], SamplingParams(max_tokens=2), [], kv)


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
