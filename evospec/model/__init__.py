"""Compact Qwen3 runner with a position-indexed KV cache (prefill, tree decode, path commit, packed batches)."""
from evospec.model.kv_arena import KVArena
from evospec.model.qwen3 import KVCache, Qwen3, Qwen3Config, Segment, load_qwen3, quantize_int8

__all__ = ["KVArena", "KVCache", "Qwen3", "Qwen3Config", "Segment", "load_qwen3", "quantize_int8"]
