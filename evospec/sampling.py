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
        logits = nucleus(logits, params.top_p)
    return logits.softmax(-1)


# How many of a row's likeliest tokens `nucleus` ranks first. A nucleus (top-p) is usually a few to a few hundred
# tokens: ranking 1024 of a 152k vocabulary is ~1 ms on 2 cores where sorting it all took ~15 ms per row (a verify
# of 4 rows paid ~45 ms for its target probabilities, about a target forward). A wider nucleus ranks 8x more.
NUCLEUS_CANDIDATES = 1024


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [..., V] with every token outside its row's nucleus set to -inf: going down the tokens by likelihood,
    a token is dropped when the probability mass strictly before it already reaches top_p (the first always stays).

    Only the likeliest NUCLEUS_CANDIDATES are ranked while that settles every row (the last of them is dropped, so
    every token after it is too); else the candidates grow, up to the whole vocabulary."""
    vocab = logits.shape[-1]
    log_total = logits.logsumexp(-1, keepdim=True)
    candidates = min(vocab, NUCLEUS_CANDIDATES)
    while True:
        top_logits, top_ids = logits.topk(candidates, dim=-1)  # descending
        top_probs = (top_logits - log_total).exp()
        drop = (top_probs.cumsum(-1) - top_probs) >= top_p
        if candidates == vocab or bool(drop[..., -1].all()):
            break
        candidates = min(vocab, 8 * candidates)
    kept = top_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, top_ids, kept)


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
