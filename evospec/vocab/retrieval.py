"""Where dynamic-buffer candidates come from. Each source returns {token id: score} over long-tail ids (∉ S).

- statistical: long-tail ids of the prompt and the committed output, counts with per-step recency decay, plus an
  optional offline co-occurrence index ("token a seen -> long-tail b likely") built from a domain corpus.
- semantic: nearest long-tail neighbours, in the draft's (tied) embedding space, of the recent context (mean of
  normalized embeddings of the last `window` tokens) and of each recent long-tail token. Exact top-k over normalized
  rows behind the `NeighbourIndex` interface (swap in FAISS for big pools).
- target-fed: the target sees full-vocabulary logits at every verified position; its token there when ∉ A (a miss)
  and any token ∉ A with probability >= `min_prob` become candidates with top priority.
Score scales: statistical ~ decayed counts (0..~10), semantic = cosine (0..1), target-fed = TARGET_PRIORITY + prob.
"""
from __future__ import annotations

import heapq
import math
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
    def query(self, vectors: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class ExactEmbeddingIndex:
    """Exact cosine top-k over a fixed pool of embedding rows, kept on the embeddings' device and dtype (on a GPU the
    Qwen3-1.7B pool is ~120k x 2048: one bf16 matmul per query). vectors: [q, hidden] -> (ids [q, k], sims [q, k])."""

    def __init__(self, embeddings: torch.Tensor, pool_ids: torch.Tensor):
        pool_ids = pool_ids.to(embeddings.device)
        rows = embeddings.index_select(0, pool_ids).float()
        self.pool_rows = (rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(embeddings.dtype)  # [P, hidden]
        self.pool_ids = pool_ids

    def query(self, vectors: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        vectors = vectors.float()
        vectors = (vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(self.pool_rows.dtype)
        sims = (vectors.to(self.pool_rows.device) @ self.pool_rows.T).float()  # [q, P]
        top = sims.topk(min(k, sims.shape[-1]), dim=-1)
        return self.pool_ids[top.indices], top.values


class SemanticRetriever:
    def __init__(self, embeddings: torch.Tensor, index: NeighbourIndex, long_tail: torch.Tensor, window: int = 32,
                 k: int = 32):
        self.embeddings, self.index, self.long_tail = embeddings, index, long_tail
        self.window, self.k = window, k

    def candidates(self, tokens: list[int]) -> dict[int, float]:
        recent = tokens[-self.window:]
        if not recent:
            return {}
        ids = torch.tensor(recent, dtype=torch.long)
        device = self.embeddings.device
        emb = self.embeddings.index_select(0, ids.to(device)).float()
        emb = emb / emb.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        tail = ids[self.long_tail[ids]].unique()[-8:]  # recent long-tail tokens get their own neighbours
        queries = [emb.mean(0, keepdim=True)]
        if tail.numel():
            queries.append(self.embeddings.index_select(0, tail.to(device)).float())
        nb, sims = self.index.query(torch.cat(queries), max(1, self.k // len(torch.cat(queries))))
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
    read from that row only: one logsumexp + top-k over the vocabulary per step instead of m softmaxes (the cost
    that dominated EvoSpec's per-step update time on CPU). with_candidates=False only counts misses."""
    misses = [t for t in committed if not in_active[t]]
    if not with_candidates:
        return TargetFeedback(len(misses), len(committed), {})
    row = target_logits[-1].float()  # [V] distribution after the accepted path
    lse = torch.logsumexp(row, dim=-1)
    top = row.masked_fill(in_active, float("-inf")).topk(top_m)
    cands: dict[int, float] = {}
    for i, logit in zip(top.indices.tolist(), top.values.tolist()):
        p = math.exp(logit - lse.item())
        if p >= min_prob:
            cands[i] = TARGET_PRIORITY + p
    for tok in misses:
        cands[tok] = TARGET_PRIORITY + 1.0 + math.exp(row[tok].item() - lse.item())
    return TargetFeedback(len(misses), len(committed), cands)
