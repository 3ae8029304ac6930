"""The active draft vocabulary A = S ∪ D as fixed-shape blocks of LM-head rows.

Static rows (S, or every row for `sd`) are gathered once and shared read-only by all sessions; an optional dynamic
block of `Dyna` rows is per session (EvoSpec's buffer D). `row_ids[j]` is the full-vocabulary id scored by column j
of the logits (-1 = an unused dynamic slot, masked to -inf), so the draft step has static shapes whatever D holds.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from evospec.kernels.pruned_head import gather_head_rows, pruned_logits


@dataclass
class ActiveVocab:
    row_ids: torch.Tensor  # [K + Dyna] int64 full ids, -1 = unused slot
    static_rows: torch.Tensor | nn.Module  # [K, hidden] shared, or a quantized map of those rows (gather_head_rows)
    dynamic_rows: torch.Tensor | None = None  # [Dyna, hidden] per session
    dynamic_valid: torch.Tensor | None = None  # [Dyna] bool
    dynamic_bias: torch.Tensor | None = None  # [Dyna] float logit offsets (unconfirmed long-tail ids start negative)

    @property
    def num_static(self) -> int:
        rows = self.static_rows
        return int(rows.out_features if isinstance(rows, nn.Module) else rows.shape[0])

    @property
    def size(self) -> int:
        return int(self.row_ids.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> [n, K + Dyna] float32 logits over the active rows."""
        return self.with_dynamic(hidden, pruned_logits(hidden, self.static_rows))

    def with_dynamic(self, hidden: torch.Tensor, static_logits: torch.Tensor) -> torch.Tensor:
        """Static logits [n, K] -> [n, K + Dyna] with this session's dynamic block appended."""
        if self.dynamic_rows is None:
            return static_logits
        dynamic = pruned_logits(hidden, self.dynamic_rows, self.dynamic_valid) + self.dynamic_bias
        return torch.cat([static_logits, dynamic], dim=-1)

    def contains_mask(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: which full ids are in A."""
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.row_ids.device)
        mask[self.row_ids[self.row_ids >= 0]] = True
        return mask

    def with_dynamic_slots(self, head_weight: torch.Tensor, slots: int) -> "ActiveVocab":
        """A per-session copy with `slots` empty dynamic rows (static rows still shared)."""
        empty_ids = torch.full((slots,), -1, dtype=torch.long, device=self.row_ids.device)
        return ActiveVocab(torch.cat([self.row_ids[: self.num_static], empty_ids]), self.static_rows,
                           head_weight.new_zeros(slots, head_weight.shape[1]),
                           torch.zeros(slots, dtype=torch.bool, device=head_weight.device),
                           torch.zeros(slots, dtype=torch.float32, device=head_weight.device))

    def set_dynamic_many(self, head_weight: torch.Tensor, slots: list[int], token_ids: list[int],
                         biases: list[float]) -> None:
        """Several dynamic slots at once (distinct slots; token id -1 empties one): one gather of the changed rows."""
        if not slots:
            return
        device = self.row_ids.device
        slot_t = torch.tensor(slots, device=device)  # [c]
        ids_t = torch.tensor(token_ids, device=device)  # [c]
        valid = ids_t >= 0
        self.row_ids[self.num_static + slot_t] = ids_t
        self.dynamic_rows[slot_t[valid]] = head_weight[ids_t[valid]]  # [c', hidden]
        self.dynamic_valid[slot_t] = valid
        self.dynamic_bias[slot_t] = torch.tensor(biases, dtype=torch.float32, device=device)


class ActiveIds:
    """Which full ids A holds, slot by slot: `row_ids` ([K + Dyna] int64: the static prefix, then the dynamic slots;
    -1 = an empty slot), the membership `mask` ([vocab_size] bool) and the retrieval source of each dynamic id
    (`source_of`). `apply` keeps them in step with the dynamic buffer's slot changes: the one routine for the draft's
    own A (EvoSessionVocab, which shares `row_ids` with its ActiveVocab) and the target's mirror of it
    (services/target/remote_draft.py)."""

    def __init__(self, row_ids: torch.Tensor, num_static: int, vocab_size: int):
        self.row_ids = row_ids
        self.num_static = num_static
        self.dynamic_ids: list[int] = row_ids[num_static:].tolist()  # the dynamic slots' ids, read without a sync
        self.mask = torch.zeros(vocab_size, dtype=torch.bool, device=row_ids.device)
        self.mask[row_ids[row_ids >= 0]] = True
        self.source_of: dict[int, str] = {}

    def apply(self, changes: Iterable) -> None:
        """Slot changes in order (each with the dynamic `slot`, its new `token_id`, -1 = emptied, and the `source`
        that proposed it: a SlotChange or its proto). A slot may change more than once (replies can carry several
        updates); the ids that leave go out of the mask and the sources before the ids that stay come in."""
        last: dict[int, object] = {}  # slot -> its last change
        leaving: list[int] = []
        for change in changes:
            old = self.dynamic_ids[change.slot]
            if old >= 0:
                leaving.append(old)
            self.dynamic_ids[change.slot] = change.token_id
            last[change.slot] = change
        if not last:
            return
        device = self.row_ids.device
        slots, ids = list(last), [last[slot].token_id for slot in last]
        if leaving:
            self.mask[torch.tensor(leaving, dtype=torch.long, device=device)] = False
        self.row_ids[torch.tensor(slots, dtype=torch.long, device=device) + self.num_static] = \
            torch.tensor(ids, dtype=torch.long, device=device)
        self.mask[torch.tensor([t for t in ids if t >= 0], dtype=torch.long, device=device)] = True
        for token_id in leaving:
            self.source_of.pop(token_id, None)
        for change in last.values():
            if change.token_id >= 0:
                self.source_of[change.token_id] = change.source


def full_vocab(head_weight: torch.Tensor) -> ActiveVocab:
    """A = every row (method `sd`): no copy, the model's own head matrix."""
    return ActiveVocab(torch.arange(head_weight.shape[0], device=head_weight.device), head_weight)


def static_vocab(head_weight: torch.Tensor, static_ids: torch.Tensor,
                 quantized_head: nn.Module | None = None) -> ActiveVocab:
    """A = S (method `frspec`; EvoSpec adds dynamic slots per session with `with_dynamic_slots`). quantized_head:
    the draft's quantized LM head, whose rows the static block reads where it can (gather_head_rows)."""
    static_ids = static_ids.to(head_weight.device)
    return ActiveVocab(static_ids.clone(), gather_head_rows(head_weight, static_ids, quantized_head))  # once


def batched_logits(hiddens: list[torch.Tensor], actives: list[ActiveVocab]) -> list[torch.Tensor]:
    """Several sessions' draft logits (hiddens[i]: [n_i, hidden] scored over actives[i]) with one matmul per shared
    static block: reading the head's rows dominates a draft step, and sessions of one method and static size share
    them, so a batch reads them once per tree level instead of once per session."""
    groups: dict[int, list[int]] = {}
    for i, active in enumerate(actives):
        groups.setdefault(id(active.static_rows), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(actives)
    for members in groups.values():
        static = pruned_logits(torch.cat([hiddens[i] for i in members]), actives[members[0]].static_rows)
        offset = 0
        for i in members:
            n = hiddens[i].shape[0]
            out[i] = actives[i].with_dynamic(hiddens[i], static[offset:offset + n])
            offset += n
    return out
