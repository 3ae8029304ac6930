"""How each method chooses the draft's active vocabulary, behind one interface (no method-string branching).

A `VocabPolicy` is built once per server and method; `new_session` gives the per-generation `SessionVocab`, whose
`active` head the draft scores and whose `observe` hook sees every verified step. Buffer updates happen only in
`observe`, i.e. between steps: never between drafting a tree and verifying it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from evospec.verify import VerifyResult
from evospec.vocab.active import ActiveVocab, static_vocab
from evospec.vocab.dynamic import DynamicBuffer, SlotChange
from evospec.vocab.retrieval import (
    CoocIndex,
    ExactEmbeddingIndex,
    SemanticRetriever,
    StatisticalRetriever,
    TargetFeedback,
)


class SessionVocab(Protocol):
    active: ActiveVocab
    restricted: bool  # A is a strict subset of the vocabulary (misses are possible)
    wants_target_feedback: bool  # observe() uses the target's full-vocabulary view of verified positions
    initial_changes: list[SlotChange]  # buffer fill from the prompt, before the first tree

    def in_active(self) -> torch.Tensor: ...  # [V] bool

    def observe(self, result: VerifyResult, feedback: TargetFeedback | None) -> list[SlotChange]: ...


class VocabPolicy(Protocol):
    def new_session(self, prompt_ids: list[int]) -> SessionVocab: ...


class FixedSessionVocab:
    """A session whose active vocabulary never changes (sd, frspec)."""

    def __init__(self, active: ActiveVocab, vocab_size: int):
        self.active = active
        self.restricted = active.size < vocab_size
        self.wants_target_feedback = False
        self.initial_changes: list[SlotChange] = []
        self._mask = active.contains_mask(vocab_size)

    def in_active(self) -> torch.Tensor:
        return self._mask

    def observe(self, result: VerifyResult, feedback: TargetFeedback | None) -> list[SlotChange]:
        return []


class FixedVocabPolicy:
    """`sd` (every row) and `frspec` (the K static rows): one read-only active vocabulary, its rows gathered once
    and shared by every session."""

    def __init__(self, active: ActiveVocab, vocab_size: int):
        self._session = FixedSessionVocab(active, vocab_size)

    def new_session(self, prompt_ids: list[int]) -> SessionVocab:
        return self._session


@dataclass(frozen=True)
class EvoSpecSettings:
    dynamic_size: int = 256
    use_statistical: bool = True
    use_semantic: bool = True
    use_target: bool = True
    min_residency: int = 4
    buffer_decay: float = 0.9
    stat_decay: float = 0.95
    stat_candidates: int = 64
    semantic_every: int = 8  # steps between semantic queries (they cost a [q, pool] matmul)
    semantic_k: int = 32
    # Online calibration of the draft head (a bias-only adapter): ids that retrieval guessed but the target has not
    # confirmed get this logit offset; it goes to 0 once the target commits the id or reports it likely. Measured:
    # without it the tiny draft over-proposes long-tail context tokens and greedy τ falls to sd's level.
    unconfirmed_bias: float = -3.0


class EvoSpecPolicy:
    """`evospec`: static rows shared, plus a per-session dynamic buffer fed by statistical, semantic and target
    retrieval. Shared, built once: the long-tail mask (∉ S, trained rows only), the embedding index, co-occurrence."""

    def __init__(self, head_weight: torch.Tensor, static_ids: torch.Tensor, settings: EvoSpecSettings,
                 cooc: CoocIndex | None = None):
        self.head_weight = head_weight
        self.settings = settings
        self.static = static_vocab(head_weight, static_ids)
        vocab = head_weight.shape[0]
        in_static = torch.zeros(vocab, dtype=torch.bool)
        in_static[static_ids.cpu()] = True
        self.long_tail = ~in_static & trained_rows(head_weight)  # [V]
        self.long_tail_list = self.long_tail.tolist()  # fast per-token lookups
        self.index = ExactEmbeddingIndex(head_weight.detach(), self.long_tail.nonzero()[:, 0]) \
            if settings.use_semantic else None
        self.cooc = cooc

    def new_session(self, prompt_ids: list[int]) -> "EvoSessionVocab":
        return EvoSessionVocab(self, prompt_ids)


def trained_rows(head_weight: torch.Tensor) -> torch.Tensor:
    """[V] bool: rows that differ from the last row. Qwen3 pads its vocabulary (151,669 tokens, 151,936 rows) and
    untrained rows share one value (zero, or the tiny pair's shared `unseen_row`), so rows identical to the last
    padding row are untrained and never useful buffer candidates."""
    w = head_weight.detach()
    return (w != w[-1]).any(dim=-1).cpu()


class EvoSessionVocab:
    restricted = True

    def __init__(self, policy: EvoSpecPolicy, prompt_ids: list[int]):
        s = policy.settings
        self.policy = policy
        self.wants_target_feedback = s.use_target
        self.active = policy.static.with_dynamic_slots(policy.head_weight, s.dynamic_size)
        self.buffer = DynamicBuffer(s.dynamic_size, s.min_residency, s.buffer_decay)
        self.stat = StatisticalRetriever(policy.long_tail_list, s.stat_decay, policy.cooc) if s.use_statistical \
            else None
        self.semantic = SemanticRetriever(policy.head_weight.detach(), policy.index, policy.long_tail,
                                          k=s.semantic_k) if s.use_semantic else None
        self.tokens = list(prompt_ids)
        self.step = 0
        self._mask = self.active.contains_mask(policy.head_weight.shape[0])
        self.initial_changes = self._merge(prompt_ids, None, semantic=True, generated=False)

    def in_active(self) -> torch.Tensor:
        return self._mask

    def observe(self, result: VerifyResult, feedback: TargetFeedback | None) -> list[SlotChange]:
        self.step += 1
        self.tokens.extend(result.committed_tokens)
        semantic = self.step % self.policy.settings.semantic_every == 0
        return self._merge(result.committed_tokens, feedback, semantic, generated=True)

    def _merge(self, new_tokens: list[int], feedback: TargetFeedback | None, semantic: bool,
               generated: bool) -> list[SlotChange]:
        candidates: dict[int, float] = {}
        if self.stat is not None:
            self.stat.observe(new_tokens)
            candidates.update(self.stat.candidates(self.policy.settings.stat_candidates))
        if semantic and self.semantic is not None:
            for tok, score in self.semantic.candidates(self.tokens).items():
                candidates[tok] = max(candidates.get(tok, 0.0), score)
        if feedback is not None:  # ids outside A by construction; top priority
            for tok, score in feedback.candidates.items():
                candidates[tok] = max(candidates.get(tok, 0.0), score)
        changes = self.buffer.merge({t: s for t, s in candidates.items() if not self._in_static(t)}, self.step)
        confirmed = set(feedback.candidates) if feedback is not None else set()
        if generated:  # the target committed these tokens: confirmed
            confirmed.update(t for t in new_tokens if t in self.buffer)
        self.apply(changes, confirmed)
        for tok in confirmed:  # residents the target just vouched for lose their penalty
            slot = self.buffer.slot_of.get(tok)
            if slot is not None:
                self.active.dynamic_bias[slot] = 0.0
        return changes

    def _in_static(self, tok: int) -> bool:
        return bool(self._mask[tok]) and tok not in self.buffer

    def apply(self, changes: list[SlotChange], confirmed: set[int]) -> None:
        """The merge's slot changes into A's rows (one gather) and the membership mask."""
        if not changes:
            return
        penalty = self.policy.settings.unconfirmed_bias
        self.active.set_dynamic_many(self.policy.head_weight, [c.slot for c in changes],
                                     [c.token_id for c in changes],
                                     [0.0 if c.token_id in confirmed else penalty for c in changes])
        self._mask[torch.tensor([c.evicted for c in changes if c.evicted >= 0], dtype=torch.long)] = False
        self._mask[torch.tensor([c.token_id for c in changes if c.token_id >= 0], dtype=torch.long)] = True
