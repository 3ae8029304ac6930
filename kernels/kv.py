"""KV-cache compaction: after verification, move the accepted tree nodes' keys/values to consecutive slots."""
from __future__ import annotations

import torch


def compact_kv(cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int) -> None:
    """In place. cache: [..., max_len, head_dim] (sequence on dim -2); src_slots: [m] increasing slot indices.

    Copies cache[..., src_slots[i], :] to cache[..., dst_start + i, :]. src_slots[i] >= dst_start + i always holds
    for a tree laid out after the committed prefix, so a gather-then-write is safe even when ranges overlap.
    """
    m = src_slots.shape[0]
    if m == 0:
        return
    moved = cache.index_select(-2, src_slots)  # [..., m, head_dim], a copy: overlap-safe
    cache[..., dst_start:dst_start + m, :] = moved
