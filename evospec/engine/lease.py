"""A generation's lease on a draft session: lossless fallback and resume, per request.

A speculative generation holds a draft session from admission. A draft failure ends the lease: the generation goes
on target-only from its exact committed state (greedy output stays the target's, sampling keeps its distribution; a
tree that was never verified is simply dropped). After a backoff that doubles with each consecutive failure (from
`retry_s` up to `max_retry_s`), a new draft session may be opened over everything committed so far; it first catches
up on that context in prefill chunks (`lag`) and drafts again once it has. Errors a reconnect cannot fix (an error
whose `retryable` is False, e.g. another static vocabulary) are never retried.

Only the state and the decisions live here; the scheduler makes the drafter's calls and tells the lease how they went.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from evospec.engine.stats import SpecStats


def fallback_reason(error: BaseException) -> str:
    """One line for the statistics: the error's type and the first line of its message, at most 200 characters."""
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}"[:200]


@dataclass
class DraftLease:
    stats: SpecStats  # the generation's statistics: why the draft was last dropped, how often it resumed
    retry_s: float  # the first backoff after a failure (scheduler.draft_retry_s)
    max_retry_s: float  # the longest backoff (scheduler.draft_max_retry_s)
    held: bool = False  # has a draft session
    lag: int = 0  # context tokens a resumed draft session must still prefill before it drafts
    failures: int = 0  # consecutive draft failures (the backoff's exponent)
    retry_at: float = 0.0  # time.monotonic() after which a lost draft may be resumed
    retryable: bool = True  # False after an error a reconnect cannot fix

    @property
    def drafting(self) -> bool:
        """Gets trees this step (a resumed draft catching up on the context does not yet)."""
        return self.held and self.lag == 0

    def due(self, now: float) -> bool:
        """A new draft session may be tried now: none is held, the last error may be retried and its backoff passed."""
        return not self.held and self.retryable and now >= self.retry_at

    def opened(self, catch_up: int = 0) -> None:
        """A draft session over the prompt was opened at admission. catch_up: prompt tokens it prefills after the
        target's prefill, before it drafts (scheduler.draft_prefill deferred); 0 = it prefills with the target."""
        self.held, self.lag = True, catch_up

    def resumed(self, context_tokens: int) -> None:
        """A new draft session over `context_tokens` committed tokens: it prefills all but the pending last one
        before it drafts."""
        self.held, self.lag = True, context_tokens - 1
        self.stats.draft_resumes += 1

    def answered(self) -> None:
        """The draft answered a step with a tree: the next failure starts the backoff over."""
        self.failures = 0

    def catch_up(self, room: int) -> int:
        """Context tokens to prefill this step, at most `room`."""
        return min(self.lag, room) if self.held and self.lag and room > 0 else 0

    def caught_up(self, tokens: int) -> None:
        """`tokens` of the lag were prefilled (nothing, if the session was lost meanwhile)."""
        if self.held:
            self.lag -= tokens

    def failed(self, error: BaseException) -> None:
        """A draft session could not be opened, or was lost: say why in the statistics, and when speculation may be
        resumed (exponential backoff; never after an error a reconnect cannot fix)."""
        self.stats.fallback_reason = fallback_reason(error)
        self.retryable = self.retryable and getattr(error, "retryable", True)
        delay = self.retry_s * 2 ** self.failures
        self.failures += 1
        self.retry_at = time.monotonic() + min(self.max_retry_s, delay)

    def lose(self, error: BaseException) -> bool:
        """The held session failed: the generation goes on without it. False when none was held (nothing to do);
        True tells the caller to close the session."""
        if not self.held:
            return False
        self.held, self.lag = False, 0
        self.failed(error)
        return True

    def release(self) -> bool:
        """The generation ended: True when a session was held (the caller closes it). Idempotent."""
        held, self.held = self.held, False
        return held


def plan_catch_up(leases: Iterable[tuple[str, DraftLease]], room: int) -> dict[str, int]:
    """Context tokens each resumed draft session prefills this step, by key: at most `room` in all, in the given
    order (oldest first)."""
    plan = {}
    for key, lease in leases:
        tokens = lease.catch_up(room)
        if tokens:
            plan[key] = tokens
            room -= tokens
    return plan
