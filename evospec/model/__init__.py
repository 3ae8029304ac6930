"""Compact Qwen3 runner with a position-indexed KV cache (prefill, tree decode, path commit)."""
from evospec.model.qwen3 import KVCache, Qwen3, Qwen3Config, load_qwen3, quantize_int8

__all__ = ["KVCache", "Qwen3", "Qwen3Config", "load_qwen3", "quantize_int8"]
