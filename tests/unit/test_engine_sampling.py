"""Through the whole engine (real draft trees from a draft model, KV caches, commits, the continuous-batching
scheduler): the first two sampled tokens follow the target's exact joint distribution, for every method and tree
shape, with the depth fixed or drawn at random each step; seeded generations are deterministic.

Sample counts follow the tier (`evospec.testing.samples`: 3k in CI, 6k nightly), and at the same count a negative
control (a verifier that accepts with the target's probability alone, ignoring the draft's) must be rejected: the
tests can fail at the size they run at. Each request draws its own seeded numbers, so a batch of generations gives
what as many lone generations would; scheduler and per-request loop are shown identical seed for seed in
test_scheduler.py.
"""
import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.testing import RandomDepth, chi_square_p, exact_two_token_joint, random_pair, samples, two_token_counts

VOCAB = 8
PROMPT = [2, 5, 3]
FULL_SAMPLES = 6000
STATIC_IDS = torch.tensor([0, 2, 4, 6, 1])


CASES = [  # (name, method, tree, sampling, vocabulary sizes, depth drawn at random each step)
    ("sd-chain3-T1", "sd", TreeParams(shape="chain", num_draft_tokens=3), SamplingParams(temperature=1.0),
     {"static_size": 5}, False),
    ("sd-tree-T0.7-topp", "sd", TreeParams(shape="tree", depth=3, branching=2, budget=8),
     SamplingParams(temperature=0.7, top_p=0.9), {"static_size": 5}, False),
    ("frspec-tree-T1", "frspec", TreeParams(shape="tree", depth=2, branching=3, budget=9),
     SamplingParams(temperature=1.0), {"static_size": 5}, False),
    ("evospec-tree-T1", "evospec", TreeParams(shape="tree", depth=2, branching=2, budget=6),
     SamplingParams(temperature=1.0), {"static_size": 3, "dynamic_size": 2}, False),
    ("sd-tree-random-depth", "sd", TreeParams(shape="tree", depth=3, branching=2, budget=6),
     SamplingParams(temperature=1.0), {"static_size": 5}, True),
]
IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def pair():
    return random_pair(vocab=VOCAB, seed=7, eos=0, noise=0.5)


def counts_and_expected(pair, method, tree, sampling, vocab, random_depth):
    target, draft = pair
    dec = SpeculativeDecoder(target, draft, static_ids=STATIC_IDS)
    spec = SpecParams(method=method, tree=tree, vocab=vocab)
    sampling = sampling.model_copy(update={"max_tokens": 2, "ignore_eos": True})
    budget = RandomDepth(0) if random_depth else None
    n = samples(FULL_SAMPLES)
    counts, accepted, depths = two_token_counts(dec, PROMPT, sampling, spec, n, budget=budget)
    if random_depth:
        assert set(depths) == set(range(tree.depth + 1))  # every depth was drawn, 0 (no tree) included
    return counts, accepted, n, exact_two_token_joint(target, PROMPT, sampling)


@pytest.mark.slow
@pytest.mark.parametrize("name,method,tree,sampling,vocab,random_depth", CASES, ids=IDS)
def test_engine_joint_distribution(pair, name, method, tree, sampling, vocab, random_depth):
    counts, accepted, n, expected = counts_and_expected(pair, method, tree, sampling, vocab, random_depth)
    assert accepted > n * 0.2  # the draft is being used, not bypassed
    assert chi_square_p(counts, expected) > 1e-3


@pytest.mark.slow
def test_engine_joint_distribution_with_batch_first_verification(pair, monkeypatch):
    """The tree case with top-p through the engine verifying with verify_on_device (what an accelerator runs)."""
    from evospec import verify
    monkeypatch.setattr("evospec.engine.target.verify_batch", verify.verify_on_device)
    test_engine_joint_distribution(pair, *CASES[1])


@pytest.mark.slow
@pytest.mark.parametrize("name,method,tree,sampling,vocab,random_depth", CASES, ids=IDS)
def test_negative_control_is_rejected_at_this_count(pair, monkeypatch, name, method, tree, sampling, vocab,
                                                    random_depth):
    """A verifier that accepts a drafted token with the target's probability alone (u < p(x) instead of
    u < p(x)/q(x)) is not lossless: at the count the tests above run, the chi-square must say so."""
    monkeypatch.setattr("evospec.verify.accepts", lambda u, q_x, r_x: (q_x > 0) & (u.double() < r_x.double()))
    counts, _, _, expected = counts_and_expected(pair, method, tree, sampling, vocab, random_depth)
    assert chi_square_p(counts, expected) < 1e-3


def test_seeded_generation_is_deterministic():
    target, draft = random_pair(vocab=96, seed=1, eos=1)
    dec = SpeculativeDecoder(target, draft)
    spec = SpecParams(method="sd", tree=TreeParams(shape="tree", depth=3, branching=2, budget=8))
    run = lambda seed: list(dec.generate([4, 5, 6], SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95,
                                                                    seed=seed, ignore_eos=True), spec).steps)
    first = [c.token_ids for c in run(42)]
    assert first == [c.token_ids for c in run(42)]
    assert first != [c.token_ids for c in run(43)]
