"""Prompt lookup (`lookup`): chains drafted from the request's own context, on the target replica.

Each earlier occurrence of the context's last `LOOKUP_MIN_NGRAM` tokens (prompt + committed output) is scored by how
far back its match with the context runs; the longest match (the latest on a tie) proposes the tokens that followed
it, as vLLM's `ngram` and llama.cpp's lookup decoding do with a fixed n-gram. The match length also bounds the chain
(`LOOKUP_CHAIN_BY_MATCH`): a 3-token match is right about its next token about three times in four on RAG answers
and far less often about the ones after, a match of 6+ tokens usually for several (docs/results.md, "Chains as long
as their match"). No draft model and no draft stream: a proposal is a dictionary probe, so a verify row is the only
price of a drafted token, which is what makes speculation pay where a draft model's level costs nearly a third of a
target step (a 2-core CPU: docs/results.md, "Prompt lookup").

Lossless as every method here: a proposal is a function of committed tokens alone, verified like a draft's chain.
Under sampling the chain's draft distribution is one-hot at each proposed token (q(x) = 1), so a node is accepted
with probability p(x) and a rejection samples p without x: exactly the target's distribution (verify.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from evospec.config import (
    LOOKUP_CANDIDATES,
    LOOKUP_CHAIN_BY_MATCH,
    LOOKUP_MAX_MATCH,
    LOOKUP_MIN_NGRAM,
    SamplingParams,
)
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.tree import DraftTree


class Match(NamedTuple):
    length: int  # context tokens that match, counted back from the end (>= the index's min_n)
    follower: int  # where the token after the match's earlier occurrence sits


class NgramIndex:
    """A request's context with, per n-gram of `min_n` tokens, where the token after each occurrence sits. Grows by
    the committed tokens; its size is bounded by the context's (one entry per token)."""

    def __init__(self, tokens: list[int], min_n: int = LOOKUP_MIN_NGRAM, max_match: int = LOOKUP_MAX_MATCH,
                 candidates: int = LOOKUP_CANDIDATES,
                 chain_by_match: tuple[tuple[int, int], ...] = LOOKUP_CHAIN_BY_MATCH):
        if not 1 <= min_n <= max_match:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_match; got {min_n}, {max_match}")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1; got {candidates}")
        self.min_n, self.max_match, self.candidates, self.chain_by_match = min_n, max_match, candidates, chain_by_match
        self.tokens: list[int] = []
        self._followers: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens: the n-gram that ends just before each one now has a follower there."""
        n = self.min_n
        for token in tokens:
            at = len(self.tokens)
            if at >= n:
                self._followers.setdefault(tuple(self.tokens[at - n:at]), []).append(at)
            self.tokens.append(token)

    def match(self) -> Match | None:
        """The earlier occurrence of the last `min_n` tokens whose match with the context runs back furthest (up to
        `max_match`), among its `candidates` latest; the latest on a tie. None when they never occurred before."""
        end = len(self.tokens)
        if end < self.min_n:
            return None
        best = None
        for follower in reversed(self._followers.get(tuple(self.tokens[end - self.min_n:]), [])[-self.candidates:]):
            length = self.min_n
            while (length < self.max_match and follower - length > 0
                   and self.tokens[follower - length - 1] == self.tokens[end - length - 1]):
                length += 1
            if best is None or length > best.length:
                best = Match(length, follower)
        return best

    def chain_limit(self, match_length: int) -> int | None:
        """The longest chain a match of this length proposes; None: no limit but the step's depth."""
        return next((chain for shorter_than, chain in self.chain_by_match if match_length < shorter_than), None)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens (fewer where the match is short: `chain_limit`) that followed the best earlier occurrence
        of the context's end (`match`); [] when its last `min_n` tokens never occurred before."""
        found = self.match()
        if found is None:
            return []
        limit = self.chain_limit(found.length)
        return self.tokens[found.follower:found.follower + (k if limit is None else min(k, limit))]


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
