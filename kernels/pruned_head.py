"""LM head restricted to a subset of the vocabulary (FR-Spec / EvoSpec draft head).

The rows of the (tied) embedding matrix are gathered once into a contiguous [k, hidden] matrix, so each draft step
costs k * hidden instead of vocab * hidden multiply-adds. Logits come back over the subset; `row_ids` maps a
subset index to its full-vocabulary token id.
"""
from __future__ import annotations

import torch


def gather_head_rows(head_weight: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
    """head_weight: [vocab, hidden], row_ids: [k] -> [k, hidden] contiguous copy (done once, not per step)."""
    return head_weight.index_select(0, row_ids).contiguous()


_WEIGHT_FIRST: dict[tuple[torch.dtype, str], bool] = {}  # (dtype, device type) -> compute rows @ hidden.T


def _weight_first_is_faster(rows: torch.Tensor) -> bool:
    """Time both operand orders of the head product on a few rows. A kernel property of the machine and dtype:
    measured here, fp32 `rows @ hidden.T` is 2-5x faster than `hidden @ rows.T` for 2-64 rows; in bf16 the reverse."""
    import time
    cost = {}
    for weight_first in (False, True):
        h = torch.randn(4, rows.shape[1], dtype=rows.dtype, device=rows.device)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            _ = (rows @ h.T) if weight_first else (h @ rows.T)
            best = min(best, time.perf_counter() - start)
        cost[weight_first] = best
    return cost[True] < 0.9 * cost[False]


def head_product(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """hidden: [n, hidden] x rows: [k, hidden] -> [n, k], in the operand order that is faster on this machine
    (chosen once per dtype on the CPU; the usual order on GPUs). Rows are a contiguous [k, hidden] matrix."""
    if rows.device.type != "cpu" or hidden.shape[0] < 2:
        return hidden @ rows.T
    key = (rows.dtype, rows.device.type)
    if key not in _WEIGHT_FIRST:
        _WEIGHT_FIRST[key] = _weight_first_is_faster(rows)
    return (rows @ hidden.T).T if _WEIGHT_FIRST[key] else hidden @ rows.T


def pruned_logits(hidden: torch.Tensor, head_rows: torch.Tensor, slot_valid: torch.Tensor | None = None) -> torch.Tensor:
    """hidden: [n, hidden], head_rows: [k, hidden] -> logits [n, k] (float32).

    slot_valid: optional [k] bool; invalid slots (unused dynamic-buffer rows) get -inf so the shape stays static.
    """
    logits = head_product(hidden, head_rows).float()
    if slot_valid is not None:
        logits = logits.masked_fill(~slot_valid, float("-inf"))
    return logits


def scatter_to_full_vocab(subset_values: torch.Tensor, row_ids: torch.Tensor, vocab_size: int,
                          fill: float = 0.0) -> torch.Tensor:
    """subset_values: [..., k] over row_ids [k] -> [..., vocab_size], `fill` elsewhere.

    Rows with id < 0 (unused slots) are dropped.
    """
    keep = row_ids >= 0
    out = subset_values.new_full((*subset_values.shape[:-1], vocab_size), fill)
    out[..., row_ids[keep]] = subset_values[..., keep]
    return out
