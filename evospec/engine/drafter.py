"""Where the target's trees come from: the `Drafter` interface of the step loop.

`LocalDrafter` runs the draft engine in this process; `services/target/remote_draft.py` implements the same
interface over the draft<->target gRPC stream. Either way the target side measures misses and target-fed buffer
candidates (it alone sees full-vocabulary logits) and the draft side applies buffer updates, between steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from evospec.config import SamplingParams, SpecParams
from evospec.engine.draft import DraftEngine, DraftSession
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.tree import DraftTree
from evospec.vocab.retrieval import TargetFeedback, target_feedback


@dataclass(frozen=True)
class DraftRequest:
    """What opening a draft session for one generation needs."""
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecParams
    max_len: int  # tokens the session may commit: prompt + max_tokens + one tree + 2
    seed: int  # the draft's own generator seed (evospec.config.draft_seed of the request's)


class Drafter(Protocol):
    def propose(self) -> DraftTree: ...

    def observe(self, verified: VerifiedStep, stats: SpecStats) -> None: ...

    def close(self) -> None: ...


DrafterFactory = Callable[[DraftRequest], Drafter]


def feedback_for(verified: VerifiedStep, in_active, with_candidates: bool, stats: SpecStats) -> TargetFeedback:
    """Target side of a step's vocabulary feedback: misses into stats, candidates for the buffer."""
    fb = target_feedback(verified.target_logits, verified.result.committed_tokens, in_active, with_candidates)
    stats.misses += fb.misses
    stats.verified_positions += fb.positions
    return fb


class NoDrafter:
    """`ar`: empty trees, so each step is one plain autoregressive target forward."""

    def propose(self) -> DraftTree:
        return DraftTree.empty()

    def observe(self, verified: VerifiedStep, stats: SpecStats) -> None:
        return None

    def close(self) -> None:
        return None


class LocalDrafter:
    def __init__(self, engine: DraftEngine, session: DraftSession):
        self.engine, self.session = engine, session

    def propose(self) -> DraftTree:
        return self.engine.propose(self.session)

    def observe(self, verified: VerifiedStep, stats: SpecStats) -> None:
        vocab = self.session.vocab
        start = time.perf_counter()
        fb = feedback_for(verified, vocab.in_active(), vocab.wants_target_feedback, stats) if vocab.restricted \
            else None
        changes = self.engine.advance(self.session, verified.result, fb)
        stats.buffer_updates += sum(1 for c in changes if c.token_id >= 0)
        stats.buffer_update_seconds += time.perf_counter() - start
        stats.draft_head_seconds = self.session.head_seconds

    def close(self) -> None:
        return None
