"""Prompt lookup (`lookup`): chains drafted from the request's own context, on the target replica.

The longest suffix of the context (prompt + committed output), of `LOOKUP_MAX_NGRAM` down to `LOOKUP_MIN_NGRAM`
tokens, that occurred earlier in it proposes the tokens that followed its latest earlier occurrence (as vLLM's
`ngram` and llama.cpp's lookup decoding). No draft model and no draft stream: a proposal is a dictionary probe, so a
verify row is the only price of a drafted token, which is what makes speculation pay where a draft model's level
costs nearly a third of a target step (a 2-core CPU: docs/results.md, "Prompt lookup").

Lossless as every method here: a proposal is a function of committed tokens alone, verified like a draft's chain.
Under sampling the chain's draft distribution is one-hot at each proposed token (q(x) = 1), so a node is accepted
with probability p(x) and a rejection samples p without x: exactly the target's distribution (verify.py).
"""
from __future__ import annotations

import torch

from evospec.config import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM, SamplingParams
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.tree import DraftTree


class NgramIndex:
    """A request's context with, per n-gram size, where the token after each n-gram's latest occurrence sits.
    Grows by the committed tokens; its size is bounded by the context's (at most `sizes` entries per token)."""

    def __init__(self, tokens: list[int], min_n: int = LOOKUP_MIN_NGRAM, max_n: int = LOOKUP_MAX_NGRAM):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n; got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._follower: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens: each n-gram that ends just before one now has a follower there."""
        for token in tokens:
            at = len(self.tokens)
            for n, follower in self._follower.items():
                if at >= n:
                    follower[tuple(self.tokens[at - n:at])] = at
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix; [] when no
        suffix of at least `min_n` tokens occurred before."""
        end = len(self.tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if end >= n and (start := self._follower[n].get(tuple(self.tokens[end - n:]))) is not None:
                return self.tokens[start:start + k]
        return []


def chain_tree(tokens: list[int], sampling: SamplingParams) -> DraftTree:
    """A proposed chain as a draft tree; under sampling with its one-hot draft distributions over the chain's
    distinct tokens."""
    if not tokens:
        return DraftTree.empty()
    ids = torch.tensor(tokens, dtype=torch.long)
    parents = torch.arange(-1, len(tokens) - 1, dtype=torch.long)
    if sampling.greedy:
        return DraftTree(ids, parents)
    active = sorted(set(tokens))
    column = {token: i for i, token in enumerate(active)}
    draft_probs = {}
    for node, token in enumerate(tokens):
        q = torch.zeros(len(active))
        q[column[token]] = 1.0
        draft_probs[node - 1] = q  # the distribution node `node` was "drawn" from, keyed by its parent
    return DraftTree(ids, parents, draft_probs, torch.tensor(active, dtype=torch.long))


class LookupDrafter:
    """The per-request loop's `Drafter` for `lookup` (engine/generate.py): chains of up to `levels` tokens."""

    def __init__(self, prompt_ids: list[int], sampling: SamplingParams, levels: int):
        self.index, self.sampling, self.levels = NgramIndex(prompt_ids), sampling, levels

    def propose(self) -> DraftTree:
        return chain_tree(self.index.propose(self.levels), self.sampling)

    def observe(self, verified: VerifiedStep, stats: SpecStats) -> None:
        self.index.extend(verified.result.committed_tokens)

    def close(self) -> None:
        pass
