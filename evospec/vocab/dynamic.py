"""EvoSpec's dynamic buffer D: Dyna long-tail token ids (disjoint from S) chosen per generation.

Scoring, merge and eviction (our choices; the paper gives none):
- every resident id carries a score that decays by `decay` per step and is refreshed (max) when retrieval proposes
  it again; a new candidate takes a free slot, else evicts the lowest-scoring resident *that has stayed at least
  `min_residency` steps* if the candidate scores higher. The residency floor stops D from thrashing when several
  sources disagree from step to step.
- merges are batched: one call per step, between verification and the next draft (never inside a step).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotChange:
    slot: int
    token_id: int  # -1 = slot emptied
    evicted: int  # previous id, -1 if the slot was free


class DynamicBuffer:
    def __init__(self, capacity: int, min_residency: int = 4, decay: float = 0.9):
        self.capacity = capacity
        self.min_residency = min_residency
        self.decay = decay
        self.ids = [-1] * capacity
        self.scores = [0.0] * capacity
        self.inserted_at = [0] * capacity
        self.slot_of: dict[int, int] = {}
        self.evictions = 0

    def __contains__(self, token_id: int) -> bool:
        return token_id in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def merge(self, candidates: dict[int, float], step: int) -> list[SlotChange]:
        """Decay residents, refresh those proposed again, insert/evict for new ones (best first). -> slot changes."""
        self.scores = [s * self.decay for s in self.scores]
        fresh = []
        for tok, score in candidates.items():
            slot = self.slot_of.get(tok)
            if slot is None:
                fresh.append((score, tok))
            else:
                self.scores[slot] = max(self.scores[slot], score)
        changes: list[SlotChange] = []
        for score, tok in sorted(fresh, reverse=True):
            slot = self._slot_for(score, step)
            if slot is None:
                break  # candidates are sorted: no later one can win a slot either
            old = self.ids[slot]
            if old >= 0:
                del self.slot_of[old]
                self.evictions += 1
            self.ids[slot], self.scores[slot], self.inserted_at[slot] = tok, score, step
            self.slot_of[tok] = slot
            changes.append(SlotChange(slot, tok, old))
        return changes

    def _slot_for(self, score: float, step: int) -> int | None:
        free = next((i for i, t in enumerate(self.ids) if t < 0), None)
        if free is not None:
            return free
        evictable = [i for i in range(self.capacity) if step - self.inserted_at[i] >= self.min_residency]
        if not evictable:
            return None
        weakest = min(evictable, key=lambda i: self.scores[i])
        return weakest if self.scores[weakest] < score else None
