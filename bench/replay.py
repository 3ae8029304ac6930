"""Acceptance replayed from measured rates, for benchmarks on models with random weights (scripts/gpu_check.sh).

A step's cost comes from the models' shapes; how many tokens it commits comes from how well the draft predicts the
target, which random weights cannot show (they accept almost nothing). `ReplayedAcceptance` keeps the cost real and
the acceptance measured: the engine's verification runs in full (its forward, its sampling, its host sync), then its
outcome is replaced by one drawn from a real pair's per-depth acceptance rates, and the engine commits that outcome
as it commits any other (KV compaction, the draft's catch-up, buffer updates).

Rates: `acceptance_by_depth` of `evospec bench real` (bench/harness.py), by_depth[d - 1] = the share of steps that
accepted at least d drafted tokens. A step draws u ~ U(0, 1) and accepts k = #{d : u < by_depth[d - 1]} nodes, so
P(k >= d) = by_depth[d - 1] exactly, along the tree's first-child path (a chain: its first k nodes); the bonus token is
the real verification's (its value does not change a step's cost). Not lossless: benchmarks only.
"""
from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

from evospec.config import SamplingParams
from evospec.tree import DraftTree
from evospec.verify import VerifyResult, verify_batch

# Per-depth acceptance of the real pair (Qwen2.5-Coder 0.5B -> 1.5B), medical prompts, greedy, chain of 4 and tree
# depth 4 x branching 2, budget 8, from `evospec bench real --sets medical --temperatures 0 ... --out
# results/acceptance_real` (the whole command: docs/results.md, "The GPU check, prepared").
ACCEPTANCE_RESULTS = Path("results/acceptance_real/bench_real.json")


def measured_acceptance(path: Path = ACCEPTANCE_RESULTS, cell: str = "medical/greedy") -> dict[str, list[float]]:
    """Per arm of a `evospec bench real` run (e.g. "sd", "frspec-32k-tree"): its acceptance by depth."""
    arms = json.loads(path.read_text())["results"][cell]
    return {arm: v["acceptance_by_depth"] for arm, v in arms.items() if v.get("acceptance_by_depth")}


@dataclass
class ReplayedAcceptance:
    by_depth: list[float]  # by_depth[d - 1]: the share of steps that accept at least d drafted tokens
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if any(not 0.0 <= p <= 1.0 for p in self.by_depth) or any(
                b > a for a, b in zip(self.by_depth, self.by_depth[1:])):
            raise ValueError(f"acceptance by depth must be non-increasing shares in [0, 1], got {self.by_depth}")
        self._rng = random.Random(self.seed)

    def accepted_count(self, depth: int) -> int:
        """How many drafted tokens this step accepts, at most `depth`."""
        u = self._rng.random()
        return sum(1 for p in self.by_depth[:depth] if u < p)

    def expected_tau(self, depth: int) -> float:
        """Tokens a step commits on average with trees `depth` levels deep: 1 + E[accepted] = 1 + sum of P(k >= d)."""
        return 1.0 + sum(self.by_depth[:depth])

    def verify_batch(self, trees: Sequence[DraftTree], logits: torch.Tensor, samplings: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None]) -> list[VerifyResult]:
        """The engine's verification (paid in full), its outcomes replaced by replayed ones."""
        real = verify_batch(trees, logits, samplings, generators)
        return [self.replayed(tree, result) for tree, result in zip(trees, real)]

    def replayed(self, tree: DraftTree, real: VerifyResult) -> VerifyResult:
        path = first_child_path(tree, self.accepted_count(tree.depth))
        return VerifyResult(path, tree.token_ids[path].tolist(), real.bonus_token)


def first_child_path(tree: DraftTree, length: int) -> list[int]:
    """The nodes from the root down each node's first-drafted child, at most `length` of them."""
    children = tree.children()
    path, node = [], -1
    while len(path) < length and children.get(node):
        node = children[node][0]
        path.append(node)
    return path


@contextlib.contextmanager
def replayed(acceptance: ReplayedAcceptance) -> Iterator[None]:
    """The target engine verifies with `acceptance` inside the block."""
    with mock.patch("evospec.engine.target.verify_batch", acceptance.verify_batch):
        yield
