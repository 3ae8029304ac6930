"""Linear maps in the operand order this machine runs faster: `linear(x, weight)` = x @ weightᵀ (+ bias).

Why: with MKL on some CPUs (measured on a 2-core AMD EPYC, AVX2, torch 2.13) a float32 `x @ Wᵀ` of 2-64 rows takes
the slow path of the BLAS: 4 rows through an 8960x1536 projection cost 18 ms where one row costs 4.7, so one target
forward of 5 tokens (a 4-token draft plus its root) cost 3.3x a forward of one, and speculation could never pay. The
same product computed weight-first, `(W @ xᵀ)ᵀ`, costs 4 ms for 4 rows (2-6x faster for 2-256 rows). On other
machines and dtypes (bf16 with native instructions, GPUs) the usual order can be the faster one. So the order is a
property of the machine, dtype and weight shape: measured once per (device, dtype, shape) on the first product of
that kind (a model's `warm_up` makes that happen at start-up), never assumed. One row always uses the usual order
(a matrix-vector product, memory-bound either way). Both orders compute the same sums; only rounding differs.
"""
from __future__ import annotations

import time

import torch

_WEIGHT_FIRST: dict[tuple, bool] = {}  # (device type, dtype, out, in) -> compute (W @ xᵀ)ᵀ for 2+ rows


def _weight_first_is_faster(weight: torch.Tensor, rows: int = 4, repeats: int = 3) -> bool:
    """Time both operand orders on `rows` random rows (best of `repeats`); weight-first must win by 10%."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    cost = {}
    for weight_first in (False, True):
        best = float("inf")
        for _ in range(repeats + 1):  # the first call of each order warms its kernel up
            start = time.perf_counter()
            _ = (weight @ x.T) if weight_first else (x @ weight.T)
            best = min(best, time.perf_counter() - start)
        cost[weight_first] = best
    return cost[True] < 0.9 * cost[False]


def weight_first(weight: torch.Tensor) -> bool:
    """Whether 2+ rows through `weight` [out, in] go faster weight-first on this machine (measured once per kind)."""
    if weight.device.type != "cpu":
        return False
    key = (weight.device.type, weight.dtype, *weight.shape)
    if key not in _WEIGHT_FIRST:
        with torch.no_grad():
            _WEIGHT_FIRST[key] = _weight_first_is_faster(weight)
    return _WEIGHT_FIRST[key]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in], weight: [out, in] -> [..., out] (contiguous), as `torch.nn.functional.linear`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] < 2 or not weight_first(weight):
        return torch.nn.functional.linear(x, weight, bias)
    out = (weight @ rows.T).T
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def project(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for a model's projection, through `linear` when it is a plain float `nn.Linear` (quantized and
    adapter-wrapped layers run their own forward)."""
    if type(layer) is torch.nn.Linear:
        return linear(x, layer.weight, layer.bias)
    return layer(x)


def linear_orders() -> dict[str, str]:
    """What was chosen so far, for logs and Info: {"float32 8960x1536": "weight-first" | "usual"}."""
    return {f"{str(dtype).removeprefix('torch.')} {out}x{inp}": ("weight-first" if first else "usual")
            for (_, dtype, out, inp), first in _WEIGHT_FIRST.items()}
