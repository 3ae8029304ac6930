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

Random numbers: a step draws exactly 1 + n uniforms per tree from the request's generator (`step_uniforms`), node
i's acceptance test uses uniform 1 + i and the bonus uses uniform 0 (by inverse CDF). A step therefore consumes the
same draws however far verification gets, so the per-tree reference (`verify_stochastic`) and the batch
(`verify_on_device`) draw identically and commit identical seeded samples.

Two implementations, one algorithm:
- `verify_greedy` / `verify_stochastic`: one tree, walked in Python: the reference (the tests' oracle).
- `verify_on_device`: every tree of a batched step at once (continuous batching), the way the target runs on a GPU:
  flat per-batch metadata built on the host (`BatchLayout`: each logit row's parent row, token and children, the
  shape vLLM's rejection sampler takes), tensor operations level by level over all requests, and a single
  device-to-host copy of the outcome per step (tests/unit/test_verify_batch.py counts it).
`verify_batch`, what the engine calls, picks `verify_on_device` on an accelerator and the trees one by one on a CPU.
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


# ---- shared by both implementations --------------------------------------------------------------------------------

def step_uniforms(tree_size: int, generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """The step's uniforms for one tree, [1 + n]: index 0 for the bonus, 1 + i for node i's acceptance test."""
    return torch.rand(1 + tree_size, generator=generator, device=device)


def sample_by_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [..., V] (rows sum to > 0), u [...] uniforms in [0, 1) -> [...] indices, P(i) = probs[i] / sum."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def accepts(u: torch.Tensor, q_x: torch.Tensor, r_x: torch.Tensor) -> torch.Tensor:
    """u < min(1, r/q), tested as u * q < r in float64 (exact for float32 inputs) and only where q > 0."""
    return (q_x > 0) & (u.double() * q_x.double() < r_x.double())


def _normalize(dist: torch.Tensor) -> torch.Tensor | None:
    total = dist.sum()
    return dist / total if total > 0 else None


# ---- the reference: one tree ---------------------------------------------------------------------------------------

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


def verify_stochastic(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """target_probs: [1 + n, V] processed target distributions (temperature/top-p/top-k applied)."""
    children = tree.children()
    tokens = tree.token_ids.tolist()
    vocab = target_probs.shape[-1]
    uniforms = step_uniforms(tree.size, generator, target_probs.device)
    node, path = -1, []
    while True:
        residual = target_probs[node + 1].clone()  # [V]
        kids = children.get(node, [])
        accepted = None
        if kids:
            draft_q = scatter_to_full_vocab(tree.draft_probs[node].float(), tree.active_ids, vocab)  # [V]
            for child in kids:
                x = tokens[child]
                if accepts(uniforms[1 + child], draft_q[x], residual[x]):
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
            bonus = int(sample_by_inverse_cdf(residual, uniforms[0]))
            return VerifyResult(path, [tokens[i] for i in path], bonus)
        path.append(accepted)
        node = accepted


# ---- the batch: every tree of a step at once -------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchLayout:
    """Flat metadata of a batch of trees over the packed logit rows (request i: its root row, then its n_i nodes),
    built on the host from the trees' structure and copied to the logits' device in one transfer.

    offsets: [B + 1] request i's rows are offsets[i] .. offsets[i + 1] - 1.
    parent_row: [R] each row's parent row (a root row: itself).   token: [R] each node row's token (a root row: 0).
    is_root: [R].   follows: [R] a node the greedy walk may take (no earlier sibling drafted the same token).
    children: [R, W] each row's children rows in drafting order, -1 padded.   depth: the deepest tree's depth.
    """
    offsets: list[int]
    parent_row: torch.Tensor
    token: torch.Tensor
    is_root: torch.Tensor
    follows: torch.Tensor
    children: torch.Tensor
    depth: int

    @classmethod
    def of(cls, trees: Sequence[DraftTree], device: torch.device) -> BatchLayout:
        offsets, parent_row, token, is_root, follows, children, depth = [0], [], [], [], [], [], 0
        for tree in trees:
            base, tokens, parents = offsets[-1], tree.token_ids.tolist(), tree.parents.tolist()
            kids: list[list[int]] = [[] for _ in range(1 + len(tokens))]
            levels = [0] * len(tokens)
            seen: set[tuple[int, int]] = set()
            parent_row.append(base)
            token.append(0)
            is_root.append(1)
            follows.append(0)
            for i, (tok, par) in enumerate(zip(tokens, parents)):
                parent_row.append(base + 1 + par)
                token.append(tok)
                is_root.append(0)
                follows.append(int((par, tok) not in seen))
                seen.add((par, tok))
                kids[1 + par].append(base + 1 + i)
                levels[i] = 1 + (levels[par] if par >= 0 else 0)
            children.extend(kids)
            depth = max([depth, *levels])
            offsets.append(base + 1 + len(tokens))
        width = max([1, *(len(k) for k in children)])
        rows = len(parent_row)
        flat = parent_row + token + is_root + follows + [c for k in children for c in [*k, *[-1] * (width - len(k))]]
        packed = to_device(torch.tensor(flat, dtype=torch.long), device)
        parent, tok, root, follow, kids = packed.split([rows, rows, rows, rows, rows * width])
        return cls(offsets, parent, tok, root.bool(), follow.bool(), kids.view(rows, width), depth)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a synchronising copy (pinned memory, non-blocking) on a GPU."""
    if host.device == torch.device(device):
        return host
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def verify_batch(trees: Sequence[DraftTree], logits: torch.Tensor, samplings: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[VerifyResult]:
    """Many requests' trees verified together (continuous batching), each with its own sampling parameters.

    logits: [sum_i (1 + n_i), V], request i's rows (root, then its n_i nodes) packed after request i-1's, as one
    batched target forward returns them. On an accelerator: `verify_on_device` (one host synchronisation per step).
    On a CPU: `verify_each`, the trees one by one, since a host synchronisation costs nothing there and the
    batch's full-vocabulary passes cost more (measured in docs/architecture.md, "Verification"). Both give
    identical results (tests/unit/test_verify_batch.py).
    """
    rows = sum(1 + tree.size for tree in trees)
    if rows != logits.shape[0]:
        raise ValueError(f"verify_batch: {logits.shape[0]} logit rows for trees needing {rows}")
    if logits.device.type == "cpu":
        return verify_each(trees, logits, samplings, generators)
    return verify_on_device(trees, logits, samplings, generators)


def verify_each(trees: Sequence[DraftTree], logits: torch.Tensor, samplings: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[VerifyResult]:
    """The trees one by one with the reference functions (greedy requests share one argmax over all rows)."""
    argmax = logits.argmax(-1).tolist() if any(s.greedy for s in samplings) else []  # [sum (1 + n_i)]
    results, lo = [], 0
    for tree, sampling, generator in zip(trees, samplings, generators):
        hi = lo + 1 + tree.size
        if sampling.greedy:
            results.append(_greedy_walk(tree, argmax[lo:hi]))
        else:
            results.append(verify_stochastic(tree, logits_to_probs(logits[lo:hi], sampling), generator))
        lo = hi
    return results


def verify_on_device(trees: Sequence[DraftTree], logits: torch.Tensor, samplings: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None]) -> list[VerifyResult]:
    """Batch-first: greedy requests are walked together over one argmax; sampled requests run the rejection sampler
    level by level, all at once, each with its own uniforms (`step_uniforms`). Everything stays on the logits'
    device until one copy of the outcome to the host."""
    layout = BatchLayout.of(trees, logits.device)
    if layout.offsets[-1] != logits.shape[0]:
        raise ValueError(f"verify_on_device: {logits.shape[0]} logit rows for trees needing {layout.offsets[-1]}")
    if not trees:
        return []
    sampled = [i for i, s in enumerate(samplings) if not s.greedy]
    argmax = logits.argmax(-1)  # [R]
    outcome = [argmax, _greedy_alive(layout, argmax).long()]
    if sampled:
        chosen, bonus = _sample_levels(layout, trees, logits, samplings, generators, sampled)
        outcome += [chosen.flatten(), bonus]
    host = torch.cat(outcome).tolist()  # the step's one device-to-host copy
    rows = len(layout.parent_row)
    argmax_h, alive_h = host[:rows], host[rows:2 * rows]
    results = [_greedy_result(tree, layout.offsets[i], argmax_h, alive_h) for i, tree in enumerate(trees)]
    if sampled:
        levels = layout.depth + 1
        chosen_h = host[2 * rows:2 * rows + levels * len(sampled)]
        bonus_h = host[2 * rows + levels * len(sampled):]
        for s, i in enumerate(sampled):
            path = [chosen_h[level * len(sampled) + s] for level in range(levels)]
            results[i] = _sampled_result(trees[i], layout.offsets[i], path, bonus_h[s])
    return results


def _greedy_alive(layout: BatchLayout, argmax: torch.Tensor) -> torch.Tensor:
    """[R] rows on their tree's greedy path (roots included): a node is on it when its token is its parent's argmax
    and its parent is on it. At most one child per node qualifies (`follows`), so each tree's path is a chain."""
    matches = layout.follows & (layout.token == argmax[layout.parent_row])
    alive = layout.is_root
    for _ in range(layout.depth):
        alive = layout.is_root | (matches & alive[layout.parent_row])
    return alive


def _greedy_result(tree: DraftTree, base: int, argmax: list[int], alive: list[int]) -> VerifyResult:
    nodes = [i for i in range(tree.size) if alive[base + 1 + i]]
    end = base + 1 + nodes[-1] if nodes else base
    tokens = tree.token_ids.tolist()
    return VerifyResult(nodes, [tokens[i] for i in nodes], argmax[end])


def _sampled_result(tree: DraftTree, base: int, path_rows: list[int], bonus: int) -> VerifyResult:
    nodes = [row - base - 1 for row in path_rows if row >= 0]
    tokens = tree.token_ids.tolist()
    return VerifyResult(nodes, [tokens[i] for i in nodes], bonus)


def _sample_levels(layout: BatchLayout, trees: Sequence[DraftTree], logits: torch.Tensor,
                   samplings: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                   sampled: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection sampler over the sampled requests at once: level by level from the roots, each request's
    children tried in drafting order (at most W per level). Returns the node row accepted at each level
    ([depth + 1, S], -1 once the request has stopped) and each request's bonus token [S]."""
    device = logits.device
    probs, uniforms, q_rows, q_index = _sampled_inputs(layout, trees, logits, samplings, generators, sampled)
    roots = to_device(torch.tensor([layout.offsets[i] for i in sampled]), device)  # [S] rows
    cur = roots
    stopped = torch.zeros(len(sampled), dtype=torch.bool, device=device)
    bonus = torch.zeros(len(sampled), dtype=torch.long, device=device)
    chosen_by_level = []
    for _ in range(layout.depth + 1):
        residual, q = probs[cur], q_rows[q_index[cur]]  # [S, V] each
        chosen = torch.full_like(cur, -1)
        trying = ~stopped
        for k in range(layout.children.shape[1]):
            child = layout.children[cur, k]
            has = trying & (child >= 0)
            x = layout.token[child.clamp_min(0)].unsqueeze(1)  # [S, 1]
            ok = has & accepts(uniforms[child.clamp_min(0)], q.gather(1, x).squeeze(1),
                               residual.gather(1, x).squeeze(1))
            chosen = torch.where(ok, child, chosen)
            trying = trying & ~ok
            rejected = (has & ~ok).unsqueeze(1)
            cut = (residual - q).clamp_min(0)
            cut_total = cut.sum(-1, keepdim=True)
            residual = torch.where(rejected & (cut_total > 0), cut / cut_total, residual)
            q_less = q.scatter(1, x, 0.0)
            q_total = q_less.sum(-1, keepdim=True)
            q = torch.where(rejected & (q_total > 0), q_less / q_total, q)
            trying = trying & ~(rejected & (q_total <= 0)).squeeze(1)
        ends = ~stopped & (chosen < 0)
        bonus = torch.where(ends, sample_by_inverse_cdf(residual, uniforms[roots]), bonus)
        chosen_by_level.append(torch.where(stopped, torch.full_like(chosen, -1), chosen))
        stopped = stopped | ends
        cur = torch.where(stopped, cur, chosen)
    return torch.stack(chosen_by_level), bonus


def _sampled_inputs(layout: BatchLayout, trees: Sequence[DraftTree], logits: torch.Tensor,
                    samplings: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                    sampled: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the sampled requests: the target's processed distribution (probs [R, V]), its uniform ([R]), and
    the draft distribution its children were drawn from, over the full vocabulary (q_rows[q_index[row]]; row 0 of
    q_rows is zeros, for rows without children and for greedy requests' rows)."""
    device, vocab = logits.device, logits.shape[-1]
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=device)
    uniforms = torch.zeros(logits.shape[0], dtype=torch.float32, device=device)
    draft_rows, draft_ids, q_index = [], [], [0] * logits.shape[0]
    for i in sampled:
        lo, hi, tree = layout.offsets[i], layout.offsets[i + 1], trees[i]
        probs[lo:hi] = logits_to_probs(logits[lo:hi], samplings[i])
        uniforms[lo:hi] = step_uniforms(tree.size, generators[i], device)
        for node, q in tree.draft_probs.items():
            q_index[lo + 1 + node] = 1 + len(draft_rows)
            draft_rows.append(q.float())
            draft_ids.append(tree.active_ids)
    q_rows = torch.zeros(1 + len(draft_rows), vocab + 1, dtype=torch.float32, device=device)
    if draft_rows:
        width = max(q.shape[-1] for q in draft_rows)
        q = torch.stack([torch.nn.functional.pad(to_device(r, device), (0, width - r.shape[-1])) for r in draft_rows])
        ids = torch.stack([torch.nn.functional.pad(to_device(a, device), (0, width - a.shape[-1]), value=-1)
                           for a in draft_ids])
        q_rows[1:].scatter_(1, torch.where(ids >= 0, ids, vocab), q)  # unused slots (id -1) land in column V
    return probs, uniforms, q_rows[:, :vocab].contiguous(), to_device(torch.tensor(q_index), device)
