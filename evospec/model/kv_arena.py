"""KV memory of a replica as one preallocated arena shared by its sequences (continuous batching).

The arena holds keys/values [layers, kv_heads, capacity, head_dim], allocated once from a size in tokens. Admitting a
sequence reserves one contiguous region of exactly what it may need (prompt + max_tokens + one tree of scratch),
first fit; its `KVCache` is a view of that region, so the model's forward, tree scratch slots and commit (rejected
branches are simply never committed; an accepted chain is already in place) work unchanged and nothing is allocated
per token. Releasing returns the region and merges it with free neighbours.

Why contiguous regions rather than paged blocks: attention here is torch SDPA over each sequence's own K/V, which
wants one strided tensor per sequence; a region per sequence gives that without a gather per step, at the price of
fragmentation (a request waits while no single free region is large enough, even if the free total would be).
"""
from __future__ import annotations

import threading

import torch

from evospec.model.qwen3 import KVCache, Qwen3


class KVArena:
    def __init__(self, model: Qwen3, capacity_tokens: int):
        if capacity_tokens < 1:
            raise ValueError(f"KV arena capacity must be at least 1 token, got {capacity_tokens}")
        cfg, weight = model.cfg, model.embed_tokens.weight
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, capacity_tokens, cfg.head_dim)
        self.keys = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
        self.values = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
        self.capacity = capacity_tokens
        self._free: list[tuple[int, int]] = [(0, capacity_tokens)]  # (start, length), sorted by start, no neighbours
        self._reserved: dict[int, int] = {}  # start -> length
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def free_tokens(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)

    def reserve(self, tokens: int) -> KVCache | None:
        """A cache over a fresh region of `tokens` slots, or None when no free region is that large."""
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= tokens:
                    if length == tokens:
                        del self._free[i]
                    else:
                        self._free[i] = (start + tokens, length - tokens)
                    self._reserved[start] = tokens
                    cache = KVCache(self.keys[:, :, start:start + tokens], self.values[:, :, start:start + tokens])
                    cache.arena_start = start
                    return cache
            return None

    def release(self, cache: KVCache) -> None:
        """Return a reserved cache's region (idempotent)."""
        with self._lock:
            start = cache.arena_start
            if start is None or start not in self._reserved:
                return
            length = self._reserved.pop(start)
            cache.arena_start = None
            self._free.append((start, length))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for s, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            self._free = merged
