"""Linear layers with the weight laid out for the fastest kernel on the device, optionally quantized."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from baton.kernels import cpu as cpu_kernels

# Weight modes (EngineConfig.weights): auto = a GGUF file's own block types where a CPU kernel takes them (the
# rest, and other files, in the model dtype); dtype = every weight in the model dtype; int8 = per-channel int8;
# q4 = q4_1 blocks for the layers (CPU), the LM head in the model dtype.
WEIGHT_MODES = ("auto", "dtype", "int8", "q4")

# Largest row count (tokens in a pass) that goes to each C kernel (block_rows). Measured on AMD EPYCs
# (2 threads, SmolLM2 shapes): the q8_0 LM head beats oneDNN up to 16 rows. The packed bfloat16
# kernel runs at about 90% of the chip's bfloat16 rate from 8 rows up: 3-7x oneDNN at 1-8 rows,
# 1.5-1.7x at 32, level at 512, so it takes every pass. So does the q4_1 kernel where the CPU has
# AVX-512 VNNI (integer arithmetic at 1.4x the bfloat16 kernel's rate from 8 rows up, 1.9x at one row: a
# quarter of the bytes) or AVX2 (an AVX2-only EPYC, default model shapes: 1.1-1.6x oneDNN float32 at 256
# rows, 2-6x at 4-64). Its portable loop takes passes of up to 8 rows (at 1 row it beats oneDNN float32
# 1.6-2x; from 16 rows, where arithmetic is the cost, it loses 2x).
BLOCK_ROWS = {"q4_1": 8, "q8_0": 16, "bf16": math.inf}


def block_rows(kind: str) -> float:
    """Largest pass the C kernel for ``kind`` takes on this CPU (see BLOCK_ROWS)."""
    return math.inf if kind == "q4_1" and cpu_kernels.blocks_fast() else BLOCK_ROWS[kind]


def keeps_file_blocks(weight_mode: str, device: torch.device) -> bool:
    """Whether a GGUF file's quantized matrices stay in their own block types (weight mode auto): on CPU where
    their matmul has a fast loop (AVX-512 VNNI or AVX2). The portable loop is 5-20x slower than float32 from
    a few rows up, so without one the file is dequantized, as --weights dtype does."""
    return weight_mode == "auto" and device.type == "cpu" and cpu_kernels.blocks_fast()


def _onednn_ready(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: weight [out, in] -> (int8 [out, in], float32 scales [out])."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


class Linear:
    """y = x @ weight.T (+ bias). weight: [out_features, in_features].

    On CPU in float32 the matmul goes to oneDNN instead of MKL: measured on an AMD EPYC, MKL's
    batch-1 GEMV streams weights at about 8 GB/s and oneDNN's at about 15 GB/s. (oneDNN's prepacked
    weight layout was slower still at batch 1, so the weight stays as it is.)

    ``int8=True`` stores the weight as int8 with one float32 scale per output channel (a quarter of
    the float32 bytes). On CPU the matmul is torch's int8 weight-packed kernel, fed bfloat16
    activations (its float32 path measured 4-5x slower here); elsewhere the weight is widened per call.

    ``blocks`` (CPU only) also keeps the weight in the layout of a C kernel (kernels/cpu.py) and
    sends passes of up to ``block_rows(blocks)`` rows to it: ``"q4_1"`` or ``"q8_0"`` blocks of 32,
    which read a fifth or a quarter of the float32 bytes; larger passes, where arithmetic and not
    memory is the cost, use ``weight``, which holds the same (dequantized) values in the model dtype
    (for a bfloat16 model on AVX512-BF16 CPUs, ``dense`` holds them packed instead and ``weight`` is
    None). Where the block kernel takes every pass (q4_1 with VNNI or AVX2), the blocks are the only copy. Or
    ``"bf16"`` (AVX512-BF16 CPUs; chosen by itself for a bfloat16 weight there): the packed
    bfloat16 layout takes every pass, and is the only copy kept (``weight`` is None).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False,
                 blocks: str | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.int8 = int8
        self.scales: torch.Tensor | None = None
        self.blocks: tuple[torch.Tensor, ...] | None = None
        self.dense: torch.Tensor | None = None  # packed bfloat16 copy for the passes the blocks do not take
        self.dense_bias: torch.Tensor | None = None
        if (blocks is None and not int8 and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and self.in_features % 2 == 0 and cpu_kernels.has_bf16_gemm()):
            blocks = "bf16"
        self.block_kind = blocks
        self.in_perm: torch.Tensor | None = None
        if blocks is not None:
            if weight.device.type != "cpu":
                raise ValueError("block-quantized weights run on CPU only")
            if blocks == "q4_1":
                q4 = cpu_kernels.quantize_q4_1(weight)
                self.blocks = (cpu_kernels.pack_q4_1(*q4),)
                weight = cpu_kernels.dequantize_q4_1(*q4).to(weight.dtype)
            elif blocks == "q8_0":
                self.blocks = cpu_kernels.quantize_q8_0(weight)
                weight = cpu_kernels.dequantize_q8_0(*self.blocks).to(weight.dtype)
            elif blocks == "bf16":
                self.blocks = (cpu_kernels.pack_bf16(weight),)
                weight = None
            else:
                raise ValueError(f"unknown block quantization {blocks!r}; choose q4_1, q8_0 or bf16")
            bias_dtype = torch.bfloat16 if blocks == "bf16" else torch.float32
            self.block_bias = None if bias is None else bias.to(bias_dtype).contiguous()
            self.block_rows = block_rows(blocks)
            if self.block_rows == math.inf:
                weight = None  # the blocks take every pass
            if (weight is not None and weight.dtype == torch.bfloat16 and self.in_features % 2 == 0
                    and cpu_kernels.has_bf16_gemm()):
                # larger passes of a bfloat16 model: the same values in the packed bfloat16 layout
                self.dense = cpu_kernels.pack_bf16(weight)
                self.dense_bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
                weight = None
        self.onednn = weight is not None and not int8 and _onednn_ready(weight)
        if int8:
            self.weight, self.scales = quantize_per_channel(weight)
            self.packed = weight.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")
            if self.packed:
                self.scales = self.scales.to(torch.bfloat16)
        else:
            self.weight = weight

    @classmethod
    def from_gq(cls, w: cpu_kernels.GqWeight, bias: torch.Tensor | None = None,
                perm: torch.Tensor | None = None) -> Linear:
        """A layer whose weight stays in a GGUF file's own block types (kernels/cpu.py GqWeight), the only copy:
        the block kernel (its VNNI, AVX2 or portable loop) takes every pass."""
        lin = cls.__new__(cls)
        lin.out_features, lin.in_features = w.n, w.k
        lin.bias, lin.int8, lin.scales, lin.dense, lin.dense_bias = bias, False, None, None, None
        lin.block_kind, lin.blocks, lin.weight, lin.onednn = "gq", (w.data, w.table), None, False
        lin.block_bias = None if bias is None else bias.float().contiguous()
        lin.block_rows = math.inf
        lin.in_perm = perm  # GPTQ's act-order: the kernel's input j is x's column perm[j]
        return lin

    @property
    def gq(self) -> cpu_kernels.GqWeight:
        return cpu_kernels.GqWeight(*self.blocks, self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight [len(ids), in] in ``dtype`` (an embedding lookup in a tied LM head)."""
        if self.block_kind == "gq":
            return cpu_kernels.gq_rows(self.gq, ids).to(dtype)
        return F.embedding(ids, self.values()).to(dtype)

    def values(self) -> torch.Tensor:
        """The weight's values [out, in] in float32, from whichever copy the layer keeps."""
        if self.block_kind == "gq":
            w = cpu_kernels.gq_rows(self.gq, torch.arange(self.out_features))
            return w if self.in_perm is None else w[:, torch.argsort(self.in_perm)]
        if self.block_kind == "q4_1":
            return cpu_kernels.dequantize_q4_1(*cpu_kernels.unpack_q4_1(self.blocks[0], self.out_features))
        if self.block_kind == "q8_0":
            return cpu_kernels.dequantize_q8_0(*self.blocks)
        if self.block_kind == "bf16":
            return cpu_kernels.unpack_bf16(self.blocks[0], self.out_features).float()
        if self.int8:
            return self.weight.float() * self.scales.float()[:, None]
        return self.weight.float()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps (for weight images and memory accounting)."""
        kept = [self.bias, self.weight, self.scales, self.dense, self.dense_bias, self.in_perm, *(self.blocks or ())]
        if self.blocks is not None:
            kept.append(self.block_bias)
        return [t for t in kept if t is not None]

    @property
    def read_tensors(self) -> list[torch.Tensor]:
        """The tensors a small-batch pass reads: the block-quantized weight when there is one."""
        if self.blocks is not None:
            return list(self.blocks)
        return [t for t in (self.weight, self.scales) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes a small-batch pass reads."""
        return sum(t.numel() * t.element_size() for t in self.read_tensors)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [tokens, in] -> [tokens, out] in x's dtype, then converted to out_dtype if given (the
        bfloat16 kernel writes float32 itself, the same values)."""
        out_dtype = out_dtype or x.dtype
        if self.blocks is not None and x.shape[0] <= self.block_rows:
            if self.block_kind == "bf16":
                return self._bf16(x, self.blocks[0], self.block_bias, out_dtype)
            if self.block_kind == "gq":
                xf = x.float() if self.in_perm is None else x.float().index_select(1, self.in_perm)
                y = cpu_kernels.gemm_gq(xf, self.gq, self.block_bias)
            elif self.block_kind == "q4_1":
                y = cpu_kernels.gemm_q4_1(x.float(), *self.blocks, self.block_bias, self.out_features)
            else:
                y = cpu_kernels.gemm_q8_0(x.float(), *self.blocks, self.block_bias)
            return y.to(x.dtype).to(out_dtype)
        if self.dense is not None:
            return self._bf16(x, self.dense, self.dense_bias, out_dtype)
        if self.int8:
            return self._int8(x).to(out_dtype)
        if self.onednn:
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y.to(out_dtype)

    def _bf16(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
        """The packed bfloat16 kernel, writing float32 itself when that is asked for."""
        y = cpu_kernels.gemm_bf16(x.to(torch.bfloat16), packed, bias, self.out_features,
                                  torch.float32 if out_dtype == torch.float32 else torch.bfloat16)
        return y.to(out_dtype)

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            # x: [tokens, in] -> bf16 activations, int8 weights, bf16 per-channel scales
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias
