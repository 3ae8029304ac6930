"""Per-request speculative-decoding statistics (vLLM's counter names and meanings where they exist).

The definition of record is the public proto message `evospec.v1.SpecStats` (proto/evospec/v1/generate.proto, where
each field is documented); this accumulator has exactly its fields except the three the service adds (ttft_seconds,
e2e_seconds, method), and tests/unit/test_stats.py fails when the two drift. Conversions are by field name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    fallback_steps: int = 0  # steps without a tree: the draft had failed or was catching up (lossless fallback)
    fallback_reason: str = ""  # why the draft was last dropped, "" = it never was
    draft_resumes: int = 0  # times speculation resumed on a (re)connected draft after a fallback
    buffer_hits_statistical: int = 0  # committed tokens found in the dynamic buffer, by the source that put them there
    buffer_hits_semantic: int = 0
    buffer_hits_target: int = 0
    teacher_signal_bytes: int = 0  # online adaptation: the target's top-k payload sent to the draft
    predrafted_steps: int = 0  # trees the decoupled draft had ready before their step's context was known
    drafted_levels: int = 0  # tree levels drafted, summed over steps (mean depth = drafted_levels / steps)

    def record_step(self, drafted: int, accepted: int, levels: int = 0) -> None:
        self.steps += 1
        self.drafted += drafted
        self.drafted_levels += levels
        self.accepted += accepted
        while len(self.accepted_per_pos) < accepted:
            self.accepted_per_pos.append(0)
        for d in range(accepted):
            self.accepted_per_pos[d] += 1

    def count_buffer_hit(self, source: str) -> None:
        """One committed token that was in the dynamic buffer; source: statistical / semantic / target."""
        name = f"buffer_hits_{source}"
        setattr(self, name, getattr(self, name) + 1)

    @property
    def buffer_hits(self) -> int:
        return self.buffer_hits_statistical + self.buffer_hits_semantic + self.buffer_hits_target

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
        """Every statistic, measured and derived, by its proto field name."""
        return {**asdict(self), "tau": self.tau, "alpha": self.alpha, "miss_rate": self.miss_rate}
