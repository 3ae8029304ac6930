"""Logits -> the distribution actually sampled from (temperature, top-k, top-p), shared by target and draft."""
from __future__ import annotations

import torch

from evospec.config import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] float -> probs [..., V] float32 (rows sum to 1). Greedy (temperature 0) gives one-hot argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """Gumbel-top-k: k distinct indices in sampling order, a without-replacement sample from probs [V] -> [k'].

    k' = min(k, number of nonzero entries). Order matters: recursive rejection sampling visits them in this order.
    """
    support = int((probs > 0).sum())
    k = min(k, support)
    u = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(u))
    scores = probs.log() + gumbel
    return scores.topk(k).indices
