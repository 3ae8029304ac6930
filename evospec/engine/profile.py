"""Where an engine step's wall time goes: named spans summed since the last reset.

The scheduler times each layer of its step (admit, plan, draft, verify, commit, feedback, flush); a remote drafter
adds its transport's parts (encode, send, wait, decode) and what the draft replica says its own work took (compute,
codec). `evospec bench decoupled --breakdown` reads it from both paths and prints ms per step (docs/decoupled.md).
Spans cost two `perf_counter` calls each, so the profile is always on.
"""
from __future__ import annotations

import collections
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

# Span names, in the order a step runs them; those under "draft" nest inside it (they are its parts, not extra time).
STEP_SPANS = ("admit", "plan", "draft", "verify", "commit", "feedback", "flush")
DRAFT_PARTS = ("draft.encode", "draft.wait", "draft.decode", "draft.remote_compute", "draft.remote_codec")
# Draft-side work done while the target verifies: feedback the draft commits off the critical path, and pre-drafting.
HIDDEN_PARTS = ("draft.remote_feedback", "draft.remote_predraft")


@dataclass
class StepProfile:
    """Written by the scheduler's thread, read and reset from others (a Serve method): under a lock."""
    steps: int = 0
    seconds: collections.Counter = field(default_factory=collections.Counter)
    depths: collections.Counter = field(default_factory=collections.Counter)  # steps by the draft depth chosen
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        with self._lock:
            self.steps = 0
            self.seconds = collections.Counter()
            self.depths = collections.Counter()

    def count_step(self, depth: int) -> None:
        with self._lock:
            self.steps += 1
            self.depths[depth] += 1

    def add(self, span: str, seconds: float) -> None:
        with self._lock:
            self.seconds[span] += seconds

    @contextmanager
    def span(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def as_dict(self) -> dict:
        with self._lock:
            return {"steps": self.steps, "seconds": dict(self.seconds), "depths": dict(self.depths)}


def ms_per_step(profile: dict) -> dict[str, float]:
    """A profile's `as_dict()` as milliseconds per step, by span."""
    steps = max(1, profile["steps"])
    return {span: 1000 * s / steps for span, s in profile["seconds"].items()}
