"""Through the whole engine (real draft trees from a draft model, KV caches, commits): the first two sampled tokens
follow the target's exact joint distribution; seeded generations are deterministic."""
import numpy as np
import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.testing import chi_square_p, exact_two_token_joint, random_pair

VOCAB = 8
PROMPT = [2, 5, 3]


CASES = [
    ("sd-chain3-T1", "sd", TreeParams(shape="chain", num_draft_tokens=3), SamplingParams(temperature=1.0)),
    ("sd-tree-T0.7-topp", "sd", TreeParams(shape="tree", depth=3, branching=2, budget=8),
     SamplingParams(temperature=0.7, top_p=0.9)),
    ("frspec-tree-T1", "frspec", TreeParams(shape="tree", depth=2, branching=3, budget=9),
     SamplingParams(temperature=1.0)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,method,tree,sampling", CASES, ids=[c[0] for c in CASES])
def test_engine_joint_distribution(name, method, tree, sampling):
    target, draft = random_pair(vocab=VOCAB, seed=7, eos=0, noise=0.5)
    dec = SpeculativeDecoder(target, draft, static_ids=torch.tensor([0, 2, 4, 6, 1]))
    spec = SpecParams(method=method, tree=tree, vocab={"static_size": 5})
    n = 4000
    counts = np.zeros(VOCAB * VOCAB)
    accepted = 0
    for seed in range(n):
        params = sampling.model_copy(update={"max_tokens": 2, "ignore_eos": True, "seed": seed})
        gen = dec.generate(PROMPT, params, spec)
        list(gen)
        counts[gen.output_ids[0] * VOCAB + gen.output_ids[1]] += 1
        accepted += gen.stats.accepted
    assert accepted > n * 0.2  # the draft is being used, not bypassed
    assert chi_square_p(counts, exact_two_token_joint(target, PROMPT, sampling.model_copy(update={"max_tokens": 2}))) > 1e-3


@pytest.mark.slow
def test_engine_joint_distribution_with_batch_first_verification(monkeypatch):
    """The tree case with top-p through the engine verifying with verify_on_device (what an accelerator runs)."""
    from evospec import verify
    monkeypatch.setattr("evospec.engine.target.verify_batch", verify.verify_on_device)
    test_engine_joint_distribution(*CASES[1])


def test_seeded_generation_is_deterministic():
    target, draft = random_pair(vocab=96, seed=1, eos=1)
    dec = SpeculativeDecoder(target, draft)
    spec = SpecParams(method="sd", tree=TreeParams(shape="tree", depth=3, branching=2, budget=8))
    run = lambda seed: list(dec.generate([4, 5, 6], SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95,
                                                                    seed=seed, ignore_eos=True), spec).steps)
    first = [c.token_ids for c in run(42)]
    assert first == [c.token_ids for c in run(42)]
    assert first != [c.token_ids for c in run(43)]
