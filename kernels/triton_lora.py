"""Triton kernel for batched LoRA: every row of a pass adds the delta of its own adapter slot.

Layout (baton/model/lora.py, ``LoraSlots``): ``a`` [slots * width, in] and ``b`` [slots * width, out] hold
each slot's shrink and expand matrices in rows ``slot * width`` to ``(slot + 1) * width`` (the scale folded
into ``b``); ``rows`` [num_tokens] int64 is each token's slot, -1 for the base model (adds nothing).

``lora_delta_triton`` is one program per (token, tile of ``BLOCK_O`` output columns): it loads the token's
slot, shrinks the input row against that slot's ``width`` rows of ``a`` in tiles of ``BLOCK_K`` (float32
sums), then expands the ``width`` values against the tile of ``b`` and adds the result to ``y`` in place,
rounded to ``y``'s dtype (bfloat16 by round-to-nearest-even, as on the GPU). Shrink and expand are
vector products, not ``tl.dot``: a row's rank is small and rows of one pass may each use another adapter.
Reference: ``lora_delta_reference`` in baton/model/lora.py. Same interpreter rules as
kernels/triton_attention.py (``TRITON_INTERPRET=1`` runs it on CPU tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.triton_attention import INTERPRETED, _cast

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _lora_delta_kernel(x_ptr, a_ptr, b_ptr, rows_ptr, y_ptr, IN, OUT, WIDTH, stride_x, stride_a, stride_b, stride_y,
                       W_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(rows_ptr + t)
    if slot >= 0:
        w = tl.arange(0, W_P)
        w_ok = w < WIDTH
        arow = slot * WIDTH + w
        z = tl.zeros([W_P], dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < IN
            xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            at = tl.load(a_ptr + arow[:, None] * stride_a + k[None, :], mask=w_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            z += tl.sum(at * xv[None, :], axis=1)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = o < OUT
        bt = tl.load(b_ptr + arow[:, None] * stride_b + o[None, :], mask=w_ok[:, None] & o_ok[None, :],
                     other=0.0).to(tl.float32)
        delta = tl.sum(z[:, None] * bt, axis=0)
        yp = y_ptr + t * stride_y + o
        y = tl.load(yp, mask=o_ok, other=0.0).to(tl.float32)
        tl.store(yp, _cast(y + delta, y_ptr.dtype.element_ty), mask=o_ok)


def lora_delta_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, width: int,
                      y: torch.Tensor, block_k: int = 64, block_o: int = 64) -> torch.Tensor:
    """y [num_tokens, out] += each row's LoRA delta (see the module docstring), in place; returns y."""
    n, in_dim = x.shape
    if a.shape[1] != in_dim or b.shape[0] != a.shape[0] or y.shape != (n, b.shape[1]) or rows.shape != (n,):
        raise ValueError(f"LoRA shapes disagree: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"rows {tuple(rows.shape)}, y {tuple(y.shape)}")
    if width < 1 or a.shape[0] % width:
        raise ValueError(f"width {width} must divide a's {a.shape[0]} rows")
    if x.dtype not in DTYPES or y.dtype not in DTYPES or a.dtype != b.dtype or a.dtype not in DTYPES:
        raise ValueError(f"LoRA dtypes must be float32, float16 or bfloat16 (a and b alike), got x {x.dtype}, "
                         f"a {a.dtype}, b {b.dtype}, y {y.dtype}")
    if rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64, got {rows.dtype}")
    devices = {t.device for t in (x, a, b, rows, y)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not INTERPRETED and x.device.type != "cuda":
        raise ValueError(f"Triton kernels need CUDA tensors (got {x.device}); on CPU LoraSlots uses torch "
                         "products, or set TRITON_INTERPRET=1 before importing triton")
    if any(t.stride(-1) != 1 for t in (x, a, b, y)):
        raise ValueError("x, a, b and y need contiguous rows")
    if n == 0:
        return y
    grid = (n, triton.cdiv(b.shape[1], block_o))
    _lora_delta_kernel[grid](x, a, b, rows, y, in_dim, b.shape[1], width, x.stride(0), a.stride(0), b.stride(0),
                             y.stride(0), W_P=max(16, triton.next_power_of_2(width)), BLOCK_K=block_k,
                             BLOCK_O=block_o)
    return y
