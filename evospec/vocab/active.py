"""The active draft vocabulary A as a fixed-shape block of LM-head rows.

`row_ids[j]` is the full-vocabulary id scored by head row j (-1 = an unused dynamic slot, masked to -inf), so the
draft step has static shapes whatever the buffer holds. Static rows come first, dynamic slots after them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.pruned_head import gather_head_rows, pruned_logits


@dataclass
class ActiveVocab:
    row_ids: torch.Tensor  # [k] int64 full ids, -1 = unused slot
    head_rows: torch.Tensor  # [k, hidden]
    slot_valid: torch.Tensor | None  # [k] bool, None = every slot valid (no masking cost)
    num_static: int

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> [n, k] float32 logits over the active rows."""
        return pruned_logits(hidden, self.head_rows, self.slot_valid)

    @property
    def size(self) -> int:
        return int(self.row_ids.shape[0])

    def contains_mask(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: which full ids are in A."""
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.row_ids.device)
        mask[self.row_ids[self.row_ids >= 0]] = True
        return mask


def full_vocab(head_weight: torch.Tensor) -> ActiveVocab:
    """A = every row (method `sd`): no copy, the model's own head matrix."""
    ids = torch.arange(head_weight.shape[0], device=head_weight.device)
    return ActiveVocab(ids, head_weight, None, head_weight.shape[0])


def static_vocab(head_weight: torch.Tensor, static_ids: torch.Tensor, dynamic_slots: int = 0) -> ActiveVocab:
    """A = S (method `frspec`), plus `dynamic_slots` empty, masked rows for a dynamic buffer (method `evospec`)."""
    static_ids = static_ids.to(head_weight.device)
    rows = gather_head_rows(head_weight, static_ids)  # [K, hidden], gathered once
    if dynamic_slots == 0:
        return ActiveVocab(static_ids, rows, None, static_ids.shape[0])
    pad_rows = rows.new_zeros(dynamic_slots, rows.shape[1])
    pad_ids = torch.full((dynamic_slots,), -1, dtype=torch.long, device=static_ids.device)
    valid = torch.cat([torch.ones(static_ids.shape[0], dtype=torch.bool), torch.zeros(dynamic_slots, dtype=torch.bool)])
    return ActiveVocab(torch.cat([static_ids, pad_ids]), torch.cat([rows, pad_rows]), valid.to(static_ids.device),
                       static_ids.shape[0])
