"""Where dynamic-buffer candidates come from. Each source returns {token id: score} over long-tail ids (∉ S).

- statistical: long-tail ids of the prompt and the committed output, counts with per-step recency decay, plus an
  optional offline co-occurrence index ("token a seen -> long-tail b likely") built from a domain corpus.
- semantic: nearest long-tail neighbours, in the draft's (tied) embedding space, of the recent context (mean of
  normalized embeddings of the last `window` tokens) and of each recent long-tail token. `EmbeddingIndex`: a scan in
  a low-rank projection re-ranked exactly, behind the `NeighbourIndex` interface (swap in FAISS for bigger pools).
- target-fed: the target sees full-vocabulary logits at every verified position; its token there when ∉ A (a miss)
  and any token ∉ A with probability >= `min_prob` become candidates with top priority.
Score scales: statistical ~ decayed counts (0..~10), semantic = cosine (0..1), target-fed = TARGET_PRIORITY + prob.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

TARGET_PRIORITY = 100.0


class StatisticalRetriever:
    """Decayed counts of long-tail ids, kept sparse (only ids seen so far): per step it costs O(new tokens + k log n),
    not O(vocabulary). Decay is lazy: stored values are score * decay**-step, rescaled before they overflow."""

    def __init__(self, long_tail: list[bool], decay: float = 0.95, cooc: "CoocIndex | None" = None,
                 cooc_weight: float = 0.5):
        self.long_tail = long_tail  # [V] bools, shared by all sessions
        self.decay = decay
        self.cooc = cooc
        self.cooc_weight = cooc_weight
        self.scores: dict[int, float] = {}
        self.step = 0

    def _add(self, token: int, amount: float) -> None:
        if self.long_tail[token]:
            self.scores[token] = self.scores.get(token, 0.0) + amount

    def observe(self, tokens: list[int]) -> None:
        self.step += 1
        scale = self.decay ** -self.step
        if scale > 1e150:  # fold the decay into the stored values, restart the clock
            self.scores = {t: v / scale for t, v in self.scores.items()}
            self.step, scale = 0, 1.0
        for tok in tokens:
            self._add(tok, scale)
        if self.cooc is not None and tokens:
            pred_ids, pred_scores = self.cooc.expand(tokens)
            for tok, w in zip(pred_ids.tolist(), pred_scores.tolist()):
                self._add(tok, self.cooc_weight * w * scale)

    def candidates(self, k: int) -> dict[int, float]:
        now = self.decay ** self.step
        return {t: v * now for t, v in heapq.nlargest(k, self.scores.items(), key=lambda kv: kv[1])}


class CoocIndex:
    """keys [n] sorted token ids; neighbours [n, m] long-tail ids (-1 pad); weights [n, m] in [0, 1]."""

    def __init__(self, keys: torch.Tensor, neighbours: torch.Tensor, weights: torch.Tensor):
        self.keys, self.neighbours, self.weights = keys.long(), neighbours.long(), weights.float()

    def expand(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = torch.searchsorted(self.keys, ids).clamp_max(self.keys.shape[0] - 1)
        hit = self.keys[pos] == ids
        nb, w = self.neighbours[pos[hit]].flatten(), self.weights[pos[hit]].flatten()
        keep = nb >= 0
        return nb[keep], w[keep]

    @classmethod
    def load(cls, path) -> "CoocIndex":
        from safetensors.torch import load_file
        t = load_file(str(path))
        return cls(t["keys"], t["neighbours"], t["weights"])


class NeighbourIndex(Protocol):
    """vectors [q, hidden], allowed [V] bool on the index's device -> (ids [q, k'], sims [q, k']), best first; when
    fewer than k' ids are allowed the rest come back with sim -inf (callers keep positive sims only)."""
    embeddings: torch.Tensor  # [V, hidden] the rows queries are built from

    def query(self, vectors: torch.Tensor, k: int, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class EmbeddingIndex:
    """Cosine top-k over the draft's embedding rows, restricted per query to `allowed` ids ([V] bool: a policy's long
    tail), built once per draft and shared by every policy and session.

    A pool too wide to scan at full width per query is searched in a `rank`-dim projection onto the rows' top
    principal directions (uncentered: they keep dot products best), then the `oversample` x k best are re-ranked
    exactly. Measured on Qwen2.5-Coder-0.5B (151,936 x 896 rows, fp32, 2 cores): the exact scan reads 0.5 GB per
    query batch (~90-140 ms); the 128-dim scan reads 78 MB. vectors: [q, hidden] -> (ids [q, k], sims [q, k])."""

    def __init__(self, embeddings: torch.Tensor, pool_ids: torch.Tensor, rank: int = 128, oversample: int = 4):
        self.embeddings = embeddings.detach()
        self.pool_ids = pool_ids.to(embeddings.device)  # [P]
        self.oversample = oversample
        rows = normalized(self.embeddings.index_select(0, self.pool_ids).float())  # [P, hidden]
        self.projection = None if rows.shape[1] <= rank else top_directions(rows, rank)  # [hidden, rank]
        self.pool_rows = rows if self.projection is None else rows @ self.projection  # [P, rank or hidden]

    def query(self, vectors: torch.Tensor, k: int, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vectors = normalized(vectors.float().to(self.pool_rows.device))  # [q, hidden]
        scan = vectors if self.projection is None else vectors @ self.projection
        sims = (scan @ self.pool_rows.T).masked_fill(~allowed[self.pool_ids], float("-inf"))  # [q, P]
        width = k if self.projection is None else k * self.oversample
        top = sims.topk(min(width, sims.shape[-1]), dim=-1)
        ids = self.pool_ids[top.indices]  # [q, width]
        if self.projection is None:
            return ids, top.values
        exact = torch.einsum("qh,qwh->qw", vectors, normalized(self.embeddings[ids].float()))  # [q, width]
        exact = exact.masked_fill(top.values == float("-inf"), float("-inf"))
        best = exact.topk(min(k, exact.shape[-1]), dim=-1)
        return ids.gather(1, best.indices), best.values


def normalized(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def top_directions(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """[hidden, rank]: eigenvectors of rows^T rows with the largest eigenvalues (deterministic; one pass over rows)."""
    _, vectors = torch.linalg.eigh(rows.T @ rows)  # ascending eigenvalues
    return vectors[:, -rank:].flip(-1).contiguous()


class SemanticRetriever:
    """Nearest long-tail neighbours of the recent context: one query for the mean of the last `window` tokens and
    one per recent long-tail token (at most 8); `k` neighbours in all, kept only with a positive cosine."""

    def __init__(self, index: NeighbourIndex, long_tail: torch.Tensor, window: int = 32, k: int = 32):
        self.index, self.long_tail = index, long_tail  # long_tail: [V] bool on the CPU (token-id lookups)
        self.allowed = long_tail.to(index.embeddings.device)  # the same mask where the index searches
        self.window, self.k = window, k

    def candidates(self, tokens: list[int]) -> dict[int, float]:
        recent = tokens[-self.window:]
        if not recent:
            return {}
        ids = torch.tensor(recent, dtype=torch.long)
        embeddings = self.index.embeddings
        emb = normalized(embeddings.index_select(0, ids.to(embeddings.device)).float())
        tail = ids[self.long_tail[ids]].unique()[-8:]  # recent long-tail tokens get their own neighbours
        queries = torch.cat([emb.mean(0, keepdim=True), embeddings.index_select(0, tail.to(emb.device)).float()])
        nb, sims = self.index.query(queries, max(1, self.k // len(queries)), self.allowed)
        out: dict[int, float] = {}
        for i, s in zip(nb.flatten().tolist(), sims.flatten().tolist()):
            if s > 0:
                out[i] = max(out.get(i, 0.0), s)
        return out


@dataclass(frozen=True)
class TargetFeedback:
    misses: int  # verified positions whose target token is outside A
    positions: int  # verified positions (accepted + bonus)
    candidates: dict[int, float]  # ids ∉ A for the buffer, scored TARGET_PRIORITY + prob


def target_feedback(target_logits: torch.Tensor, committed: list[int], in_active: torch.Tensor,
                    with_candidates: bool = True, top_m: int = 4, min_prob: float = 0.02) -> TargetFeedback:
    """target_logits: [m, V] rows at the verified positions; committed: the m tokens committed there.

    Accepted tokens are in A by construction, so a miss can only be the bonus token (last row); candidates are also
    read from that row only: the `top_m` most likely ids outside A with probability >= `min_prob`, found as the ids
    whose logit reaches logsumexp + log(min_prob) (at most 1/min_prob of them): one logsumexp and one comparison over
    the vocabulary, no top-k or mask copy of [V] (the target-side cost of a step's feedback).
    with_candidates=False only counts misses."""
    if not 0 < min_prob <= 1:
        raise ValueError(f"min_prob must be in (0, 1]; got {min_prob}")
    misses = [t for t in committed if not in_active[t]]
    if not with_candidates:
        return TargetFeedback(len(misses), len(committed), {})
    row = target_logits[-1].float()  # [V] distribution after the accepted path
    lse = row.logsumexp(dim=-1)
    likely = (row >= lse + math.log(min_prob)).nonzero()[:, 0].cpu()  # [<= 1/min_prob]; A's mask may be on the CPU
    likely = likely[~in_active[likely.to(in_active.device)].cpu()]
    best = likely[row[likely.to(row.device)].argsort(descending=True).cpu()[:top_m]]
    lse = lse.item()
    cands = {i: TARGET_PRIORITY + math.exp(logit - lse)
             for i, logit in zip(best.tolist(), row[best.to(row.device)].tolist())}
    for tok in misses:
        cands[tok] = TARGET_PRIORITY + 1.0 + math.exp(row[tok].item() - lse)
    return TargetFeedback(len(misses), len(committed), cands)


def target_feedbacks(logits: Sequence[torch.Tensor], committed: Sequence[list[int]], in_active: Sequence[torch.Tensor],
                     with_candidates: Sequence[bool], top_m: int = 4, min_prob: float = 0.02) -> list[TargetFeedback]:
    """`target_feedback` of many requests' steps (the arguments of each, by request). On an accelerator: all at once,
    with one host synchronisation (`feedbacks_on_device`); on a CPU request by request, since a synchronisation
    costs nothing there and one comparison per row costs less than the batch's top-k."""
    if logits and logits[0].device.type != "cpu":
        return feedbacks_on_device(logits, committed, in_active, with_candidates, top_m, min_prob)
    return [target_feedback(rows, tokens, mask, wanted, top_m, min_prob)
            for rows, tokens, mask, wanted in zip(logits, committed, in_active, with_candidates)]


def feedbacks_on_device(logits: Sequence[torch.Tensor], committed: Sequence[list[int]],
                        in_active: Sequence[torch.Tensor], with_candidates: Sequence[bool], top_m: int = 4,
                        min_prob: float = 0.02) -> list[TargetFeedback]:
    """The batch form of `target_feedback`, the same results: every request's last row stacked, one logsumexp and
    one top-k over the batch (the ids with probability >= min_prob are among the 1/min_prob likeliest, as
    probabilities sum to 1), the committed tokens' logits and A's membership gathered on the device (a mask held on
    the host is copied there without a synchronisation), and everything read back in one transfer."""
    if not 0 < min_prob <= 1:
        raise ValueError(f"min_prob must be in (0, 1]; got {min_prob}")
    if not logits:
        return []
    from evospec.verify import to_device
    device = logits[0].device
    rows = torch.stack([step[-1] for step in logits]).float()  # [B, V]: each request's row after its accepted path
    lse = rows.logsumexp(dim=-1)  # [B]
    threshold = lse + math.log(min_prob)  # in float32, as target_feedback compares
    top = rows.topk(min(rows.shape[-1], int(1 / min_prob)), dim=-1)  # [B, k], likeliest first
    counts = [len(tokens) for tokens in committed]
    ids = to_device(torch.tensor([t for tokens in committed for t in tokens], dtype=torch.long), device)
    owner = to_device(torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], dtype=torch.long), device)
    parts, start = [lse, threshold, top.values.flatten(), top.indices.flatten(), rows[owner, ids]], 0
    for i, mask in enumerate(in_active):
        mask = to_device(mask, device)
        parts += [mask[top.indices[i]], mask[ids[start:start + counts[i]]]]
        start += counts[i]
    values = torch.cat([part.double() for part in parts]).tolist()  # the step's one synchronisation
    return _unpack_feedbacks(values, committed, top.indices.shape[-1], with_candidates, top_m)


def _unpack_feedbacks(values: list[float], committed: Sequence[list[int]], k: int, with_candidates: Sequence[bool],
                      top_m: int) -> list[TargetFeedback]:
    """`feedbacks_on_device`'s transfer, read back in the order it was packed."""
    counts = [len(tokens) for tokens in committed]
    b, n = len(counts), sum(counts)
    lse, threshold = values[:b], values[b:2 * b]
    top_values, top_ids = values[2 * b:2 * b + b * k], values[2 * b + b * k:2 * b + 2 * b * k]
    committed_logits = values[2 * b + 2 * b * k:2 * b + 2 * b * k + n]
    at, start, out = 2 * b + 2 * b * k + n, 0, []
    for i, count in enumerate(counts):
        top_in_a, committed_in_a = values[at:at + k], values[at + k:at + k + count]
        at += k + count
        logits_i = committed_logits[start:start + count]
        start += count
        misses = [j for j in range(count) if not committed_in_a[j]]  # positions of committed tokens outside A
        candidates = {}
        if with_candidates[i]:
            row = slice(i * k, (i + 1) * k)
            likely = [(int(t), v) for t, v, inside in zip(top_ids[row], top_values[row], top_in_a)
                      if v >= threshold[i] and not inside]
            candidates = {t: TARGET_PRIORITY + math.exp(v - lse[i]) for t, v in likely[:top_m]}
            for j in misses:
                candidates[committed[i][j]] = TARGET_PRIORITY + 1.0 + math.exp(logits_i[j] - lse[i])
        out.append(TargetFeedback(len(misses), count, candidates))
    return out
