"""Verification of a draft tree against the target: a pure module (no models, no request bookkeeping).

Terms
- root: the last committed token; the target's row 0 gives the distribution of the token after it.
- row i+1 of the target output belongs to tree node i: the distribution of the token after node i.
- accepted: the draft nodes kept, a root-to-node path in the tree.
- bonus: the one token the target adds after the accepted path (sampled from its, possibly residual, distribution).
- τ (mean accepted length): tokens committed per step = len(accepted) + 1 (bonus included); 1.0 = nothing accepted.

Greedy: follow the child whose token equals the target argmax; stop where no child matches; bonus = that argmax.
Stochastic: multi-draft recursive rejection sampling (SpecInfer / RSD). Children of a node were drawn from the draft
distribution q *without replacement* in the stored order. For candidate x with residual target distribution r and
current draft distribution q_cur: accept with probability min(1, r[x] / q_cur[x]); on rejection
r <- normalize(max(r - q_cur, 0)) and q_cur <- q_cur with x removed, renormalized. If every child is rejected the
bonus is drawn from r. The output distribution equals the target's exactly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from evospec.config import SamplingParams
from evospec.kernels.pruned_head import scatter_to_full_vocab
from evospec.sampling import logits_to_probs
from evospec.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: list[int]
    accepted_tokens: list[int]
    bonus_token: int

    @property
    def committed_tokens(self) -> list[int]:
        return [*self.accepted_tokens, self.bonus_token]


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """target_logits: [1 + n, V] (row 0 = root)."""
    return _greedy_walk(tree, target_logits.argmax(-1).tolist())


def _greedy_walk(tree: DraftTree, argmax: list[int]) -> VerifyResult:
    """argmax: the target's choice after the root and after each node, [1 + n]."""
    children = tree.children()
    tokens = tree.token_ids.tolist()
    node, path = -1, []
    while True:
        want = argmax[node + 1]
        match = next((c for c in children.get(node, []) if tokens[c] == want), None)
        if match is None:
            return VerifyResult(path, [tokens[i] for i in path], want)
        path.append(match)
        node = match


def _normalize(dist: torch.Tensor) -> torch.Tensor | None:
    total = dist.sum()
    return dist / total if total > 0 else None


def verify_stochastic(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """target_probs: [1 + n, V] processed target distributions (temperature/top-p/top-k applied)."""
    children = tree.children()
    tokens = tree.token_ids.tolist()
    vocab = target_probs.shape[-1]
    node, path = -1, []
    while True:
        residual = target_probs[node + 1].clone()  # [V]
        kids = children.get(node, [])
        accepted = None
        if kids:
            draft_q = scatter_to_full_vocab(tree.draft_probs[node].float(), tree.active_ids, vocab)  # [V]
            for child in kids:
                x = tokens[child]
                u = torch.rand((), generator=generator, device=residual.device).item()
                q_x, r_x = draft_q[x].item(), residual[x].item()
                if q_x > 0 and u * q_x < r_x:  # u < min(1, r/q)
                    accepted = child
                    break
                new_residual = _normalize((residual - draft_q).clamp_min(0))
                if new_residual is None:  # r == q_cur: rejection had probability 0; keep r (numerical guard)
                    new_residual = residual
                residual = new_residual
                draft_q = draft_q.clone()
                draft_q[x] = 0
                draft_q = _normalize(draft_q)
                if draft_q is None:
                    break
        if accepted is None:
            bonus = int(torch.multinomial(residual, 1, generator=generator).item())
            return VerifyResult(path, [tokens[i] for i in path], bonus)
        path.append(accepted)
        node = accepted


def verify_batch(trees: Sequence[DraftTree], logits: torch.Tensor, samplings: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[VerifyResult]:
    """Many requests' trees verified together (continuous batching), each with its own sampling parameters.

    logits: [sum_i (1 + n_i), V], request i's rows (root, then its n_i nodes) packed after request i-1's, as one
    batched target forward returns them. Greedy requests share one argmax over all their rows; each sampled request
    runs the rejection sampler above on its own rows with its own generator (the same draws, in the same order, as
    verifying it alone). `verify_greedy` / `verify_stochastic` are the reference (tests/unit/test_scheduler.py;
    the references themselves: tests/unit/test_kernels_exact.py, tests/unit/test_sampling_distribution.py).
    """
    offsets = [0]
    for tree in trees:
        offsets.append(offsets[-1] + 1 + tree.size)
    if offsets[-1] != logits.shape[0]:
        raise ValueError(f"verify_batch: {logits.shape[0]} logit rows for trees needing {offsets[-1]}")
    argmax = logits.argmax(-1).tolist() if any(s.greedy for s in samplings) else []  # [sum (1 + n_i)]
    results = []
    for i, (tree, sampling, generator) in enumerate(zip(trees, samplings, generators)):
        lo, hi = offsets[i], offsets[i + 1]
        if sampling.greedy:
            results.append(_greedy_walk(tree, argmax[lo:hi]))
        else:
            results.append(verify_stochastic(tree, logits_to_probs(logits[lo:hi], sampling), generator))
    return results
