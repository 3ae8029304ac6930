"""Where the target's trees come from: the `Drafter` interface of the step loop.

`LocalDrafter` runs the draft engine in this process; `services/target/remote_draft.py` implements the same
interface over the draft<->target gRPC stream. Either way the target side measures misses and target-fed buffer
candidates (it alone sees full-vocabulary logits) and the draft side applies buffer updates, between steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from evospec.adapt.signal import teacher_signal
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.draft import DraftEngine, DraftSession
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.errors import OverloadedError
from evospec.model import KVArena
from evospec.tree import DraftTree
from evospec.vocab.registry import VocabPolicies
from evospec.vocab.retrieval import TargetFeedback, target_feedbacks


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


@dataclass(frozen=True)
class FeedbackRequest:
    """One request's step, for the target side of its vocabulary feedback."""
    verified: VerifiedStep
    in_active: torch.Tensor  # [V] bool: the A its tree was drafted with
    with_candidates: bool  # target-fed retrieval: candidates for its buffer
    stats: SpecStats
    source_of: Mapping[int, str]  # dynamic id -> the source that put it in D


def feedbacks_for(requests: list[FeedbackRequest]) -> list[TargetFeedback]:
    """Target side of a step's vocabulary feedback, for every request of the step at once (one host
    synchronisation on an accelerator: `target_feedbacks`): misses (committed tokens outside A) and buffer hits
    (committed tokens in D, by source) into each request's stats; candidates for the buffers."""
    feedbacks = target_feedbacks([r.verified.target_logits for r in requests],
                                 [r.verified.result.committed_tokens for r in requests],
                                 [r.in_active for r in requests], [r.with_candidates for r in requests])
    for request, fb in zip(requests, feedbacks):
        request.stats.misses += fb.misses
        request.stats.verified_positions += fb.positions
        for tok in request.verified.result.committed_tokens:
            source = request.source_of.get(tok)
            if source:
                request.stats.count_buffer_hit(source)
    return feedbacks


class BatchDrafter(Protocol):
    """Where the batching scheduler's trees come from: every session of a target replica, stepped together.
    Keys are the scheduler's session keys; a per-session failure comes back as that session's exception."""

    def available(self) -> bool:
        """Whether `open` can be expected to succeed now (the scheduler resumes dropped drafts only then)."""

    def open(self, key: str, request: DraftRequest) -> None: ...

    def propose(self, requests: dict[str, TreeParams], prefills: dict[str, int]) -> dict[str, DraftTree | Exception]:
        """Trees for `requests` (each clipped to the given shape); `prefills` = context tokens to cache meanwhile."""

    def prefill(self, prefills: dict[str, int]) -> dict[str, Exception]:
        """Context tokens to cache, in a step that wants no tree: a remote draft works on them while the target
        runs its step (only failures come back, now or with a later exchange)."""

    def observe(self, steps: dict[str, tuple[VerifiedStep, SpecStats]]) -> None: ...

    def flush(self) -> None:
        """End of an engine step: deliver what `observe` and `close` queued (a remote drafter sends it now)."""

    def close(self, key: str) -> None: ...


def observe_locally(engine: DraftEngine, steps: list[tuple[DraftSession, VerifiedStep, SpecStats]]) -> None:
    """In-process feedback of verified steps: misses and candidates (target side, all sessions at once), the teacher
    signal when the draft adapts (a direct call: the same object the service sends in its frames), commit and buffer
    update. The feedback's time is shared evenly among the buffer update times of the sessions it served."""
    start = time.perf_counter()
    restricted = [(session, verified, stats) for session, verified, stats in steps if session.vocab.restricted]
    feedbacks = dict(zip((id(session) for session, _, _ in restricted), feedbacks_for(
        [FeedbackRequest(verified, session.vocab.in_active(), session.vocab.wants_target_feedback, stats,
                         session.vocab.source_of) for session, verified, stats in restricted])))
    shared = (time.perf_counter() - start) / max(1, len(restricted))
    for session, verified, stats in steps:
        fb = feedbacks.get(id(session))
        observe_session(engine, session, verified, stats, fb, shared if fb is not None else 0.0)


def observe_session(engine: DraftEngine, session: DraftSession, verified: VerifiedStep, stats: SpecStats,
                    fb: TargetFeedback | None, feedback_seconds: float) -> None:
    """One session's part of `observe_locally`, its feedback computed: teacher signal, commit, buffer update."""
    start = time.perf_counter() - feedback_seconds
    teacher = teacher_signal(verified.target_logits, engine.learner.cfg.teacher_top_k) \
        if engine.learner is not None else None
    if teacher is not None:
        stats.teacher_signal_bytes += teacher.nbytes
    changes = engine.advance(session, verified.result, fb, teacher)
    stats.buffer_updates += sum(1 for c in changes if c.token_id >= 0)
    stats.buffer_update_seconds += time.perf_counter() - start
    stats.draft_head_seconds = session.head_seconds


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
        observe_locally(self.engine, [(self.session, verified, stats)])

    def close(self) -> None:
        self.engine.end(self.session)


class LocalBatchDrafter:
    """The in-process draft of the batching scheduler: every session's KV in one arena, and one packed draft forward
    per tree level over all sessions (DraftEngine.propose_many)."""

    def __init__(self, engine: DraftEngine, policies: VocabPolicies, arena: KVArena):
        self.engine, self.policies, self.arena = engine, policies, arena
        self.sessions: dict[str, DraftSession] = {}
        self._drafted: set[str] = set()  # sessions that got a tree in the last propose

    def kv_tokens(self, request: DraftRequest) -> int:
        return DraftEngine.cache_tokens(request.max_len, request.spec.tree)

    def available(self) -> bool:
        return True

    def open(self, key: str, request: DraftRequest) -> None:
        """Raises OverloadedError while the draft arena has no region large enough (the request waits)."""
        cache = self.arena.reserve(self.kv_tokens(request))
        if cache is None:
            raise OverloadedError("draft KV arena full")
        try:
            self.sessions[key] = self.engine.start(request.prompt_ids, request.sampling, request.spec.tree,
                                                   self.policies.get(request.spec), request.max_len, request.seed,
                                                   cache)
        except BaseException:
            self.arena.release(cache)
            raise

    def propose(self, requests: dict[str, TreeParams], prefills: dict[str, int]) -> dict[str, DraftTree | Exception]:
        trees = self.engine.propose_many([(self.sessions[k], params) for k, params in requests.items()],
                                         [(self.sessions[k], n) for k, n in prefills.items()])
        self._drafted = set(requests)
        return dict(zip(requests, trees))

    def prefill(self, prefills: dict[str, int]) -> dict[str, Exception]:
        """In this process there is nothing to overlap with: the chunks are cached now."""
        self.propose({}, prefills)
        return {}

    def observe(self, steps: dict[str, tuple[VerifiedStep, SpecStats]]) -> None:
        """Sessions that drafted this step get the full feedback. One the scheduler ran without a draft (depth 0)
        only appends its token, at a plain decoding step's cost: the draft caches it with its next feed, and the
        vocabulary buffer does not see that step (a busy server trades those updates for throughput)."""
        observe_locally(self.engine, [(self.sessions[key], verified, stats) for key, (verified, stats) in steps.items()
                                      if key in self._drafted])
        for key, (verified, _) in steps.items():
            if key not in self._drafted:
                self.engine.commit(self.sessions[key], verified.result)

    def flush(self) -> None:
        self._drafted = set()  # a step that proposes nothing must not see the last one's

    def close(self, key: str) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            self.engine.end(session)
            self.arena.release(session.cache)
