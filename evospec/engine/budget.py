"""Speculation that adapts to load (after SmartSpec, arXiv 2406.14066): each engine step picks one draft depth k for
the whole batch, the one with the highest expected goodput = committed tokens / step time, from measured step costs
and each request's measured acceptance.

- Committed tokens of request i at depth k: 1 + its expected accepted length at depth min(k, its own depth), from
  its measured per-level acceptance (`Acceptance`; the 1 is the bonus token the target always adds).
- Step time: one target forward over T = prefill tokens + sum_i (1 + nodes_i(k)) tokens (a measured table by T),
  plus, when k > 0, what drafting adds: per step, per session, per level and per level-row (least squares over
  measured steps), whether the draft runs in this process or behind a stream.
- k = 0 is plain decoding (no draft forward at all), so the chosen k never has a lower expected goodput than `ar`.
- A safety net over the model: per batch size, the measured goodput of drafting steps and of plain steps; while
  drafting measures worse, the step does not draft (except the occasional exploring step that keeps both current).

Costs start from a measurement at start-up and follow the measured steps (with forgetting), so a busy machine, a
slower draft replica or longer contexts move the choice. Choosing the shape never looks at the draft's
tokens, so verification stays lossless whatever is chosen.
"""
from __future__ import annotations

import collections
import copy
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from evospec.config import SpecParams, TreeParams, clipped_size, traits
from evospec.model.qwen3 import Qwen3, forward_seconds

log = logging.getLogger(__name__)


class OnlineCost:
    """seconds ~= w . features, least squares over start-up calibration points (kept for good: they span sizes the
    steady state may never visit, so the slope stays known) and measured steps (exponentially forgotten: they set the
    level under the current load). A small ridge keeps it defined; weights are clamped at 0."""

    def __init__(self, num_features: int, decay: float = 0.98, ridge: float = 1e-6):
        self.decay, self.ridge = decay, ridge
        self._calibration = (np.zeros((num_features, num_features)), np.zeros(num_features))
        self._measured = (np.zeros((num_features, num_features)), np.zeros(num_features))
        self.weights = np.zeros(num_features)
        self.updates = 0  # measured steps so far

    def calibrate(self, features: list[float], seconds: float) -> None:
        x = np.asarray(features, dtype=np.float64)
        self._calibration = (self._calibration[0] + np.outer(x, x), self._calibration[1] + x * seconds)
        self._fit()

    def update(self, features: list[float], seconds: float) -> None:
        x = np.asarray(features, dtype=np.float64)
        xtx, xty = self._measured
        self._measured = (self.decay * xtx + np.outer(x, x), self.decay * xty + x * seconds)
        self.updates += 1
        self._fit()

    def _fit(self) -> None:
        xtx = self._calibration[0] + self._measured[0]
        xty = self._calibration[1] + self._measured[1]
        reg = self.ridge * max(1.0, float(np.trace(xtx))) * np.eye(len(xty))
        self.weights = np.clip(np.linalg.solve(xtx + reg, xty), 0.0, None)

    def __call__(self, features: list[float]) -> float:
        return float(self.weights @ np.asarray(features, dtype=np.float64))


class TokenCostTable:
    """Seconds of one target forward by its number of tokens, as a shape times a level.

    - The shape: seconds by size, linear between measured sizes. A table, not a line: on a CPU a forward costs
      about the same for 1 to ~8 tokens (weights are read once) and grows linearly beyond (compute). Its sizes come
      from the start-up measurement (`calibrate`) and, beyond the largest calibrated size (prefill chunks), from
      measured steps (averaged with forgetting).
    - The level: what plain steps within the calibrated sizes measure now, over the shape at their size (averaged
      with forgetting). Contexts grow (attention reads more KV), a neighbour takes a core: the level follows, so a
      size seen only at start-up, the size a drafting step runs, is priced at today's level, and the context's
      growth is not billed to drafting.
    """

    def __init__(self, decay: float = 0.8, max_sizes: int = 4096):
        self.decay, self.max_sizes = decay, max_sizes
        self._seconds: dict[int, float] = {}  # the shape, at level 1
        self._calibrated_max = 0  # sizes up to this one are priced from the start-up shape
        self.level = 1.0

    def calibrate(self, tokens: int, seconds: float) -> None:
        """A start-up measurement of `tokens` (the level then was 1)."""
        self._seconds[tokens] = seconds
        self._calibrated_max = max(self._calibrated_max, tokens)

    def update(self, tokens: int, seconds: float) -> None:
        """A plain step of `tokens` took `seconds`."""
        if tokens <= self._calibrated_max:
            ratio = seconds / max(self._shape(tokens), 1e-9)
            self.level = self.decay * self.level + (1 - self.decay) * ratio
            return
        at_level = seconds / self.level
        old = self._seconds.get(tokens)
        if old is not None:
            self._seconds[tokens] = self.decay * old + (1 - self.decay) * at_level
        elif len(self._seconds) < self.max_sizes:
            self._seconds[tokens] = at_level

    def __call__(self, tokens: int) -> float:
        return self._shape(tokens) * self.level

    def _shape(self, tokens: int) -> float:
        if tokens in self._seconds:
            return self._seconds[tokens]
        sizes = sorted(self._seconds)
        if not sizes:
            return 0.0
        if tokens < sizes[0]:
            return self._seconds[sizes[0]]
        hi = next((s for s in sizes if s > tokens), None)
        lo = max(s for s in sizes if s < tokens)
        if hi is None:  # beyond the largest measured size: extend the last segment's slope
            below = [s for s in sizes if s < lo]
            if not below:
                return self._seconds[lo] * tokens / lo
            prev = below[-1]
            slope = max(0.0, (self._seconds[lo] - self._seconds[prev]) / (lo - prev))
            return self._seconds[lo] + slope * (tokens - lo)
        w = (tokens - lo) / (hi - lo)
        return (1 - w) * self._seconds[lo] + w * self._seconds[hi]


LOOKUP_SECONDS_PER_SESSION = 1e-4  # a `lookup` proposal: a few dictionary probes and a chain's tensors
LOOKUP_KIND: tuple = ("lookup",)  # the draft kind of every prompt-lookup chain (`lookup`, and the lookup fallback)


def draft_features(depth: int, sessions: int, rows_per_level: int) -> list[float]:
    """The draft side of one step: per step, per drafting session (feed, feedback, buffer update), per level, and
    per level and row (forward and head)."""
    return [1.0, float(sessions), float(depth), float(depth * rows_per_level)]


@dataclass(frozen=True)
class StepOutcome:
    """What one engine step cost and gave, as the budget's models learn from it."""
    depth: int  # the draft depth chosen for the step (k)
    trees: list[tuple[tuple, TreeParams]]  # (draft kind, shape) of each session that got a tree
    drafting: list[tuple]  # draft kinds of the decoding sessions that draft, after the step
    prefilled: bool  # the target prefilled prompt tokens (its goodput is not drafting's)
    draft_prefilled: bool  # a draft session prefilled (it would skew the per-level cost: nothing is recorded)
    draft_failed: bool  # the draft failed a session (a dead or frozen replica's wait is not what drafting costs)
    tokens: int  # the target forward's tokens
    target_seconds: float
    draft_seconds: float  # the draft side: trees and feedback
    committed: int  # tokens the decoding sessions committed
    lookup_depth: int = 0  # the depth chosen for the step's prompt-lookup chains (`LOOKUP_KIND` trees)


@dataclass
class Acceptance:
    """Per tree level j: steps whose tree reached level j with levels 1..j-1 accepted (`reached`), and steps where
    level j was accepted too (`passed`). Real acceptance is not geometric (early levels pass more often), so the
    expected accepted length at depth k is sum_{j<=k} prod_{i<=j} rate_i over these measured per-level rates."""
    reached: list[float] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)

    def record(self, depth_drafted: int, accepted_len: int) -> None:
        while len(self.reached) < depth_drafted:
            self.reached.append(0.0)
            self.passed.append(0.0)
        for j in range(min(accepted_len + 1, depth_drafted)):
            self.reached[j] += 1
            self.passed[j] += j < accepted_len

    def rate(self, level: int, prior: float, prior_weight: float = 4.0) -> float:
        """Acceptance of level `level` (0-based) given the levels before it, shrunk towards `prior`."""
        reached = self.reached[level] if level < len(self.reached) else 0.0
        passed = self.passed[level] if level < len(self.passed) else 0.0
        return min((passed + prior * prior_weight) / (reached + prior_weight), 0.99)

    def expected_accepted(self, depth: int, priors: list[float]) -> float:
        total, survive = 0.0, 1.0
        for j in range(depth):
            survive *= self.rate(j, priors[j])
            total += survive
        return total


@dataclass(frozen=True)
class CatchUp:
    """A decision on a draft's catch-up, with what it rests on (the scheduler logs it)."""
    pays: bool
    saved: float  # seconds speculation is expected to save over the request's remaining tokens
    cost: float  # seconds the catch-up is expected to take
    why: str  # set when the decision is made to learn, not from saved vs cost


@dataclass
class GoodputMeter:
    """Tokens per second over recent steps of one kind (committed by drafting or by plain steps; prefilled by a
    draft's catch-up): tokens and seconds each averaged with forgetting, divided when read."""
    min_steps = 3  # steps before the safety net trusts it
    noise_margin = 0.05  # drafting must measure this much below plain before it is vetoed
    decay: float = 0.8
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds
        self.steps += 1

    @property
    def settled(self) -> bool:
        return self.steps >= self.min_steps

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def draft_kind(spec: SpecParams) -> tuple:
    """What makes drafting cost and accept differently: the method and its vocabulary sizes (a full head: every
    row, whatever the sizes say)."""
    method = traits(spec.method)
    if not method.static_head:
        return (spec.method,)
    return (spec.method, spec.vocab.static_size, spec.vocab.dynamic_size if method.dynamic_buffer else 0)


@dataclass(frozen=True)
class DraftCosts:
    """A draft model's own forwards, measured where it runs (its replica, when a target asks at start-up; or this
    process): seconds of one forward without a head by rows (a tree level over that many sessions' chains), and of a
    prefill chunk."""
    level_seconds: dict[int, float]
    prefill_tokens: int
    prefill_seconds: float

    @classmethod
    def measure(cls, draft: Qwen3, prefill_tokens: int = 16) -> DraftCosts:
        seconds = forward_seconds(draft, sizes=(1, 8, prefill_tokens), repeats=2)
        return cls({n: seconds[n] for n in (1, 8)}, prefill_tokens, seconds[prefill_tokens])

    def __str__(self) -> str:
        levels = {rows: round(1000 * seconds, 1) for rows, seconds in self.level_seconds.items()}
        return f"{levels} ms by rows, prefill {self.prefill_tokens / max(self.prefill_seconds, 1e-9):.1f} tokens/s"


def level_cost(level_seconds: dict[int, float]) -> OnlineCost:
    """What drafting adds, calibrated on depth-1 steps of chains over n sessions (n rows) taking these seconds."""
    cost = OnlineCost(4)
    for sessions, seconds in level_seconds.items():
        cost.calibrate(draft_features(1, sessions, sessions), seconds)
    return cost


class SpeculationBudget:
    """Costs and acceptance are kept per draft kind (`draft_kind`): an `sd` draft with its full head costs and
    accepts nothing like an `frspec` one, and one must not talk the scheduler out of the other."""

    def __init__(self, target_cost: TokenCostTable, draft_prior: OnlineCost, prior_alpha: float = 0.6,
                 explore_every: int = 64):
        """Use `measured` to start from the models' own start-up costs."""
        self.target_cost = target_cost  # one target forward alone, by tokens
        self.draft_prior = draft_prior  # start-up model of what drafting adds; each kind starts from a copy
        self.draft_costs: dict[tuple, OnlineCost] = {}
        self.prior_alpha = prior_alpha  # acceptance of a request before its kind has drafted
        self.acceptance: dict[tuple, Acceptance] = {}  # per kind, over every request so far
        self.learn_trees = 32  # verified trees of a kind before its measured acceptance decides a catch-up
        self.optimistic_acceptance = 0.9  # per level, the kind's acceptance assumed until then
        self.learning_margin = 2.0  # until then a catch-up's saving (an upper bound) must cover its cost this often
        self.explore_every = explore_every  # after this many steps without a draft, draft once to re-measure
        self._exploring: dict[str, list[int]] = {}  # source -> [steps without a draft, steps to wait before one]
        self._goodput: dict[tuple, GoodputMeter] = {}  # (kinds, batch-size bucket, drafted) -> tokens/s
        self._vetoed: dict[tuple, bool] = {}  # (source, kinds, batch-size bucket) -> the safety net's last word
        self._draft_prefill = GoodputMeter()  # context tokens a draft prefills per second (catch-up's price)
        self._answer_lengths: collections.deque[int] = collections.deque(maxlen=32)  # recent natural ends

    @classmethod
    def measured(cls, target: Qwen3, draft: Qwen3 | None) -> "SpeculationBudget":
        """Start-up costs: target forwards (with the full head) of 1 to 32 tokens (the cost table's shape; larger
        steps, prefill chunks, are measured as they run), and the draft's own forwards (`DraftCosts.measure`).
        A remote draft (draft None) starts at a tenth of a target step per level until its replica's measurement
        arrives (`calibrate_draft`: the target deployment asks for it once the draft answers).

        The draft's estimate is optimistic on purpose: a forward without any head is a lower bound, so the first
        steps draft, measure what drafting really costs with each method's head and its link, and the estimate
        follows (a pessimistic start would never draft, so it would never learn otherwise)."""
        target_cost = TokenCostTable()
        target_seconds = forward_seconds(target, sizes=(1, 2, 3, 4, 6, 8, 16, 32), repeats=2, with_head=True)
        for n, seconds in target_seconds.items():
            target_cost.calibrate(n, seconds)
        budget = cls(target_cost, level_cost({1: target_seconds[1] / 10}), explore_every=32)
        if draft is not None:
            budget.calibrate_draft(DraftCosts.measure(draft))
        return budget

    def calibrate_draft(self, costs: DraftCosts) -> None:
        """Start from the draft's measured forwards (its replica's, or this process's draft): the per-level prior
        of every draft kind that has not drafted yet, and the catch-up's prefill rate until catch-ups measure it."""
        self.draft_prior = level_cost(costs.level_seconds)
        self.draft_costs = {kind: cost for kind, cost in self.draft_costs.items()
                            if kind == LOOKUP_KIND or cost.updates > 0}
        if self._draft_prefill.steps == 0 and costs.prefill_tokens > 0 and costs.prefill_seconds > 0:
            self._draft_prefill.add(costs.prefill_tokens, costs.prefill_seconds)

    def draft_cost(self, kind: tuple) -> OnlineCost:
        """What drafting adds for `kind`: from the draft's start-up model; `lookup` (no draft model) from a probe
        of its n-gram index per session, learnt from its steps like any kind."""
        if kind not in self.draft_costs:
            if kind == LOOKUP_KIND:
                self.draft_costs[kind] = OnlineCost(4)
                self.draft_costs[kind].calibrate(draft_features(1, 1, 1), LOOKUP_SECONDS_PER_SESSION)
            else:
                self.draft_costs[kind] = copy.deepcopy(self.draft_prior)
        return self.draft_costs[kind]

    def record_acceptance(self, kind: tuple, depth_drafted: int, accepted_len: int) -> None:
        self.acceptance.setdefault(kind, Acceptance()).record(depth_drafted, accepted_len)

    def record_tree(self, request: Acceptance, kind: tuple, depth_drafted: int, accepted_len: int) -> None:
        """One verified tree of a request: into the request's own acceptance and its kind's."""
        request.record(depth_drafted, accepted_len)
        self.record_acceptance(kind, depth_drafted, accepted_len)

    def record_step_outcome(self, outcome: StepOutcome) -> None:
        """What an engine step cost and gave: its costs (`record_step`; drafting rows by kind) and, for a step of
        decoding alone, its goodput (`record_goodput`). Of a step in which a draft session prefilled or the draft
        failed, only a plain target forward counts (it is timed apart from the draft); drafting costs and goodput
        are not drafting's there: a replica that died mid-step must not teach the budget that drafting never pays.
        Nor does a step whose target forward also prefilled prompt chunks teach drafting costs: what such a forward
        takes beyond the cost table is mostly the table's error at prefill sizes (seconds of work, priced from few
        plain steps), not the trees' rows; charged to drafting it priced a free drafter (`lookup`) out of the
        choice after a few concurrent long prompts."""
        if outcome.draft_prefilled or outcome.draft_failed or (outcome.prefilled and outcome.trees):
            if not outcome.trees:
                self.record_step(outcome.tokens, outcome.target_seconds)
            return
        drafted_rows: dict[tuple, tuple[int, int]] = {}  # kind -> (sessions, rows per level) that got trees
        for kind, shape in outcome.trees:
            sessions, rows = drafted_rows.get(kind, (0, 0))
            drafted_rows[kind] = (sessions + 1, rows + shape.width)
        self.record_step(outcome.tokens, outcome.target_seconds, outcome.depth if outcome.trees else 0,
                         drafted_rows, outcome.draft_seconds, outcome.lookup_depth)
        if outcome.prefilled or not outcome.drafting:
            return
        # Each source's safety net sees only its own steps: a step with prompt-lookup chains says nothing of what the
        # draft model's trees give, and one with the draft's trees nothing of what lookup gives.
        seconds = outcome.draft_seconds + outcome.target_seconds
        with_chains = any(kind == LOOKUP_KIND for kind, _ in outcome.trees)
        with_trees = any(kind != LOOKUP_KIND for kind, _ in outcome.trees)
        draft_kinds = [kind for kind in outcome.drafting if kind != LOOKUP_KIND]
        if draft_kinds and not with_chains:
            self.record_goodput(frozenset(draft_kinds), len(draft_kinds), with_trees, outcome.committed, seconds)
        lookups = len(outcome.drafting) - len(draft_kinds)
        if lookups and not with_trees:
            self.record_goodput(frozenset([LOOKUP_KIND]), lookups, with_chains, outcome.committed, seconds)

    def record_step(self, tokens: int, target_seconds: float, depth: int = 0,
                    drafting: dict[tuple, tuple[int, int]] | None = None, draft_seconds: float = 0.0,
                    lookup_depth: int = 0) -> None:
        """One engine step: its target forward over `tokens`, and, when it drafted (`depth` levels of the draft
        model's trees, `lookup_depth` of prompt-lookup chains; `drafting` = {kind: (sessions, rows per level)}), the
        draft side's seconds (trees and feedback). A draft model is charged everything it added: its own time plus
        what the target took beyond its cost alone (on a shared CPU the draft's weights push the target's out of the
        caches). Prompt lookup has no weights to push anything out: its chains are charged their own time, and the
        target's forward in a step with chains alone is the target's cost, so it teaches the cost table (whose level
        follows the context), not lookup: charged to lookup, the longer attention of a batch of long prompts priced
        chains out of every later request, short ones included, and nothing re-measured it. A step of several kinds
        shares the draft side's seconds by sessions."""
        depths = {kind: lookup_depth if kind == LOOKUP_KIND else depth for kind in drafting or {}}
        drafted = {kind: rows for kind, rows in (drafting or {}).items() if depths[kind]}
        if not any(kind != LOOKUP_KIND for kind in drafted):
            self.target_cost.update(tokens, target_seconds)
        excess = max(0.0, target_seconds - self.target_cost(tokens))
        total_sessions = sum(n for n, _ in drafted.values())
        for kind, (sessions, rows) in drafted.items():
            share = sessions / total_sessions
            charged = share * draft_seconds + (share * excess if kind != LOOKUP_KIND else 0.0)
            self.draft_cost(kind).update(draft_features(depths[kind], sessions, rows), charged)

    def record_goodput(self, kinds: frozenset, sessions: int, drafted: bool, committed: int, seconds: float) -> None:
        """A whole step's outcome: `committed` tokens over `sessions` speculative sessions of `kinds` in `seconds`.
        Tokens and seconds are averaged apart (with forgetting) and divided when read: a step whose tree was all
        rejected weighs what it cost, not one rate among equals."""
        if sessions and seconds > 0:
            key = (kinds, sessions.bit_length(), drafted)
            self._goodput.setdefault(key, GoodputMeter()).add(committed, seconds)

    def _measured_worse(self, kinds: frozenset, sessions: int) -> bool:
        """The safety net: for this mix and batch size, drafting steps have measured less goodput than plain ones,
        by more than the noise margin, over at least `GoodputMeter.min_steps` steps of each (one slow step on a
        shared machine must not stop speculation)."""
        plain = self._goodput.get((kinds, sessions.bit_length(), False))
        drafted = self._goodput.get((kinds, sessions.bit_length(), True))
        if plain is None or drafted is None or not (plain.settled and drafted.settled):
            return False
        return drafted.rate < (1 - GoodputMeter.noise_margin) * plain.rate

    def _log_safety_net(self, source: str, kinds: frozenset, sessions: int, vetoed: bool) -> None:
        """Say when the safety net starts or stops overriding the model for a source and batch size, with what it
        measured (a user wondering why a draft stopped drafting finds it in the target's log)."""
        key = (source, kinds, sessions.bit_length())
        if self._vetoed.get(key, False) == vetoed:
            return
        self._vetoed[key] = vetoed
        plain = self._goodput.get((kinds, sessions.bit_length(), False))
        drafted = self._goodput.get((kinds, sessions.bit_length(), True))
        log.info("safety net: %s %s at %d speculative requests (measured %.1f tok/s drafting over %d steps, %.1f "
                 "plain over %d)", "stops" if vetoed else "lets", source, sessions, drafted.rate if drafted else 0.0,
                 drafted.steps if drafted else 0, plain.rate if plain else 0.0, plain.steps if plain else 0)

    def learning(self, kind: tuple) -> bool:
        """Whether the kind has fewer than `learn_trees` verified trees: its acceptance is not measured yet."""
        trees = self.acceptance.get(kind, Acceptance()).reached[:1]
        return not trees or trees[0] < self.learn_trees

    def priors(self, kind: tuple, depth: int) -> list[float]:
        """Per-level acceptance of a request that has not drafted that deep yet: its kind's, so far, shrunk towards
        `optimistic_acceptance` while the kind is learning (the assumption its catch-ups were bought on: a draft
        that caught up on that promise must then draft, or its acceptance is never measured and every request pays
        a catch-up that is never used), else towards `prior_alpha`."""
        acceptance = self.acceptance.get(kind, Acceptance())
        prior = self.optimistic_acceptance if self.learning(kind) else self.prior_alpha
        return [acceptance.rate(j, prior, prior_weight=16.0) for j in range(depth)]

    def choose(self, requests: list[tuple[TreeParams, Acceptance, tuple]], prefill_tokens: int,
               source: str = "draft") -> int:
        """The draft depth k (0 = no draft this step) with the best expected goodput for these requests
        ((shape, the request's acceptance, its draft kind) each). `source`: whose trees these are (the draft model's,
        or prompt lookup's), each with its own exploration schedule, so one that drafts does not keep the other
        from re-measuring."""
        if not requests:
            return 0
        max_depth = max(p.levels for p, _, _ in requests)
        best_k, best = 0, -1.0
        for k, (committed, seconds) in enumerate(self._expected_steps(requests, prefill_tokens)):
            goodput = committed / max(seconds, 1e-9)
            if goodput > best * 1.0001:  # ties go to the shallower depth
                best_k, best = k, goodput
        kinds = frozenset(kind for _, _, kind in requests)
        vetoed = bool(best_k) and self._measured_worse(kinds, len(requests))
        if best_k:
            self._log_safety_net(source, kinds, len(requests), vetoed)
        if vetoed:
            best_k = 0  # whatever the model predicts, speculation must not cost throughput
        if best_k == 0 and max_depth > 0:
            # Costs learnt only from drafting steps go stale while nobody drafts (load fell, a draft got faster):
            # now and then draft anyway, one level (the cheapest probe), to measure again. Each exploration the
            # safety net still vetoes doubles the wait for the next, so a draft that never pays costs ever less.
            exploring = self._exploring.setdefault(source, [0, self.explore_every])
            exploring[0] += 1
            if exploring[0] >= exploring[1]:
                exploring[0] = 0
                if vetoed:
                    exploring[1] = min(2 * exploring[1], 64 * self.explore_every)
                return 1
        else:
            self._exploring[source] = [0, self.explore_every]
        return best_k

    def _expected_steps(self, requests: list[tuple[TreeParams, Acceptance, tuple]],
                        prefill_tokens: int) -> list[tuple[float, float]]:
        """(committed tokens, seconds) expected of one step of these requests at each depth k = 0, 1, ..."""
        max_depth = max(p.levels for p, _, _ in requests)
        kinds: dict[tuple, list[int]] = {}  # kind -> [sessions, rows per level]
        for params, _, kind in requests:
            entry = kinds.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += params.width
        priors = {kind: self.priors(kind, max_depth) for kind in kinds}
        steps = []
        for k in range(max_depth + 1):
            tokens, committed = prefill_tokens, 0.0
            for params, acceptance, kind in requests:
                depth, nodes = clipped_size(params, k)
                tokens += 1 + nodes
                committed += 1 + acceptance.expected_accepted(depth, priors[kind])
            seconds = self.target_cost(tokens)
            if k:
                seconds += sum(self.draft_cost(kind)(draft_features(k, n, rows)) for kind, (n, rows) in kinds.items())
            steps.append((committed, seconds))
        return steps

    def seconds_saved_per_token(self, requests: list[tuple[TreeParams, Acceptance, tuple]]) -> float:
        """What each request's token costs less, in wall seconds, when these requests all draft at the best depth
        than when they decode plainly (0 when drafting does not pay, or the safety net has measured it worse)."""
        if not requests or self._measured_worse(frozenset(kind for _, _, kind in requests), len(requests)):
            return 0.0
        (plain_tokens, plain_seconds), *drafting = self._expected_steps(requests, 0)
        best = min((seconds / committed for committed, seconds in drafting), default=plain_seconds / plain_tokens)
        return max(0.0, len(requests) * (plain_seconds / plain_tokens - best))

    def record_draft_prefill(self, tokens: int, seconds: float) -> None:
        """A step in which draft sessions prefilled `tokens` context tokens, and did nothing else, in `seconds`."""
        if tokens and seconds > 0:
            self._draft_prefill.add(tokens, seconds)

    def record_finished(self, generated_tokens: int) -> None:
        """A request ended on its own (EOS) after `generated_tokens` output tokens. One cut by its max_tokens says
        nothing of an answer's length."""
        self._answer_lengths.append(generated_tokens)

    def expected_remaining(self, generated: int, max_tokens: int) -> int:
        """Output tokens a request that has `generated` is still expected to produce: what its max_tokens allows,
        cut to the median length of the last 32 answers that ended on their own (a request already past it is
        assumed to run half that again). A median, so one short warm-up ("say hello") does not make every answer
        look short; before 3 answers have ended on their own, max_tokens (optimistic, like every start here)."""
        allowed = max_tokens - generated
        if len(self._answer_lengths) < 3:
            return allowed
        typical = statistics.median(self._answer_lengths)
        return max(1, min(allowed, round(max(typical - generated, typical / 2))))

    def catch_up(self, saved_per_token: Callable[[], float], kind: tuple, remaining_tokens: int,
                 lag: int) -> CatchUp:
        """Whether a draft session of `kind` should prefill the `lag` context tokens it still lacks: it should when
        the seconds speculation is expected to save over the request's `remaining_tokens` exceed what the catch-up
        costs at the draft's measured prefill rate. `saved_per_token()` is `seconds_saved_per_token` of the batch
        the request decodes in (its own among them), which the caller computes once per step for all its catch-ups.
        Until the draft's prefill rate is measured, a catch-up is priced as the target's own forward over the `lag`
        tokens (the cost table): a bound, as a draft is smaller than its target, so on a machine where the draft
        prefills slowly next to what it could save (a CPU, short answers) the first request does not buy a
        catch-up only to learn that, and where drafting pays the first catch-up measures the rate. The acceptance
        it rests on is the depth choice's own (`priors`: while the kind is learning, shrunk towards
        `optimistic_acceptance`, as a pessimistic start would never draft, so never learn), so a catch-up is bought
        only where the choice would then draft: a kind whose first trees are mostly rejected stops buying catch-ups
        before its `learn_trees` are reached, and a batch in which drafting would not pay, such as a busy CPU,
        defers. While the kind is learning, the saving rests on that assumed acceptance, an upper bound, so it must
        cover the cost `learning_margin` times: a draft that would pay only if nearly every token were accepted (a
        CPU, where a draft level costs a quarter of a target step and a verify row two fifths) is not bought for a
        short answer on a promise."""
        learning = self.learning(kind)
        saved = remaining_tokens * saved_per_token()
        why = "its acceptance is not measured yet: assumed high" if learning else ""
        if self._draft_prefill.steps == 0:
            cost = self.target_cost(lag)
            why = "; ".join(filter(None, [why, "the draft's prefill rate is not measured yet: priced at the target's"]))
        else:
            cost = lag / max(self._draft_prefill.rate, 1e-9)
        return CatchUp(saved > (self.learning_margin if learning else 1.0) * cost, saved, cost, why)
