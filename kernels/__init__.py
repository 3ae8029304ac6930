"""Tensor kernels of speculative decoding: a pure-torch reference for each, importable without Triton.

- `tree`: attention mask and position ids of a draft token tree, from parent indices.
- `linear`: x @ Wᵀ in the operand order this machine runs faster (measured per weight kind, not assumed).
- `pruned_head`: LM head restricted to a subset of vocabulary rows, logits mapped back to full ids.
- `kv`: KV-cache compaction (commit an accepted tree path without recomputation).
"""
from evospec.kernels.kv import compact_kv
from evospec.kernels.pruned_head import gather_head_rows, pruned_logits, scatter_to_full_vocab
from evospec.kernels.tree import chain_then_tree_mask, chain_then_tree_positions, tree_ancestor_mask, tree_depths

__all__ = ["chain_then_tree_mask", "chain_then_tree_positions", "tree_ancestor_mask", "tree_depths", "gather_head_rows", "pruned_logits",
           "scatter_to_full_vocab", "compact_kv"]
