"""Tree attention mask and tree position ids from parent indices.

A tree of n nodes is given by `parents` [n] (int64): parents[i] is the index of node i's parent inside the tree,
or -1 when node i hangs off the root (the last committed token). Parents always precede children (parents[i] < i).
"""
from __future__ import annotations

import torch


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node, 1 for children of the root. parents: [n] -> depths: [n] int64."""
    depth_list: list[int] = []
    for i, p in enumerate(parents.tolist()):
        if not -1 <= p < i:
            raise ValueError(f"tree parents must precede children (-1: the root): node {i} has parent {p}")
        depth_list.append(1 if p < 0 else depth_list[p] + 1)
    return torch.tensor(depth_list, dtype=torch.long, device=parents.device)


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[i, j] is True when node j is node i or one of its ancestors. parents: [n] -> mask: [n, n] bool.

    Built row by row from the parent's row (parents precede children), so it costs O(n^2) bool ops, no Python n^2 loop.
    """
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def chain_then_tree_mask(prefix_len: int, num_chain: int, parents: torch.Tensor | None) -> torch.Tensor:
    """Attention mask for one forward over `num_chain` consecutive tokens followed by an optional tree.

    The forward's queries sit after `prefix_len` cached slots. Chain tokens are causal; tree nodes (parents as above,
    -1 = child of the last chain token) see the whole prefix, the whole chain and their own ancestors.
    Returns [num_chain + n_tree, prefix_len + num_chain + n_tree] bool, True = may attend.
    """
    device = parents.device if parents is not None else None
    n_tree = 0 if parents is None else parents.shape[0]
    n = num_chain + n_tree
    mask = torch.zeros(n, prefix_len + n, dtype=torch.bool, device=device)
    mask[:, :prefix_len] = True
    mask[:num_chain, prefix_len:prefix_len + num_chain] = torch.ones(
        num_chain, num_chain, dtype=torch.bool, device=device).tril()
    if n_tree:
        mask[num_chain:, prefix_len:prefix_len + num_chain] = True
        mask[num_chain:, prefix_len + num_chain:] = tree_ancestor_mask(parents)
    return mask


def chain_then_tree_positions(prefix_len: int, num_chain: int, parents: torch.Tensor | None) -> torch.Tensor:
    """Position ids matching `chain_then_tree_mask`: chain tokens consecutive, a tree node at last chain pos + depth."""
    chain = torch.arange(prefix_len, prefix_len + num_chain)
    if parents is None or parents.shape[0] == 0:
        return chain
    return torch.cat([chain, prefix_len + num_chain - 1 + tree_depths(parents).cpu()])
