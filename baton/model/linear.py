"""Linear layers with the weight laid out for the fastest kernel on the device, optionally quantized."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels import cpu as cpu_kernels

# Weight modes (EngineConfig.weights): auto = the model dtype; int8 = per-channel int8;
# q4 = q4_1 blocks for the layers, a bfloat16 (else q8_0) LM head, for small batches on CPU.
WEIGHT_MODES = ("auto", "int8", "q4")

# Largest row count (tokens in a pass) that goes to the block-quantized kernels. Measured on an
# AMD EPYC (2 threads, SmolLM2 shapes): q4_1 beats oneDNN float32 up to about 8 rows (1.6-2x at
# 1 row, where reading the weights is the cost) and loses from 16 (2x slower at 128 rows, where
# arithmetic is); the q8_0 LM head wins up to 16 rows.
BLOCK_ROWS = {"q4_1": 8, "q8_0": 16, "bf16": 8}
# Largest pass for the bfloat16 C kernel (faster than oneDNN up to about 8 rows, same beyond).
BF16_ROWS = 8


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

    ``blocks="q4_1"`` or ``"q8_0"`` (CPU only) also keeps the weight quantized in blocks of 32
    (kernels/cpu.py) and sends passes of up to ``BLOCK_ROWS`` rows to those kernels, which read
    a fifth (q4_1) or a quarter (q8_0) of the float32 bytes; larger passes, where arithmetic and
    not memory is the cost, use the float32 weight, which holds the same (dequantized) values.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False,
                 blocks: str | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.int8 = int8
        self.scales: torch.Tensor | None = None
        self.blocks: tuple[torch.Tensor, ...] | None = None
        self.block_kind = blocks
        if blocks is not None:
            if weight.device.type != "cpu":
                raise ValueError("block-quantized weights run on CPU only")
            if blocks == "q4_1":
                self.blocks = cpu_kernels.quantize_q4_1(weight)
                weight = cpu_kernels.dequantize_q4_1(*self.blocks).to(weight.dtype)
            elif blocks == "q8_0":
                self.blocks = cpu_kernels.quantize_q8_0(weight)
                weight = cpu_kernels.dequantize_q8_0(*self.blocks).to(weight.dtype)
            elif blocks == "bf16":
                self.blocks = (weight.to(torch.bfloat16).contiguous(),)
                weight = self.blocks[0].to(weight.dtype)
            else:
                raise ValueError(f"unknown block quantization {blocks!r}; choose q4_1, q8_0 or bf16")
            self.block_bias = None if bias is None else bias.float().contiguous()
            self.block_rows = BLOCK_ROWS[blocks]
        self.onednn = not int8 and _onednn_ready(weight)
        # bfloat16 on a CPU with AVX512-BF16: small passes go to the C kernel (about 3x oneDNN's
        # speed at one row, where oneDNN's bf16 GEMV streams weights at a third of the bandwidth).
        self.bf16_small = (blocks is None and not int8 and weight.device.type == "cpu"
                           and weight.dtype == torch.bfloat16 and self.in_features % 32 == 0
                           and cpu_kernels.has_bf16_gemm())
        if int8:
            self.weight, self.scales = quantize_per_channel(weight)
            self.packed = weight.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")
            if self.packed:
                self.scales = self.scales.to(torch.bfloat16)
        else:
            self.weight = weight

    @property
    def nbytes(self) -> int:
        """Bytes a small-batch pass reads: the block-quantized weight when there is one."""
        if self.blocks is not None:
            return sum(t.numel() * t.element_size() for t in self.blocks)
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.scales.numel() * self.scales.element_size() if self.scales is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None and x.shape[0] <= self.block_rows:
            xf = x.float() if self.block_kind != "bf16" else x
            if self.block_kind == "q4_1":
                y = cpu_kernels.gemm_q4_1(xf, *self.blocks, self.block_bias)
            elif self.block_kind == "bf16":
                bias = None if self.bias is None else self.bias.to(torch.bfloat16)
                y = cpu_kernels.gemm_bf16(x.to(torch.bfloat16), self.blocks[0], bias)
            else:
                y = cpu_kernels.gemm_q8_0(xf, *self.blocks, self.block_bias)
            return y.to(x.dtype)
        if self.int8:
            return self._int8(x)
        if self.bf16_small and x.shape[0] <= BF16_ROWS and x.dtype == torch.bfloat16:
            return cpu_kernels.gemm_bf16(x, self.weight, self.bias)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            # x: [tokens, in] -> bf16 activations, int8 weights, bf16 per-channel scales
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias
