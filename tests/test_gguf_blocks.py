"""GGUF block types kept as stored (kernels/cpu.py gq_*, cpu_kernels.c baton_gemm_gq): every type's blocks
read as llama.cpp's own dequantizer (gguf-py) reads them, and the matmul against a dequantize-then-matmul
reference for every pass size from 1 to 300 rows, odd shapes, tails of a tile, mixed-type fused weights, and
on the AVX2 and portable loops that CPUs without AVX-512 VNNI run."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from baton.kernels import cpu as ck

pytestmark = pytest.mark.skipif(not ck.available(), reason="the CPU kernels need a C compiler")

TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_k": Q.Q4_K,
         "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
# Byte offsets of each block's float16 scales (d, and m or dmin), set to small values so weights are sane.
F16_AT = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2],
          "q6_k": [208]}


# About the spread of scale * q (in units of the block's float16 scale) for random quants and sub-block scales.
SPREAD = {"q8_0": 74, "q4_0": 4.6, "q4_1": 4.6, "q5_0": 9.2, "q5_1": 9.2, "q4_k": 140, "q5_k": 290, "q6_k": 1300}


def random_blocks(kind: str, n: int, k: int, g: torch.Generator, std: float | None = None) -> torch.Tensor:
    """Random bytes of a tensor [n, k] of block type ``kind`` (every quant and scale bit pattern is a valid
    block; the float16 scales are drawn positive: small, or giving weights of about ``std``): uint8 [n, row
    bytes]."""
    size, per, *_ = ck.GQ_FORMATS[kind]
    raw = torch.randint(0, 256, (n, k // per, size), dtype=torch.uint8, generator=g)
    for at in F16_AT[kind]:
        low, high = (0.001, 0.021) if std is None else (0.5 * std / SPREAD[kind], 1.5 * std / SPREAD[kind])
        scale = (low + torch.rand(n, k // per, generator=g) * (high - low)).half()
        raw[..., at:at + 2] = scale.unsqueeze(-1).view(torch.uint8)
    return raw.reshape(n, -1)


def reference(kind: str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """llama.cpp's values of the blocks, from gguf-py's dequantizer (float32 [n, k])."""
    return torch.from_numpy(dequantize(raw.numpy(), TYPES[kind]).reshape(n, k).astype(np.float32))


def close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel sums exact integer dot products in float32: its error is float32 rounding of the sums."""
    scale = ref.abs().max().item() + 1e-6
    assert (y - ref).abs().max().item() <= 2e-6 * scale * max(1, ref.shape[1] ** 0.5), (y - ref).abs().max()


def input_dim(kind: str) -> int:
    return 768 if ck.GQ_FORMATS[kind][1] == 256 else 96  # three super-blocks, three blocks


@pytest.mark.parametrize("kind", list(TYPES))
def test_blocks_read_as_llamacpp_defines_them(kind):
    g = torch.Generator().manual_seed(1)
    n, k = 21, input_dim(kind)
    raw = random_blocks(kind, n, k, g)
    blocks = ck.gq_blocks(kind, raw, k)
    assert torch.equal(blocks.values(), reference(kind, raw, n, k))
    w = ck.gq_weight([blocks])
    rows = torch.tensor([0, 5, 15, 16, 20])  # both tiles, the last (partial) tile's last row
    assert torch.equal(ck.gq_rows(w, rows), reference(kind, raw, n, k)[rows])
    assert w.kinds == [kind]


@pytest.mark.parametrize("kind", list(TYPES))
def test_matmul_matches_the_dequantized_reference_at_every_pass_size(kind):
    g = torch.Generator().manual_seed(2)
    n, k = 37, input_dim(kind)  # three tiles, the last with 5 rows
    raw = random_blocks(kind, n, k, g)
    ref_w = reference(kind, raw, n, k)
    w = ck.gq_weight([ck.gq_blocks(kind, raw, k)])
    bias = torch.randn(n, generator=g)
    x = torch.randn(300, k, generator=g)
    x[7] = 0.0  # a row of zeros: scale 0
    x[11, :32] *= 1000.0  # one block far larger than the rest
    full = ck.gemm_gq(x, w, bias)
    close(full, ck.reference_gemm(x, ref_w, bias))
    for m in range(1, 300):
        y = ck.gemm_gq(x[300 - m:], w, bias)
        # each row's result is the same bits whatever the pass it is in (speculation relies on that), so every
        # pass size computes the reference's values
        assert torch.equal(y, full[300 - m:]), m
    torch.testing.assert_close(ck.gemm_gq(x[:5], w) + bias, full[:5], rtol=0, atol=1e-4)


def test_fused_weight_of_several_types():
    g = torch.Generator().manual_seed(3)
    k = 512
    kinds = [("q4_k", 32), ("q6_k", 16), ("q8_0", 16), ("q4_k", 16), ("q5_0", 9)]
    raws = [(kind, random_blocks(kind, n, k, g), n) for kind, n in kinds]
    parts = ck.gq_stack([ck.gq_blocks(kind, raw, k) for kind, raw, _ in raws])
    w = ck.gq_weight(parts)
    assert w.n == sum(n for _, n in kinds) and w.kinds == ["q4_k", "q5_0", "q6_k", "q8_0"]
    ref_w = torch.cat([reference(kind, raw, n, k) for kind, raw, n in raws])
    x = torch.randn(19, k, generator=g)
    close(ck.gemm_gq(x, w), ck.reference_gemm(x, ref_w))
    assert torch.equal(ck.gq_rows(w, torch.arange(w.n)), ref_w)


def test_a_fused_part_that_ends_mid_tile_before_another_type_is_refused():
    g = torch.Generator().manual_seed(4)
    a, b = (ck.gq_blocks(kind, random_blocks(kind, 24, 256, g), 256) for kind in ("q4_k", "q8_0"))
    with pytest.raises(ValueError, match="multiples of 16"):
        ck.gq_weight([a, b])
    with pytest.raises(ValueError, match="divisible by 256"):
        ck.gq_blocks("q6_k", random_blocks("q8_0", 4, 96, g), 96)


def test_packed_bytes_stay_near_the_files():
    """What the tiles hold per weight against the file's bytes: the k-quants' scales are widened a little."""
    g = torch.Generator().manual_seed(5)
    n, k = 64, 1024
    for kind in TYPES:
        raw = random_blocks(kind, n, k, g)
        w = ck.gq_weight([ck.gq_blocks(kind, raw, k)])
        ratio = w.data.numel() / raw.numel()
        assert ratio <= 1.06, (kind, ratio)


# The kernels as CPUs without AVX-512 VNNI run them: the AVX2 loop, and without AVX2 the portable one.
BUILDS = {"avx2": ["-mno-avx512vnni"], "portable": ["-mno-avx512vnni", "-mno-avx2"]}


@pytest.fixture(scope="module", params=list(BUILDS))
def narrower(request, tmp_path_factory):
    """The kernels built for a narrower CPU than this one (see BUILDS)."""
    out = tmp_path_factory.mktemp(request.param) / "kernels.so"
    subprocess.run([ck._compiler(), *ck.FLAGS, *BUILDS[request.param], str(ck.SOURCE), "-o", str(out), "-lm"],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    native = ck.library().baton_gq_loop()  # the loop each build runs: 1 AVX2 (where this CPU has it), 0 portable
    assert lib.baton_gq_loop() == (0 if request.param == "portable" else min(native, 1))
    for name in ("baton_gemm_gq", "baton_gq_rows", "baton_gemm_q4_1", "baton_quantize_rows"):
        getattr(lib, name).argtypes = getattr(ck.library(), name).argtypes
    return lib


def quantized_rows(lib, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    m, k = x.shape
    q, d, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32), torch.empty(m, k // 32)
    assert lib.baton_quantize_rows(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr()) == 0
    return q, d, s


def test_narrower_cpus_round_activations_to_the_same_bytes(narrower):
    """Every build's int8 rounding of the activations (vector or scalar) gives the same bytes and scales: the
    integer sums of the matmuls then agree too."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, 320, generator=g) * torch.logspace(-3, 2, 9).unsqueeze(1)
    x[2] = 0.0
    x[4, :32] = torch.arange(-16, 16) / 2  # a block with exact halves: ties round to even
    x[5, 40] = 1e30
    mine = quantized_rows(ck.library(), x)
    theirs = quantized_rows(narrower, x)
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)
    assert mine[0][4, :32].abs().max() == 127 and mine[0][2].abs().sum() == 0


@pytest.mark.parametrize("kind", [*TYPES, "i4"])
def test_narrower_cpus_compute_the_same(narrower, kind, monkeypatch):
    g = torch.Generator().manual_seed(6)
    n, k = 21, input_dim(kind)
    if kind == "i4":
        blocks = ck.int4_blocks(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                                (0.01 + 0.02 * torch.rand(k // 32, n, generator=g)).half(),
                                torch.randint(0, 16, (k // 32, n), generator=g, dtype=torch.uint8),
                                torch.arange(k) // 32)
    else:
        blocks = ck.gq_blocks(kind, random_blocks(kind, n, k, g), k)
    ref_w = blocks.values()
    w = ck.gq_weight([blocks])
    x = torch.randn(11, k, generator=g)
    x[3] = 0.0
    monkeypatch.setattr(ck, "_libs", {True: narrower, False: narrower})
    full = ck.gemm_gq(x, w)
    close(full, ck.reference_gemm(x, ref_w))
    for m in range(1, 11):  # a row's bits whatever its pass
        assert torch.equal(ck.gemm_gq(x[11 - m:], w), full[11 - m:]), m
    assert torch.equal(ck.gq_rows(w, torch.arange(n)), ref_w)


def test_narrower_cpus_run_q4_1_tiles_the_same(narrower, monkeypatch):
    """--weights q4's own tiles (float32 scales) go through the same loops."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(37, 160, generator=g) * 0.05
    qs, d, m = ck.quantize_q4_1(w)
    packed, dense = ck.pack_q4_1(qs, d, m), ck.dequantize_q4_1(qs, d, m)
    x = torch.randn(11, 160, generator=g)
    bias = torch.randn(37, generator=g)
    monkeypatch.setattr(ck, "_libs", {True: narrower, False: narrower})
    full = ck.gemm_q4_1(x, packed, bias, 37)
    close(full, ck.reference_gemm(x, dense, bias))
    for m in range(1, 11):
        assert torch.equal(ck.gemm_q4_1(x[11 - m:], packed, bias, 37), full[11 - m:]), m


# ---------------------------------------------------------------- a model file in every type, through the engine

# A 2-layer Llama with hidden 256 (the k-quants' super-block), each matrix in another type: the fused QKV
# and gate-up projections mix types, the tied LM head is q6_K.
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 384
FILE_TYPES = {"attn_q": "q4_k", "attn_k": "q5_k", "attn_v": "q6_k", "attn_output": "q8_0", "ffn_gate": "q5_0",
              "ffn_up": "q5_1", "ffn_down": "q4_0", "token_embd": "q6_k"}


@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory, model_builders):
    d = tmp_path_factory.mktemp("every-type")
    model_builders.build_tiny_tokenizer_json(d / "tokenizer.json")
    g = torch.Generator().manual_seed(7)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN),
              "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    tensors = [("token_embd.weight", random_blocks("q6_k", VOCAB, HIDDEN, g, 0.05).numpy(), TYPES["q6_k"]),
               ("output_norm.weight", np.ones(HIDDEN, np.float32), Q.F32)]
    for i in range(2):
        tensors += [(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32), Q.F32),
                    (f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32), Q.F32)]
        for name, (n, k) in shapes.items():
            kind = FILE_TYPES[name]
            tensors.append((f"blk.{i}.{name}.weight", random_blocks(kind, n, k, g, 0.05).numpy(), TYPES[kind]))
    meta = {"general.name": "every-type", "llama.block_count": 2, "llama.context_length": 256,
            "llama.embedding_length": HIDDEN, "llama.feed_forward_length": INTER, "llama.attention.head_count": HEADS,
            "llama.attention.head_count_kv": KV_HEADS, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.rope.dimension_count": head_dim,
            "llama.vocab_size": VOCAB, **model_builders.gguf_tokenizer_metadata(d / "tokenizer.json")}
    path = model_builders.write_gguf(d / "every-type.gguf", "llama", meta, tensors)
    file_bytes = sum(t[1].nbytes for t in tensors)
    return path, file_bytes


def test_an_engine_runs_every_type_as_stored(every_type_gguf):
    from baton.api.params import SamplingParams
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine

    path, file_bytes = every_type_gguf
    engines = {mode: LLMEngine(EngineConfig(model=str(path), weights=mode, dtype="float32", kv_cache_memory=1 << 24,
                                            enable_prefix_caching=False))
               for mode in ("auto", "dtype")}
    kept = engines["auto"].model.weights
    described = kept.describe()
    assert "q4_k+q5_k+q6_k x2" in described and "q5_0+q5_1 x2" in described and "LM head q6_k" in described
    assert "float32" not in described  # no matrix left dequantized
    assert kept.nbytes <= 1.15 * file_bytes  # resident weights near the file's tensor bytes
    assert engines["dtype"].model.weights.nbytes > 3 * file_bytes
    assert engines["auto"].model.whole_layer_decode  # decode runs the whole-layer C call on the tiles
    # kv_dtype auto: a float32 model that keeps a file's blocks reads its cache in bfloat16, half the bytes
    assert engines["auto"].kv_cache.dtype == torch.bfloat16 and engines["dtype"].kv_cache.dtype == torch.float32

    ids = list(range(5, 105))
    (lp_kept, top_kept), (lp_ref, top_ref) = (engines[m].score(ids) for m in ("auto", "dtype"))
    # int8-rounded activations against float32 ones: the same predictions, log-probs within rounding
    assert (top_kept == top_ref).float().mean().item() >= 0.9
    assert lp_ref.mean().item() < -1.0 and (lp_kept - lp_ref).abs().mean().item() < 0.05

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kept_out = engines["auto"].generate([ids[:20]], params)[0].token_ids
    ref_out = engines["dtype"].generate([ids[:20]], params)[0].token_ids
    first = next((i for i, (a, b) in enumerate(zip(kept_out, ref_out)) if a != b), None)
    if first is not None:  # only at a near tie of the dequantized model
        lp, _ = engines["dtype"].score(ids[:20] + kept_out[:first + 1])
        lp_ref_choice, _ = engines["dtype"].score(ids[:20] + ref_out[:first + 1])
        assert abs(lp[-1].item() - lp_ref_choice[-1].item()) < 0.1
