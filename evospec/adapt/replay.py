"""Training examples cut from served sessions, the bounded replay buffer that keeps them, and the curriculum.

A session's teacher positions (one per committed token of each verified step) accumulate in its `Trajectory`;
every `positions_per_example` of them, and at the session's end, they become one `Example`: the last `window`
committed tokens before the newest position, and for each position the hidden row that predicts it.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

import torch

from evospec.adapt.signal import TeacherSignal


@dataclass(eq=False)  # compared by identity (the buffer looks examples up)
class Example:
    input_ids: torch.Tensor  # [L] int32: a window of committed tokens
    rows: torch.Tensor  # [P] int64: row r of the window's hidden states predicts token start + r + 1
    teacher_ids: torch.Tensor  # [P, k] int32
    teacher_logprobs: torch.Tensor  # [P, k] float16
    accepted: torch.Tensor  # [P] bool: the draft proposed the committed token there and the target accepted it
    priority: float = math.inf  # its last mean KL; inf = not trained on yet
    prefix_hidden: torch.Tensor | None = None  # [L, hidden] input of the first adapted layer (frozen below), cached

    @property
    def nbytes(self) -> int:
        tensors = (self.input_ids, self.rows, self.teacher_ids, self.teacher_logprobs, self.accepted,
                   *(() if self.prefix_hidden is None else (self.prefix_hidden,)))
        return sum(t.numel() * t.element_size() for t in tensors)


class Trajectory:
    """One draft session's teacher positions not cut into an example yet (touched only on the serving thread)."""

    def __init__(self, window: int, positions_per_example: int):
        self.window, self.per_example = window, positions_per_example
        self.positions: list[int] = []  # index in the session's tokens of each teacher row
        self.signals: list[TeacherSignal] = []
        self.accepted: list[bool] = []

    def add(self, first_position: int, signal: TeacherSignal, accepted: int) -> None:
        """A verified step whose committed tokens start at `first_position`; the first `accepted` were drafted."""
        self.positions += range(first_position, first_position + signal.positions)
        self.signals.append(signal)
        self.accepted += [i < accepted for i in range(signal.positions)]

    @property
    def ready(self) -> bool:
        return len(self.positions) >= self.per_example

    def cut(self, tokens: list[int]) -> Example | None:
        """The collected positions as one example over `tokens` (the session's committed sequence); None when
        none fits in the window."""
        if not self.positions:
            return None
        positions, signals, flags = self.positions, self.signals, self.accepted
        self.positions, self.signals, self.accepted = [], [], []  # cleared first: a bad signal is dropped, once
        end = positions[-1]  # the window's input is tokens[start:end]; its last row predicts tokens[end]
        start = max(0, end - self.window)
        ids = torch.cat([s.token_ids for s in signals])  # [n, k]
        logprobs = torch.cat([s.logprobs for s in signals])
        keep = [i for i, p in enumerate(positions) if p - 1 >= start]
        rows = torch.tensor([positions[i] - start - 1 for i in keep], dtype=torch.long)
        accepted = torch.tensor([flags[i] for i in keep], dtype=torch.bool)
        if not keep:
            return None
        index = torch.tensor(keep)
        return Example(torch.tensor(tokens[start:end], dtype=torch.int32), rows, ids[index], logprobs[index], accepted)


class ReplayBuffer:
    """The newest examples, bounded by count and bytes (oldest evicted first). Sampling: examples not trained on
    yet first (newest first: the live traffic), then proportional to their last KL (prioritized replay). Written on
    the serving thread, read by the training worker: a lock guards the deque."""

    def __init__(self, max_examples: int, max_bytes: int, seed: int = 0):
        self.max_examples, self.max_bytes = max_examples, max_bytes
        self._examples: deque[Example] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(seed)
        self.added = 0

    def __len__(self) -> int:
        return len(self._examples)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def add(self, example: Example) -> None:
        with self._lock:
            self._examples.append(example)
            self._bytes += example.nbytes
            self.added += 1
            while len(self._examples) > self.max_examples or (self._bytes > self.max_bytes
                                                              and len(self._examples) > 1):
                self._bytes -= self._examples.popleft().nbytes

    def cache_prefix(self, example: Example, hidden: torch.Tensor) -> None:
        """Keep the frozen layers' output with an example still in the buffer, when the byte bound allows (its
        bytes count toward it; otherwise the worker recomputes it next time)."""
        size = hidden.numel() * hidden.element_size()
        with self._lock:
            if example.prefix_hidden is None and self._bytes + size <= self.max_bytes and \
                    any(e is example for e in self._examples):
                example.prefix_hidden = hidden
                self._bytes += size

    def sample(self, n: int) -> list[Example]:
        with self._lock:
            examples = list(self._examples)
        fresh = [e for e in reversed(examples) if math.isinf(e.priority)][:n]
        seen = [e for e in examples if not math.isinf(e.priority)]
        want = min(n - len(fresh), len(seen))
        if want <= 0:
            return fresh
        weights = torch.tensor([max(e.priority, 1e-6) for e in seen], dtype=torch.float64)
        picked = torch.multinomial(weights, want, replacement=False, generator=self._generator).tolist()
        return fresh + [seen[i] for i in picked]


class Curriculum:
    """Which positions a training step learns from, and how much.

    It starts on the `focus_start` share of each example's positions where the draft disagrees most with the target
    (highest KL), plus every position where the draft's token was rejected, each weighted by its KL: the draft's
    wrong and low-confidence predictions first. As the loss (an EMA) falls below its starting value the focus widens,
    and the KL weighting flattens, linearly until at half the starting loss every position counts equally."""

    WARMUP_STEPS = 5  # steps whose losses set the starting value

    def __init__(self, focus_start: float):
        self.focus_start = focus_start
        self.progress = 0.0  # 0 = focused, 1 = every position, uniform weights
        self.ema: float | None = None
        self.first: float | None = None
        self.steps = 0

    @property
    def focus(self) -> float:
        return self.focus_start + (1.0 - self.focus_start) * self.progress

    def weights(self, kl: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """kl: [P] per-position KL (detached); accepted: [P] bool -> [P] weights summing to 1."""
        keep_n = max(1, math.ceil(self.focus * kl.numel()))
        threshold = kl.topk(keep_n).values[-1]
        keep = (kl >= threshold) | ~accepted
        w = keep.float() * kl.clamp_min(1e-6).pow(1.0 - self.progress)
        return w / w.sum()

    def update(self, loss: float) -> None:
        self.steps += 1
        self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        if self.steps == self.WARMUP_STEPS:
            self.first = self.ema
        if self.first:
            self.progress = min(1.0, max(self.progress, 2.0 * (1.0 - self.ema / self.first)))
