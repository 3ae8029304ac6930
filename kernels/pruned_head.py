"""LM head restricted to a subset of the vocabulary (FR-Spec / EvoSpec draft head).

The rows of the (tied) embedding matrix are gathered once into a contiguous [k, hidden] matrix, so each draft step
costs k * hidden instead of vocab * hidden multiply-adds. Logits come back over the subset; `row_ids` maps a
subset index to its full-vocabulary token id.
"""
from __future__ import annotations

import torch
from torch import nn

from evospec.kernels.linear import linear


def gather_head_rows(head_weight: torch.Tensor, row_ids: torch.Tensor,
                     quantized_head: nn.Module | None = None) -> torch.Tensor | nn.Module:
    """head_weight: [vocab, hidden], row_ids: [k] -> [k, hidden] contiguous copy (done once, not per step); or, given
    the model's quantized LM head as a map that can gather rows (kernels/kquant.py KQuantLinear.rows: a draft in
    format gguf), that map restricted to row_ids: a quarter of the bytes per draft step for Q8_0 blocks."""
    if quantized_head is not None and hasattr(quantized_head, "rows"):
        return quantized_head.rows(row_ids.to(torch.long))
    return head_weight.index_select(0, row_ids).contiguous()


def head_product(hidden: torch.Tensor, rows: torch.Tensor | nn.Module) -> torch.Tensor:
    """hidden: [n, hidden] x rows: [k, hidden] -> [n, k], in the operand order that is faster on this machine
    (kernels/linear.py). Rows are a contiguous [k, hidden] matrix, or a map gathered by gather_head_rows."""
    if isinstance(rows, nn.Module):
        return rows(hidden)
    return linear(hidden, rows)


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
