"""EvoSpec's dynamic buffer D: Dyna long-tail token ids (disjoint from S) chosen per generation.

Scoring, merge and eviction (our choices; the paper gives none):
- every resident id carries a score that decays by `decay` per step and is refreshed (max) when retrieval proposes
  it again; a new candidate takes a free slot, else evicts the lowest-scoring resident *that has stayed at least
  `min_residency` steps* if the candidate scores higher. The residency floor stops D from thrashing when several
  sources disagree from step to step.
- merges are batched: one call per step, between verification and the next draft (never inside a step).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotChange:
    slot: int
    token_id: int  # -1 = slot emptied
    evicted: int  # previous id, -1 if the slot was free
    source: str = ""  # the retrieval source that proposed token_id (statistical / semantic / target)


class DynamicBuffer:
    def __init__(self, capacity: int, min_residency: int = 4, decay: float = 0.9):
        self.capacity = capacity
        self.min_residency = min_residency
        self.decay = decay
        self.ids = np.full(capacity, -1, dtype=np.int64)
        self.scores = np.zeros(capacity)
        self.inserted_at = np.zeros(capacity, dtype=np.int64)
        self.slot_of: dict[int, int] = {}
        self.evictions = 0

    def __contains__(self, token_id: int) -> bool:
        return token_id in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def merge(self, candidates: dict[int, float], step: int) -> list[SlotChange]:
        """Decay residents, refresh those proposed again, insert/evict for new ones (best first). -> slot changes.

        Cost: O(capacity) vectorized plus O(new candidates x log capacity); the only Python loop is over candidates
        (free slots in index order, then a heap of evictable slots by (score, slot): the weakest, lowest slot first)."""
        self.scores *= self.decay
        fresh = []
        for tok, score in candidates.items():
            slot = self.slot_of.get(tok)
            if slot is None:
                fresh.append((score, tok))
            elif score > self.scores[slot]:
                self.scores[slot] = score
        if not fresh:
            return []
        free = np.flatnonzero(self.ids < 0).tolist()
        evictable: list[tuple[float, int]] | None = None  # built only when free slots run out
        changes: list[SlotChange] = []
        for score, tok in sorted(fresh, reverse=True):
            if free:
                slot = free.pop(0)
            else:
                if evictable is None:
                    old_enough = np.flatnonzero(step - self.inserted_at >= self.min_residency)
                    evictable = list(zip(self.scores[old_enough].tolist(), old_enough.tolist()))
                    heapq.heapify(evictable)
                if not evictable or evictable[0][0] >= score:
                    break  # candidates are sorted: no later one can win a slot either
                slot = heapq.heappop(evictable)[1]
            old = int(self.ids[slot])
            if old >= 0:
                del self.slot_of[old]
                self.evictions += 1
            self.ids[slot], self.scores[slot], self.inserted_at[slot] = tok, score, step
            self.slot_of[tok] = slot
            if evictable is not None and self.min_residency <= 0:
                heapq.heappush(evictable, (score, slot))  # evictable at once, as any slot old enough
            changes.append(SlotChange(slot, tok, old))
        return changes
