"""How each method chooses the draft's active vocabulary, behind one interface (no method-string branching).

A `VocabPolicy` is built once per server and method; `new_session` gives the per-generation `SessionVocab`, whose
`active` head the draft scores and whose `observe` hook sees every verified step. Buffer updates are applied only in
`observe`, i.e. between steps: never between drafting a tree and verifying it (EvoSpec computes them meanwhile).
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import torch
from torch import nn

from evospec.verify import VerifyResult
from evospec.vocab.active import ActiveIds, ActiveVocab, static_vocab
from evospec.vocab.dynamic import DynamicBuffer, SlotChange
from evospec.vocab.retrieval import (
    CoocIndex,
    EmbeddingIndex,
    NeighbourIndex,
    SemanticRetriever,
    StatisticalRetriever,
    TargetFeedback,
)


class SessionVocab(Protocol):
    active: ActiveVocab
    restricted: bool  # A is a strict subset of the vocabulary (misses are possible)
    wants_target_feedback: bool  # observe() uses the target's full-vocabulary view of verified positions
    initial_changes: list[SlotChange]  # buffer fill from the prompt, before the first tree
    source_of: Mapping[int, str]  # ids of D as drafted now -> the retrieval source that put them there

    def in_active(self) -> torch.Tensor: ...  # [V] bool

    def observe(self, result: VerifyResult, feedback: TargetFeedback | None) -> list[SlotChange]: ...

    def close(self) -> None: ...  # the generation ended: drop work in flight


class VocabPolicy(Protocol):
    def new_session(self, prompt_ids: list[int]) -> SessionVocab: ...


class FixedSessionVocab:
    """A session whose active vocabulary never changes (sd, frspec)."""

    def __init__(self, active: ActiveVocab, vocab_size: int):
        self.active = active
        self.restricted = active.size < vocab_size
        self.wants_target_feedback = False
        self.initial_changes: list[SlotChange] = []
        self.source_of: Mapping[int, str] = {}
        self._mask = active.contains_mask(vocab_size)

    def in_active(self) -> torch.Tensor:
        return self._mask

    def observe(self, result: VerifyResult, feedback: TargetFeedback | None) -> list[SlotChange]:
        return []

    def close(self) -> None:
        return None


class FixedVocabPolicy:
    """`sd` (every row) and `frspec` (the K static rows): one read-only active vocabulary, its rows gathered once
    and shared by every session."""

    def __init__(self, active: ActiveVocab, vocab_size: int):
        self._session = FixedSessionVocab(active, vocab_size)

    def new_session(self, prompt_ids: list[int]) -> SessionVocab:
        return self._session


SOURCES = ("statistical", "semantic", "target")  # where a buffer id came from (hits are counted per source)


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
    semantic_every: int = 8  # steps between semantic queries (each is a scan of the long-tail embedding pool)
    semantic_k: int = 32
    # Online calibration of the draft head (a bias-only adapter): ids that retrieval guessed but the target has not
    # confirmed get this logit offset; it goes to 0 once the target commits the id or reports it likely. Measured:
    # without it the tiny draft over-proposes long-tail context tokens and greedy τ falls to sd's level.
    unconfirmed_bias: float = -3.0
    # 1 = a step's buffer update (retrieval, ranking, merge) runs on a worker thread while the next tree is drafted
    # and verified, and is applied one step later; 0 = computed and applied at once, on the draft's critical path.
    # Either way changes land only between steps, in the order they were computed (the buffer is a function of the
    # committed history, not of timing), so outputs do not depend on it beyond one step of staleness.
    update_lag: int = 1
    update_timeout_s: float = 30.0  # a worker that has not finished a step's update by then fails the session

    def __post_init__(self):
        if self.update_lag not in (0, 1):
            raise ValueError(f"update_lag must be 0 (inline) or 1 (one step later); got {self.update_lag}")


class EvoSpecPolicy:
    """`evospec`: static rows shared, plus a per-session dynamic buffer fed by statistical, semantic and target
    retrieval. Shared, built once: the long-tail mask (∉ S, trained rows only); given by the server and shared by
    every policy: the embedding index, the co-occurrence index and the buffer worker thread."""

    def __init__(self, head_weight: torch.Tensor, static_ids: torch.Tensor, settings: EvoSpecSettings,
                 cooc: CoocIndex | None = None, index: NeighbourIndex | None = None,
                 worker: Executor | None = None, quantized_head: nn.Module | None = None):
        self.head_weight = head_weight
        self.settings = settings
        self.static = static_vocab(head_weight, static_ids, quantized_head)
        vocab = head_weight.shape[0]
        in_static = torch.zeros(vocab, dtype=torch.bool)
        in_static[static_ids.cpu()] = True
        self.long_tail = ~in_static & trained_rows(head_weight)  # [V]
        self.long_tail_list = self.long_tail.tolist()  # fast per-token lookups
        if settings.use_semantic and index is None:
            index = EmbeddingIndex(head_weight, self.long_tail.nonzero()[:, 0])
        self.index = index if settings.use_semantic else None
        self.cooc = cooc
        # a policy built without the server's worker (tests, tools) gets its own thread, idle when unused
        self.worker = worker if worker is not None or settings.update_lag == 0 else buffer_worker()

    def new_session(self, prompt_ids: list[int]) -> "EvoSessionVocab":
        return EvoSessionVocab(self, prompt_ids)


def buffer_worker() -> Executor:
    """The thread that computes buffer updates off the draft's critical path (one per server: updates are small and
    each session has at most one in flight, so the queue is bounded by the number of sessions)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="evospec-buffer")


def trained_rows(head_weight: torch.Tensor) -> torch.Tensor:
    """[V] bool: rows that differ from the last row. Qwen3 pads its vocabulary (151,669 tokens, 151,936 rows) and
    untrained rows share one value (zero, or the tiny pair's shared `unseen_row`), so rows identical to the last
    padding row are untrained and never useful buffer candidates."""
    w = head_weight.detach()
    return (w != w[-1]).any(dim=-1).cpu()


@dataclass(frozen=True)
class BufferDelta:
    """One step's buffer update, computed (possibly on the worker) from the buffer's own state: the slot changes
    (with the source of each new id), each new row's logit bias, and the slots the target just vouched for."""
    changes: list[SlotChange]
    biases: list[float]
    confirmed_slots: list[int]


class EvoSessionVocab:
    """One generation's A = S ∪ D. Two states: the *buffer* (retrievers + DynamicBuffer, touched only by the update
    job, on the worker when update_lag = 1) and the *applied* A the draft scores (active rows, membership mask, the
    source of each dynamic id; touched only between steps, on the draft's thread)."""
    restricted = True

    def __init__(self, policy: EvoSpecPolicy, prompt_ids: list[int]):
        s = policy.settings
        self.policy = policy
        self.wants_target_feedback = s.use_target
        self.active = policy.static.with_dynamic_slots(policy.head_weight, s.dynamic_size)
        self.ids = ActiveIds(self.active.row_ids, self.active.num_static, policy.head_weight.shape[0])  # applied
        self.buffer = DynamicBuffer(s.dynamic_size, s.min_residency, s.buffer_decay)
        self.stat = StatisticalRetriever(policy.long_tail_list, s.stat_decay, policy.cooc) if s.use_statistical \
            else None
        self.semantic = SemanticRetriever(policy.index, policy.long_tail, k=s.semantic_k) if s.use_semantic else None
        self.tokens = list(prompt_ids)
        self.step = 0
        self._pending: Future | None = None
        self.initial_changes = self._apply(self._update(prompt_ids, self.tokens, None, 0,
                                                        semantic=self.semantic is not None, generated=False))

    def in_active(self) -> torch.Tensor:
        return self.ids.mask

    @property
    def source_of(self) -> dict[int, str]:
        """Applied: dynamic id -> the source that put it in D."""
        return self.ids.source_of

    def observe(self, result: VerifyResult, feedback: TargetFeedback | None) -> list[SlotChange]:
        """Between steps: apply the update that is due, start this step's update. -> the slot changes applied now
        (the target mirrors them before the next tree)."""
        self.step += 1
        self.tokens.extend(result.committed_tokens)
        settings = self.policy.settings
        semantic = self.semantic is not None and self.step % settings.semantic_every == 0
        recent = self.tokens[-self.semantic.window:] if semantic else []
        job = partial(self._update, list(result.committed_tokens), recent, feedback, self.step, semantic, True)
        if settings.update_lag == 0:
            return self._apply(job())
        due = self._pending.result(timeout=settings.update_timeout_s) if self._pending is not None else None
        changes = self._apply(due) if due is not None else []
        self._pending = self.policy.worker.submit(job)  # after applying: the job would contend for the GIL
        return changes

    def close(self) -> None:
        """Cancel the update in flight if the worker has not started it (a started one finishes, unread)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def _update(self, new_tokens: list[int], recent: list[int], feedback: TargetFeedback | None, step: int,
                semantic: bool, generated: bool) -> BufferDelta:
        """Retrieval, ranking and merge for one step (the buffer's state only). -> what to apply to A."""
        candidates: dict[int, tuple[float, str]] = {}  # id -> (score, source of the best score)

        def offer(scored: dict[int, float], source: str) -> None:
            for tok, score in scored.items():
                if self.policy.long_tail_list[tok] and score > candidates.get(tok, (-1.0, ""))[0]:
                    candidates[tok] = (score, source)
        if self.stat is not None:
            self.stat.observe(new_tokens)
            offer(self.stat.candidates(self.policy.settings.stat_candidates), "statistical")
        if semantic:
            offer(self.semantic.candidates(recent), "semantic")
        if feedback is not None:  # ids outside A when drafted; top priority
            offer(feedback.candidates, "target")
        changes = self.buffer.merge({t: score for t, (score, _) in candidates.items()}, step)
        confirmed = set(feedback.candidates) if feedback is not None else set()
        if generated:  # the target committed these tokens: confirmed
            confirmed.update(new_tokens)
        penalty = self.policy.settings.unconfirmed_bias
        return BufferDelta([replace(c, source=candidates[c.token_id][1]) for c in changes],
                           [0.0 if c.token_id in confirmed else penalty for c in changes],
                           [self.buffer.slot_of[t] for t in confirmed if t in self.buffer])

    def _apply(self, delta: BufferDelta) -> list[SlotChange]:
        """A delta into A's ids, membership mask and sources (`ActiveIds.apply`) and its rows (one gather of the
        changed rows)."""
        changes = delta.changes
        if changes:
            self.ids.apply(changes)
            self.active.set_dynamic_many(self.policy.head_weight, [c.slot for c in changes],
                                         [c.token_id for c in changes], delta.biases)
        if delta.confirmed_slots:  # residents the target just vouched for lose their penalty
            self.active.dynamic_bias[torch.tensor(delta.confirmed_slots, dtype=torch.long)] = 0.0
        return changes
