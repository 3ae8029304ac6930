"""Weight-only quantized linear maps (int8 per output channel, int4 in groups of 32): `x @ dequant(W)ᵀ (+ bias)`.

Why: one decode step of a memory-bound CPU reads every weight once, so its cost is the bytes read. int8 weights read
half of bf16's bytes and int4 a quarter, and torch's CPU kernels for them (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, vectorized for AVX2/AVX512) dequantize in registers, so the activations stay in the
model's dtype.

**Row invariance.** Each output row of these kernels is computed on its own: the same input row gives bitwise the
same output row whether it is multiplied alone or with 1-15 other rows (measured for every projection shape of the
served models by `evospec.bench.batch_invariance` and asserted by tests/unit/test_quantized.py). That is what makes
a k-token verify forward round exactly as k 1-token decode forwards do, so greedy speculative output is the target's
own (README, "Lossless"). `torch.nn.functional.linear` on dense bf16/float32 weights has no such guarantee (the BLAS
picks a different blocking by row count).

Quantization is round-to-nearest from the dense weights: int8 symmetric per output channel (scale = max|w| / 127),
int4 asymmetric per group of 32 input columns (scale = (max - min) / 15, offset = min), the layout of llama.cpp's
Q4_0/Q4_K blocks and of torchao's `int4_weight_only`.
"""
from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 32
INT4_INNER_K_TILES = 8  # the packing torch's CPU int4 kernel reads (2, 4 or 8; 8 is its fastest)


def int4_supported(out_features: int, in_features: int) -> bool:
    """Whether torch's CPU int4 kernel takes a weight of this shape (groups of 32, its packing's tile sizes)."""
    return in_features % (INT4_INNER_K_TILES * 16) == 0 and out_features % 16 == 0


def int8_per_row(weight: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q [out, in] int8, scale [out] float32) with scale = max|w| / 127. Computed
    in chunks of rows: float32 copies of a whole model's weights at once cost seconds of allocation at load."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], chunk):
        rows = weight[start:start + chunk].detach().to(torch.float32, copy=True)  # divided in place below
        row_scale = (rows.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q[start:start + chunk] = torch.round(rows.div_(row_scale[:, None])).clamp_(-127, 127)
        scale[start:start + chunk] = row_scale
    return q, scale


class Int8WeightLinear(nn.Module):
    """int8 weights [out, in] with one scale per output row; activations in `dtype` (bf16 or float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        qweight, scale = int8_per_row(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def dequantized(self) -> torch.Tensor:
        """The dense weight [out, in] (float32) this map multiplies by."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.scale.dtype)
        out = torch._weight_int8pack_mm(rows, self.qweight, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int4WeightLinear(nn.Module):
    """int4 weights [out, in], asymmetric in groups of 32 input columns, packed for torch's CPU kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        out_features, in_features = weight.shape
        if not int4_supported(out_features, in_features):
            raise ValueError(f"int4 weights need in_features % {INT4_INNER_K_TILES * 16} == 0 and out_features % 16"
                             f" == 0; got {out_features}x{in_features}")
        groups = weight.detach().float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        # The kernel dequantizes (q - 8) * scale + zero, so zero = low + 8 * scale; layout [in / 32, out, 2].
        scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(
            q.reshape(out_features, in_features), INT4_INNER_K_TILES))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = in_features, out_features

    def dequantized(self) -> torch.Tensor:
        """The dense weight [out, in] (float32) this map multiplies by: the kernel applied to the identity."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, INT4_GROUP, self.scales_and_zeros).T.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int8PerTokenLinear(nn.Module):
    """int8 weights [out, in] with one scale per output row, times int8 activations with one scale per row (token),
    through `torch._int_mm` (oneDNN; AMX/VNNI where the CPU has them). W8A8 "dynamic per-token", as vLLM and
    SmoothQuant name it.

    Why: the weight-only kernels above dequantize inside a loop over rows, so a 16-row verify costs ~6x a 1-row
    decode; an integer GEMM reads the weights once for all rows (measured flat from 1 to 16 rows). Row invariance
    is exact by construction: each row's scale is its own max |x|, the products are summed in int32 (integer sums
    do not depend on the order or blocking), and the rescaling is elementwise."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        # [out, in] contiguous, multiplied as its transpose: oneDNN's fastest layout for this product (measured).
        qweight, scale = int8_per_row(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = dtype

    def dequantized(self) -> torch.Tensor:
        """The dense weight [out, in] (float32); activations are quantized per row on top of it."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        row_scale = (rows.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        q = torch.round(rows / row_scale).clamp(-127, 127).to(torch.int8)
        out = torch._int_mm(q, self.qweight.t()).float().mul_(row_scale).mul_(self.scale)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(self.dtype).view(*x.shape[:-1], self.out_features)


def quantized_linear(layer: nn.Linear, bits: int, dtype: torch.dtype) -> nn.Module:
    """`layer` as a weight-only quantized map of `bits` (8 or 4; a shape the int4 kernel cannot take gets int8)."""
    if bits == 4 and int4_supported(layer.out_features, layer.in_features):
        return Int4WeightLinear(layer.weight, layer.bias, dtype)
    return Int8WeightLinear(layer.weight, layer.bias, dtype)
