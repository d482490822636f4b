"""Which path LlamaModel runs: the flags it sets at construction from the backend's declared capabilities
and its layer features, and the same logits whichever path runs (tiny random Llama)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from baton.api import SamplingParams
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.kernels import cpu as cpu_kernels
from baton.loader import load_model
from baton.model.attention import BackendCapabilities, CpuAttention, TorchAttention, TritonAttention
from baton.model.llama import LlamaModel

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build here")


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


def _engine(loaded, dtype: str, weights: str, attention: str = "cpu") -> LLMEngine:
    return LLMEngine(EngineConfig(dtype=dtype, weights=weights, attention=attention, device="cpu",
                                  kv_cache_memory=8 << 20, block_size=4, max_num_batched_tokens=32,
                                  prefill_order="arrival"), loaded=loaded)


def _flags(model: LlamaModel) -> tuple[bool, bool, bool]:
    return model.cpu_layer_ops, model.fused_attention, model.whole_layer_decode


def _run(engine: LLMEngine) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every forward pass's logits, and the greedy tokens, for 12 prompts: chunked prefill passes mixed with
    decode rows, then decode-only passes of 12 rows and fewer."""
    logits: list[torch.Tensor] = []
    forward = engine.model.forward

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.clone())
        return out

    engine.model.forward = record
    prompts = [[(5 * i + j) % 300 + 3 for j in range(4 + 5 * i)] for i in range(12)]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=4 + i % 5, temperature=0, ignore_eos=True)
                                     for i in range(12)])
    return logits, [o.token_ids for o in outs]


def test_backends_declare_their_capabilities():
    assert CpuAttention.capabilities == BackendCapabilities(fused_decode=True, cpu_layer_ops=True,
                                                            whole_layer_decode=True)
    assert TorchAttention.capabilities == BackendCapabilities()  # the all-torch reference
    assert TritonAttention.capabilities == BackendCapabilities()
    with pytest.raises(ValueError, match="needs both"):
        BackendCapabilities(cpu_layer_ops=True, whole_layer_decode=True)
    with pytest.raises(NotImplementedError):
        TorchAttention().fused_decode(*[None] * 9)


@pytest.mark.parametrize("attention,dtype,weights,want", [
    ("torch", "float32", "auto", (False, False, False)),
    ("torch", "bfloat16", "q4", (False, False, False)),  # the torch backend keeps torch ops even beside C matmuls
    ("cpu", "float32", "auto", (True, True, False)),  # float32 layers use oneDNN: no C kernel for decode_layers
    ("cpu", "float32", "int8", (True, True, False)),
    ("cpu", "float32", "q4", (True, True, True)),
    ("cpu", "bfloat16", "auto", (True, True, None)),  # whole-layer with the packed bfloat16 kernel (AVX512-BF16)
])
def test_path_flags_per_backend(loaded, attention, dtype, weights, want):
    if not cpu_kernels.available() and (attention == "cpu" or weights == "q4"):
        pytest.skip("the CPU kernels do not build here")
    model = _engine(loaded, dtype, weights, attention).model
    if want[2] is None:
        want = (*want[:2], cpu_kernels.has_bf16_gemm())
    assert _flags(model) == want
    assert (model._layer_specs is not None) == model.whole_layer_decode


@needs_kernels
@pytest.mark.parametrize("dtype,weights", [("bfloat16", "auto"), ("float32", "q4"), ("bfloat16", "q4")])
def test_whole_layer_call_off_gives_the_same_logits(loaded, monkeypatch, dtype, weights):
    """The whole-layer C call runs the loop's kernels in the same order: a model built with it off gives the
    same logits (bit for bit here) in every pass, while only the model with it on calls decode_layers."""
    if dtype == "bfloat16" and weights == "auto" and not cpu_kernels.has_bf16_gemm():
        pytest.skip("bfloat16 layers use oneDNN without AVX512-BF16: no whole-layer call to compare")
    calls = {"n": 0}
    decode_layers = cpu_kernels.decode_layers

    def counting(*args, **kwargs):
        calls["n"] += 1
        return decode_layers(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "decode_layers", counting)
    on = _engine(loaded, dtype, weights)
    assert on.model.whole_layer_decode
    logits_on, tokens_on = _run(on)
    assert calls["n"] > 0
    calls["n"] = 0
    monkeypatch.setattr("baton.engine.engine.LlamaModel", functools.partial(LlamaModel, whole_layer_decode=False))
    off = _engine(loaded, dtype, weights)
    assert _flags(off.model) == (True, True, False)
    logits_off, tokens_off = _run(off)
    assert calls["n"] == 0
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off)
    for a, b in zip(logits_on, logits_off):
        assert torch.equal(a, b)


@needs_kernels
def test_a_layer_feature_the_c_paths_lack_switches_them_off(loaded, monkeypatch):
    """A feature missing from WHOLE_LAYER_FEATURES / FUSED_ATTENTION_FEATURES turns those C paths off (the
    loop's torch rotary and backend.forward run instead): the same model, logits within rounding."""
    ref = _engine(loaded, "float32", "q4")
    assert _flags(ref.model) == (True, True, True)
    logits_ref, tokens_ref = _run(ref)
    monkeypatch.setattr(LlamaModel, "layer_features", lambda self: frozenset({"qk_norm"}))
    new = _engine(loaded, "float32", "q4")
    assert _flags(new.model) == (True, False, False)
    logits, tokens = _run(new)
    assert tokens == tokens_ref
    for a, b in zip(logits, logits_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_attention_bias_is_in_the_c_plan(loaded):
    """q/k/v biases are in LinearSpec.bias: a model with them keeps the whole-layer call."""
    config = dataclasses.replace(loaded.config, attention_bias=True)
    weights = dict(loaded.weights)
    for i in range(config.num_layers):
        for proj, n in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads)):
            weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(n * config.head_dim)
    model = LlamaModel(config, weights, torch.float32, torch.device("cpu"), CpuAttention(), weight_mode="q4")
    assert model.layer_features() == {"attention_bias"}
    assert _flags(model) == (True, True, True)
