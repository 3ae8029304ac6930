"""How each method chooses the draft's active vocabulary, behind one interface (no method-string branching).

A `VocabPolicy` is built once per engine and method; `new_session` gives the per-generation `SessionVocab`, whose
`active` head the draft scores and whose `observe` hook sees every verified step (the place where EvoSpec's
dynamic buffer learns). Updates happen only in `observe`, i.e. between steps, never between drafting a tree and
verifying it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from evospec.verify import VerifyResult
from evospec.vocab.active import ActiveVocab, full_vocab, static_vocab


class SessionVocab(Protocol):
    active: ActiveVocab

    def observe(self, result: VerifyResult, buffer_update: "list[int] | None" = None) -> None: ...


class VocabPolicy(Protocol):
    def new_session(self, prompt_ids: list[int]) -> SessionVocab: ...


class FixedSessionVocab:
    """A session whose active vocabulary never changes (sd, frspec)."""

    def __init__(self, active: ActiveVocab):
        self.active = active

    def observe(self, result: VerifyResult, buffer_update: list[int] | None = None) -> None:
        return None


class FullVocabPolicy:
    """`sd`: the draft scores all rows."""

    def __init__(self, head_weight: torch.Tensor):
        self._active = full_vocab(head_weight)

    def new_session(self, prompt_ids: list[int]) -> SessionVocab:
        return FixedSessionVocab(self._active)


class StaticVocabPolicy:
    """`frspec`: the draft scores the K static rows, gathered once and shared by every session (read-only)."""

    def __init__(self, head_weight: torch.Tensor, static_ids: torch.Tensor):
        self._active = static_vocab(head_weight, static_ids)

    def new_session(self, prompt_ids: list[int]) -> SessionVocab:
        return FixedSessionVocab(self._active)
