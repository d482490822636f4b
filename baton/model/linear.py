"""Linear layers with the weight laid out for the fastest kernel on the device, optionally int8."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.int8 = int8
        self.onednn = not int8 and _onednn_ready(weight)
        self.scales: torch.Tensor | None = None
        if int8:
            self.weight, self.scales = quantize_per_channel(weight)
            self.packed = weight.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")
            if self.packed:
                self.scales = self.scales.to(torch.bfloat16)
        else:
            self.weight = weight

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.scales.numel() * self.scales.element_size() if self.scales is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8:
            return self._int8(x)
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
