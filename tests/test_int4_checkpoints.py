"""AWQ and GPTQ checkpoints (safetensors with qweight, qzeros, scales; GPTQ's g_idx, act-order included): tiny
checkpoints written here in each layout from known int4 weights, loaded into the int4 tiles (kernels/cpu.py
int4_blocks) and checked against those weights, as values, as matmuls and through an engine."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.kernels import cpu as ck

pytestmark = pytest.mark.skipif(not ck.available(), reason="the CPU kernels need a C compiler")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's gemm layout: nibble i of an int32 holds column AWQ_ORDER[i]
GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(v: np.ndarray) -> torch.Tensor:
    """Packed words (int64, 32 significant bits) -> int32 with the same bits."""
    return torch.from_numpy(v.astype(np.uint32).view(np.int32))


def pack_rows(q: np.ndarray) -> np.ndarray:
    """[R, 8 * C] nibbles -> [R, C] words, nibble j of word c = column 8c + j."""
    r, c = q.shape[0], q.shape[1] // 8
    return (q.reshape(r, c, 8).astype(np.int64) << (4 * np.arange(8))).sum(-1)


def quantized_layer(method: str, w: torch.Tensor, g: torch.Generator, g_idx: torch.Tensor | None):
    """Known int4 weights of the shape of w [N, K], in the method's layout: (tensors by suffix, the weights'
    values [N, K] in float32)."""
    n, k = w.shape
    groups = k // GROUP
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 16, (groups, n), generator=g)
    if method == "gptq":
        zeros[zeros == 0] = 1  # GPTQ (v1) stores zero - 1
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half()
    group_of = torch.arange(k) // GROUP if g_idx is None else g_idx
    values = (scales.float()[group_of].T * (q - zeros[group_of].T).float()).contiguous()
    if method == "awq":
        order = list(AWQ_ORDER)
        qweight = pack_rows(q.T.numpy().reshape(k, n // 8, 8)[..., order].reshape(k, n))
        qzeros = pack_rows(zeros.numpy().reshape(groups, n // 8, 8)[..., order].reshape(groups, n))
        out = {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales}
    else:
        qweight = pack_rows(q.numpy()).T  # [K/8, N]: nibble j of row i = input 8i + j
        out = {"qweight": _int32(np.ascontiguousarray(qweight)), "qzeros": _int32(pack_rows((zeros - 1).numpy())),
               "scales": scales}
        if g_idx is not None:
            out["g_idx"] = g_idx.to(torch.int32)
    return out, values


def write_checkpoint(src, dst, method: str, act_order: bool = False):
    """A quantized copy of the tiny Llama at src (every linear layer int4) and its float twin holding the
    quantized weights' values: (quantized folder, float folder)."""
    g = torch.Generator().manual_seed(11)
    weights = load_file(str(src / "model.safetensors"))
    float_dir = dst.with_name(dst.name + "-float")
    for d in (dst, float_dir):
        shutil.copytree(src, d)
    quantized, plain = {}, dict(weights)
    orders = {}
    for name, w in weights.items():
        layer = name.rsplit(".", 2)
        if len(layer) < 3 or layer[-2] not in LINEARS or layer[-1] != "weight":
            continue
        k = w.shape[1]
        g_idx = None
        if act_order:  # one order per input (GPTQ's act-order follows the layer input's statistics)
            if k not in orders:
                orders[k] = torch.randperm(k, generator=g).argsort() // GROUP
            g_idx = orders[k]
        tensors, values = quantized_layer(method, w, g, g_idx)
        prefix = name[: -len("weight")]
        quantized.update({prefix + key: t for key, t in tensors.items()})
        plain[name] = values
    quantized.update({n: w for n, w in weights.items() if n not in plain or plain[n] is w})
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(plain, str(float_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                                      "zero_point": True} if method == "awq" else
                                     {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
                                      "sym": False, "checkpoint_format": "gptq"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst, float_dir, plain


LAYOUTS = [("awq", False), ("gptq", False), ("gptq", True)]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["awq", "gptq", "gptq-act-order"])
def checkpoint(request, tiny_llama_dir, tmp_path_factory):
    method, act_order = request.param
    return (*write_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("int4") / method, method, act_order), act_order)


def test_the_loader_reads_the_known_weights(checkpoint):
    from baton.loader import load_model

    folder, _, plain, act_order = checkpoint
    kept = load_model(folder, keep_blocks=True).weights
    dequantized = load_model(folder).weights
    name = "model.layers.1.mlp.down_proj.weight"
    assert isinstance(kept[name], ck.GqBlocks) and kept[name].kind == "i4"
    assert (kept[name].perm is not None) == act_order  # inputs taken in group order
    for n, values in plain.items():
        if n.rsplit(".", 2)[-2] in LINEARS:
            assert torch.equal(kept[n].values(), values), n
            assert torch.equal(dequantized[n], values), n


def test_the_int4_kernel_computes_the_known_weights(checkpoint):
    from baton.loader import load_model
    from baton.model.linear import Linear

    folder, _, plain, _ = checkpoint
    kept = load_model(folder, keep_blocks=True).weights
    g = torch.Generator().manual_seed(12)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        lin = Linear.from_gq(ck.gq_weight([kept[name]]), perm=kept[name].perm)
        numel = kept[name].q.numel()
        stored = numel / 2 + numel / GROUP * 2 + numel / GROUP / 2  # the checkpoint: qweight, scales, qzeros
        assert lin.nbytes <= 1.15 * stored
        x = torch.randn(33, lin.in_features, generator=g)
        ref = ck.reference_gemm(x, plain[name]) if kept[name].perm is None else None
        y = lin(x)
        if ref is None:  # act-order: the kernel rounds the activations in its own (group) order
            ref = x.double() @ plain[name].double().T
            assert ((y - ref).abs().max() / ref.abs().max()).item() < 0.02
        else:
            torch.testing.assert_close(y, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
        assert torch.equal(lin.values(), plain[name])


def test_an_engine_runs_the_checkpoint_on_the_int4_kernel(checkpoint):
    from baton.api.params import SamplingParams
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine

    folder, float_dir, _, act_order = checkpoint
    make = lambda path, mode: LLMEngine(EngineConfig(model=str(path), weights=mode, dtype="float32",  # noqa: E731
                                                     kv_cache_memory=1 << 22))
    kept, dequantized, reference = make(folder, "auto"), make(folder, "dtype"), make(float_dir, "dtype")
    assert "i4 x8" in kept.model.weights.describe()  # 2 layers x (qkv, o, gate_up, down)
    assert kept.model.whole_layer_decode != act_order  # the whole-layer call has no input gather
    ids = list(range(3, 60))
    lp_kept, top_kept = kept.score(ids)
    lp_deq, _ = dequantized.score(ids)
    lp_ref, top_ref = reference.score(ids)
    assert torch.equal(lp_deq, lp_ref)  # dequantized: exactly the known weights
    assert (top_kept == top_ref).float().mean().item() >= 0.9
    assert (lp_kept - lp_ref).abs().mean().item() < 0.05
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert len(kept.generate([ids[:10]], params)[0].token_ids) == 8


def test_unsupported_quantization_configs_are_refused(tiny_llama_dir, tmp_path):
    from baton.loader import ModelLoadError, load_model

    for qc, message in [({"quant_method": "gptq", "bits": 8, "group_size": 32}, "8-bit"),
                        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "gemm"),
                        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "multiple of 32"),
                        ({"quant_method": "bitsandbytes", "bits": 4}, "not supported")]:
        d = tmp_path / qc["quant_method"] / str(qc["bits"]) / str(qc.get("group_size", 0))
        shutil.copytree(tiny_llama_dir, d)
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=message):
            load_model(d)
