"""The distillation signal the target sends the draft for every verified step.

The draft already knows the accepted prefix and the token the target chose at the first rejected position (the
bonus): both are in the step's outcome. What it cannot compute is the target's distribution, so the signal adds
only the target's top-k log-probabilities at every verified position (root + accepted path), i.e. at each
committed token's position: k ids and k log-probabilities per position, the ids as int32 and the values as float16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TeacherSignal:
    token_ids: torch.Tensor  # [n, k] int32: the target's k most likely ids at each verified position (CPU)
    logprobs: torch.Tensor  # [n, k] float16: their log-probabilities (temperature 1) (CPU)

    @property
    def positions(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Payload bytes (what the internal frame carries beyond ids' varint overhead)."""
        return self.token_ids.numel() * 4 + self.logprobs.numel() * 2

    def __post_init__(self):
        if self.token_ids.shape != self.logprobs.shape or self.token_ids.dim() != 2:
            raise ValueError(f"teacher ids {tuple(self.token_ids.shape)} and log-probabilities "
                             f"{tuple(self.logprobs.shape)} must both be [positions, k]")


@torch.inference_mode()
def teacher_signal(target_logits: torch.Tensor, k: int) -> TeacherSignal:
    """target_logits: [n, V] rows at the verified positions -> their top-k log-probabilities."""
    logprobs = torch.log_softmax(target_logits.float(), dim=-1)  # [n, V]
    top = logprobs.topk(k, dim=-1)
    return TeacherSignal(top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu())
