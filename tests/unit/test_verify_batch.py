"""Batch-first verification (evospec/verify.py `verify_on_device`, run here on the CPU) against the per-tree
reference (`verify_greedy`, `verify_stochastic`): identical tokens under greedy, identical seeded samples under
sampling, for any mix of trees, chains, empty trees, repeated sibling tokens, FR-Spec-sized active sets with unused
dynamic slots; and at most one host synchronisation per step, counted by instrumenting every call that makes one on
a GPU."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evospec.config import SamplingParams
from evospec.sampling import logits_to_probs
from evospec.testing import VERIFY_VOCAB, HostSyncCounter, random_batch
from evospec.tree import DraftTree
from evospec.verify import verify_batch, verify_greedy, verify_on_device, verify_stochastic

VOCAB = VERIFY_VOCAB


def reference(tree, sampling, rows, seed):
    if sampling.greedy:
        return verify_greedy(tree, rows)
    return verify_stochastic(tree, logits_to_probs(rows, sampling), torch.Generator().manual_seed(seed))


@given(seed=st.integers(0, 2**31 - 1), requests=st.integers(1, 8), max_size=st.integers(0, 9))
def test_batch_is_identical_to_the_per_tree_reference(seed, requests, max_size):
    trees, samplings, rows = random_batch(seed, requests, max_size)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(requests)]
    got = verify_on_device(trees, torch.cat(rows), samplings, gens)
    assert verify_batch(trees, torch.cat(rows), samplings,  # what the engine calls (here: tree by tree)
                        [torch.Generator().manual_seed(seed + i) for i in range(requests)]) == got
    for i, (tree, sampling, r) in enumerate(zip(trees, samplings, rows)):
        assert got[i] == reference(tree, sampling, r, seed + i), (i, sampling)


def test_the_batch_accepts_drafts_and_consumes_the_generator_as_the_reference_does():
    """Over many steps, seeded: identical results, some long acceptances (the test exercises the levels), and each
    generator left in the reference's state (the next step draws the same numbers)."""
    accepted = 0
    for seed in range(40):
        trees, samplings, rows = random_batch(seed, 6, 8)
        batch_gens = [torch.Generator().manual_seed(seed + i) for i in range(6)]
        got = verify_on_device(trees, torch.cat(rows), samplings, batch_gens)
        for i, (tree, sampling, r) in enumerate(zip(trees, samplings, rows)):
            ref_gen = torch.Generator().manual_seed(seed + i)
            want = verify_greedy(tree, r) if sampling.greedy else \
                verify_stochastic(tree, logits_to_probs(r, sampling), ref_gen)
            assert got[i] == want
            assert torch.equal(batch_gens[i].get_state(), ref_gen.get_state())
            accepted += len(want.accepted_nodes)
    assert accepted > 100


@pytest.mark.parametrize("mix", ["greedy", "sampled", "mixed"])
def test_one_host_synchronisation_per_step(mix):
    trees, samplings, rows = random_batch(7, 8, 8)
    if mix != "mixed":
        keep = [i for i, s in enumerate(samplings) if s.greedy == (mix == "greedy")]
        trees, samplings, rows = [trees[i] for i in keep], [samplings[i] for i in keep], [rows[i] for i in keep]
    assert trees
    counter = HostSyncCounter([t for tree in trees for t in (tree.token_ids, tree.parents)])
    with counter:
        verify_on_device(trees, torch.cat(rows), samplings,
                         [torch.Generator().manual_seed(i) for i in range(len(trees))])
    assert counter.calls == ["tolist"]


def test_the_counter_sees_a_per_node_item():
    """The counter can fail: the per-tree reference synchronises once per tested node."""
    trees, samplings, rows = random_batch(3, 8, 8)
    i = next(i for i, (t, s) in enumerate(zip(trees, samplings)) if not s.greedy and t.size > 2)
    counter = HostSyncCounter([trees[i].token_ids, trees[i].parents])
    with counter:
        verify_stochastic(trees[i], logits_to_probs(rows[i], samplings[i]), torch.Generator().manual_seed(0))
    assert len(counter.calls) > 2


def edge_tree(tokens, parents, q_root, q_nodes=None):
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    tree.active_ids = torch.arange(VOCAB)
    tree.draft_probs = {-1: q_root, **(q_nodes or {})}
    return tree


def one_hot_mass(tokens, vocab=VOCAB):
    q = torch.zeros(vocab)
    q[tokens] = 1.0 / len(tokens)
    return q


@pytest.mark.parametrize("case", ["draft_mass_exhausted", "repeated_sampled_sibling", "draft_equals_target"])
def test_edge_cases_of_rejection_sampling_match_the_reference(case):
    """Paths random batches rarely reach: the draft's mass used up by rejected children (the reference stops trying
    and draws the bonus), a sampled sibling repeated (its q is then 0), and a target equal to the draft."""
    target = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    if case == "draft_mass_exhausted":  # q only on the two children, the target mostly elsewhere
        tree = edge_tree([3, 4, 5], [-1, -1, -1], one_hot_mass([3, 4]))  # 5: tried after q is used up
    elif case == "repeated_sampled_sibling":
        tree = edge_tree([3, 3, 4], [-1, -1, -1], one_hot_mass([3, 4]))
    else:
        q = torch.softmax(target[0], -1)
        tree = edge_tree([int(q.argmax()), 7], [-1, 0], q, {0: one_hot_mass([7])})
    rows = torch.cat([target, torch.randn(tree.size, VOCAB, generator=torch.Generator().manual_seed(6))])
    sampling = SamplingParams(temperature=1.0)
    outcomes = set()
    for seed in range(300):
        got = verify_on_device([tree], rows, [sampling], [torch.Generator().manual_seed(seed)])[0]
        assert got == verify_stochastic(tree, logits_to_probs(rows, sampling), torch.Generator().manual_seed(seed))
        outcomes.add(len(got.accepted_nodes))
    if case == "draft_equals_target":
        assert 0 not in outcomes  # the root's child is always accepted (r == q)
    else:
        assert 0 in outcomes  # every child rejected happened (the exhausted / repeated paths ran)


def test_a_remote_tree_that_would_reach_other_rows_is_refused():
    """Batched verification indexes every tree's rows in one layout: the target refuses, per session, a tree from
    the draft process whose parents or draft distributions point outside it."""
    from evospec.config import TreeParams
    from evospec.services.target.remote_draft import checked_tree
    params = TreeParams(shape="tree", depth=4, branching=2, budget=8)
    with pytest.raises(ValueError, match="precede"):
        checked_tree(DraftTree(torch.tensor([3, 4]), torch.tensor([-1, -2])), params)
    with pytest.raises(ValueError, match="nodes \\[5\\]"):
        checked_tree(edge_tree([3, 4], [-1, 0], one_hot_mass([3]), {5: one_hot_mass([4])}), params)
    with pytest.raises(ValueError, match="active ids"):
        checked_tree(edge_tree([3, 4], [-1, 0], one_hot_mass([3]), {0: torch.ones(7) / 7}), params)
    tree = edge_tree([3, 4], [-1, 0], one_hot_mass([3]), {0: one_hot_mass([4])})
    assert checked_tree(tree, params) is tree


def test_rows_must_match_the_trees():
    trees, samplings, rows = random_batch(1, 3, 4)
    for verify in (verify_batch, verify_on_device):
        with pytest.raises(ValueError, match="logit rows"):
            verify(trees, torch.cat(rows)[1:], samplings, [None] * 3)
        assert verify([], torch.zeros(0, VOCAB), [], []) == []
