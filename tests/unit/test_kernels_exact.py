"""Hand-built exact cases: tree masks, positions, pruned head, KV compaction, greedy acceptance."""
import pytest
import torch

from evospec.kernels import (
    chain_then_tree_mask,
    chain_then_tree_positions,
    compact_kv,
    gather_head_rows,
    pruned_logits,
    scatter_to_full_vocab,
    tree_ancestor_mask,
    tree_depths,
)
from evospec.tree import DraftTree
from evospec.verify import verify_greedy

#      root
#     /    \
#    0      1
#   / \     |
#  2   3    4
#  |
#  5
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])


def test_depths_and_ancestor_mask():
    assert tree_depths(PARENTS).tolist() == [1, 1, 2, 2, 2, 3]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree_ancestor_mask(PARENTS), expected)


def test_parents_must_precede_children():
    with pytest.raises(ValueError, match="precede"):
        tree_depths(torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="precede"):
        tree_depths(torch.tensor([-1, -2]))  # below the root: would index another tree's rows in a batch


def test_chain_then_tree_mask_and_positions():
    mask = chain_then_tree_mask(prefix_len=2, num_chain=2, parents=torch.tensor([-1, 0, -1]))
    expected = torch.tensor([
        # p0 p1 c0 c1 t0 t1 t2
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert chain_then_tree_positions(2, 2, torch.tensor([-1, 0, -1])).tolist() == [2, 3, 4, 5, 4]
    assert chain_then_tree_positions(5, 3, None).tolist() == [5, 6, 7]


def test_pruned_head_maps_back_to_full_ids():
    weight = torch.arange(12, dtype=torch.float32).view(6, 2)  # row r = [2r, 2r+1]
    ids = torch.tensor([4, 1, -1])
    rows = gather_head_rows(weight, ids.clamp_min(0))
    logits = pruned_logits(torch.tensor([[1.0, 0.0]]), rows, slot_valid=ids >= 0)
    assert logits.tolist() == [[8.0, 2.0, float("-inf")]]
    full = scatter_to_full_vocab(logits, ids, 6, fill=-1.0)
    assert full.tolist() == [[-1.0, 2.0, -1.0, -1.0, 8.0, -1.0]]


def test_kv_compaction_moves_selected_slots():
    cache = torch.arange(10, dtype=torch.float32).view(1, 10, 1).repeat(2, 1, 3)  # [heads=2, slots=10, dim=3]
    compact_kv(cache, torch.tensor([4, 6, 7]), dst_start=3)
    assert cache[0, :6, 0].tolist() == [0, 1, 2, 4, 6, 7]
    assert torch.equal(cache[0], cache[1])


def one_hot_rows(argmaxes, vocab=10):
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()


def test_greedy_acceptance_follows_matching_branch():
    tree = DraftTree(torch.tensor([3, 5, 7, 8, 9, 2]), PARENTS)
    # root wants 5 (node 1); node 1 wants 9 (node 4); node 4 wants 6 -> bonus 6
    logits = one_hot_rows([5, 0, 9, 0, 0, 6, 0])
    r = verify_greedy(tree, logits)
    assert (r.accepted_nodes, r.accepted_tokens, r.bonus_token) == ([1, 4], [5, 9], 6)
    # root wants 3 -> node 0 wants 8 -> node 3 (leaf) row says 4: bonus 4
    r = verify_greedy(tree, one_hot_rows([3, 8, 0, 0, 4, 0, 0]))
    assert (r.accepted_tokens, r.bonus_token) == ([3, 8], 4)
    # nothing matches: tau contribution 1
    r = verify_greedy(tree, one_hot_rows([1, 0, 0, 0, 0, 0, 0]))
    assert (r.accepted_nodes, r.bonus_token) == ([], 1)
    assert verify_greedy(DraftTree.empty(), one_hot_rows([4])).committed_tokens == [4]
