"""Per-request speculative-decoding statistics (vLLM's counter names and meanings where they exist)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """steps = num_drafts (one per verify round); drafted = num_draft_tokens (tree nodes sent); accepted =
    num_accepted_tokens; accepted_per_pos[d] = accepted tokens at tree depth d+1.
    τ = 1 + accepted / steps (tokens committed per step, bonus included); α = accepted / drafted."""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    prompt_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_head_seconds: float = 0.0  # part of draft_seconds spent in the draft LM head
    misses: int = 0  # verified target tokens outside the draft's active vocabulary (frspec/evospec)
    verified_positions: int = 0
    buffer_updates: int = 0  # ids added to the dynamic buffer (evospec)
    buffer_update_seconds: float = 0.0

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.accepted_per_pos) < accepted:
            self.accepted_per_pos.append(0)
        for d in range(accepted):
            self.accepted_per_pos[d] += 1

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def miss_rate(self) -> float:
        return self.misses / self.verified_positions if self.verified_positions else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "accepted_per_pos": list(self.accepted_per_pos), "tau": round(self.tau, 4),
                "alpha": round(self.alpha, 4), "generated_tokens": self.generated_tokens,
                "prompt_tokens": self.prompt_tokens, "draft_seconds": round(self.draft_seconds, 6),
                "verify_seconds": round(self.verify_seconds, 6),
                "draft_head_seconds": round(self.draft_head_seconds, 6), "misses": self.misses,
                "miss_rate": round(self.miss_rate, 4), "buffer_updates": self.buffer_updates,
                "buffer_update_seconds": round(self.buffer_update_seconds, 6)}
