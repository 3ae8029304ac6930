"""Speculation that adapts to load (after SmartSpec, arXiv 2406.14066): each engine step picks one draft depth k for
the whole batch, the one with the highest expected goodput = committed tokens / step time, from measured step costs
and each request's measured acceptance.

- Committed tokens of request i at depth k: 1 + sum_{j=1..k_i} alpha_i^j, with k_i = min(k, its own depth) and
  alpha_i its acceptance rate per tree level (the 1 is the bonus token the target always adds).
- Step time: one target forward over T = prefill tokens + sum_i (1 + nodes_i(k)) tokens, plus, when k > 0, the draft:
  one feed forward and k - 1 level forwards (the draft's own cost, whether in this process or behind a stream).
- k = 0 is plain decoding (no draft forward at all), so the chosen k never has a lower expected goodput than `ar`.

Costs start from a measurement at start-up and follow the measured steps (least squares with forgetting), so a busy
machine, a slower draft replica or longer contexts move the choice. Choosing the shape never looks at the draft's
tokens, so verification stays lossless whatever is chosen.
"""
from __future__ import annotations

from dataclasses import dataclass

from evospec.config import TreeParams


class LinearCost:
    """seconds ~= a + b * x, refit online by exponentially weighted least squares."""

    def __init__(self, points: list[tuple[float, float]], decay: float = 0.97):
        self.decay = decay
        self._s = [0.0] * 5  # weighted sums of 1, x, x^2, y, x*y
        for x, y in points:
            self.update(x, y, decay=1.0)
        self.a, self.b = self._fit()

    def update(self, x: float, y: float, decay: float | None = None) -> None:
        d = self.decay if decay is None else decay
        self._s = [d * s + v for s, v in zip(self._s, (1.0, x, x * x, y, x * y))]
        if decay is None:
            self.a, self.b = self._fit()

    def _fit(self) -> tuple[float, float]:
        n, sx, sxx, sy, sxy = self._s
        det = n * sxx - sx * sx
        if n <= 0:
            return 0.0, 0.0
        if abs(det) < 1e-12 * max(1.0, n * sxx):  # one distinct x so far: a flat cost through the mean
            return sy / n, 0.0
        b = max((n * sxy - sx * sy) / det, 0.0)  # a forward never gets cheaper with more tokens
        return max((sy - b * sx) / n, 0.0), b

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


def tree_nodes(params: TreeParams) -> int:
    """Most nodes a tree of this shape can have."""
    if params.shape == "chain":
        return params.num_draft_tokens
    b = params.branching
    return min(params.budget, b + (params.depth - 1) * b * b)


def tree_depth(params: TreeParams) -> int:
    return params.num_draft_tokens if params.shape == "chain" else params.depth


def clip_depth(params: TreeParams, k: int) -> TreeParams:
    """The request's shape cut to at most k levels (and the node budget such a tree can use)."""
    if params.shape == "chain":
        return params.model_copy(update={"num_draft_tokens": min(k, params.num_draft_tokens)})
    depth = min(k, params.depth)
    b = params.branching
    return params.model_copy(update={"depth": depth, "budget": min(params.budget, b + (depth - 1) * b * b)})


@dataclass
class Acceptance:
    """Tree levels a request's drafts reached (attempted) and the verifier accepted, with a prior."""
    accepted: float = 0.0
    attempted: float = 0.0

    def record(self, depth_drafted: int, accepted_len: int) -> None:
        if depth_drafted > 0:
            self.accepted += accepted_len
            self.attempted += min(accepted_len + 1, depth_drafted)

    def rate(self, prior: float, prior_weight: float = 4.0) -> float:
        return min((self.accepted + prior * prior_weight) / (self.attempted + prior_weight), 0.99)


class SpeculationBudget:
    def __init__(self, target_cost: LinearCost, draft_level_cost: LinearCost, prior_alpha: float = 0.6):
        self.target_cost = target_cost  # seconds of one target forward vs tokens
        self.draft_level_cost = draft_level_cost  # seconds of one draft forward (feed or level) vs rows
        self.prior_alpha = prior_alpha  # acceptance of a request before it has drafted
        self.global_acceptance = Acceptance()

    def prior(self) -> float:
        return self.global_acceptance.rate(self.prior_alpha, prior_weight=16.0)

    def choose(self, requests: list[tuple[TreeParams, Acceptance]], prefill_tokens: int) -> int:
        """The draft depth k (0 = no draft this step) with the best expected goodput for these requests."""
        if not requests:
            return 0
        prior = self.prior()
        alphas = [acc.rate(prior) for _, acc in requests]
        max_depth = max(tree_depth(p) for p, _ in requests)
        best_k, best = 0, -1.0
        for k in range(max_depth + 1):
            tokens, committed, rows = prefill_tokens, 0.0, 0
            for (params, _), alpha in zip(requests, alphas):
                clipped = clip_depth(params, k) if k else None
                nodes = tree_nodes(clipped) if clipped else 0
                depth = tree_depth(clipped) if clipped else 0
                tokens += 1 + nodes
                committed += 1 + sum(alpha ** j for j in range(1, depth + 1))
                rows += 1 if params.shape == "chain" else params.branching
            seconds = self.target_cost(tokens)
            if k:
                seconds += k * self.draft_level_cost(rows)
            goodput = committed / max(seconds, 1e-9)
            if goodput > best * 1.0001:  # ties go to the shallower depth
                best_k, best = k, goodput
        return best_k
