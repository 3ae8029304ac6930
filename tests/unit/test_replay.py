"""Acceptance replayed from measured rates (bench/replay.py): the draws follow the rates, the path is the tree's
first-child path, and the engine commits what is replayed (so gpu_check's τ on random weights is the real pair's)."""
import pytest
import torch

from evospec.bench.replay import ReplayedAcceptance, first_child_path, measured_acceptance, replayed
from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine import target as engine_target
from evospec.engine.generate import SpeculativeDecoder
from evospec.testing import random_pair
from evospec.tree import DraftTree
from evospec.verify import VerifyResult, verify_batch


def test_draws_accept_at_least_d_tokens_at_the_measured_rate():
    rates = [0.8, 0.5, 0.2, 0.05]
    replay = ReplayedAcceptance(rates, seed=3)
    draws = [replay.accepted_count(4) for _ in range(20000)]
    for d, rate in enumerate(rates, start=1):
        assert abs(sum(k >= d for k in draws) / len(draws) - rate) < 0.015, d  # > 4 standard errors
    assert max(replay.accepted_count(2) for _ in range(200)) == 2  # never past the tree's depth


@pytest.mark.parametrize("rates", [[0.5, 0.6], [1.2], [-0.1]])
def test_rates_that_are_not_a_tail_distribution_are_refused(rates):
    with pytest.raises(ValueError, match="non-increasing"):
        ReplayedAcceptance(rates)


def test_the_replayed_path_follows_first_children():
    #       root -> 0 (a) -> 2 (c) -> 4 (e)
    #            -> 1 (b) -> 3 (d)
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 1, 2]))
    assert first_child_path(tree, 2) == [0, 2]
    assert first_child_path(tree, 9) == [0, 2, 4]
    assert first_child_path(tree, 0) == [] and first_child_path(DraftTree.empty(), 3) == []
    always = ReplayedAcceptance([1.0, 1.0])
    assert always.expected_tau(4) == 3.0 and ReplayedAcceptance([0.5, 0.25]).expected_tau(1) == 1.5
    assert always.replayed(tree, VerifyResult([1], [11], 7)) == VerifyResult([0, 2], [10, 12], 7)


@pytest.mark.parametrize("rates,tau", [([1.0] * 4, 5.0), ([], 1.0), ([1.0, 1.0], 3.0)])
def test_the_engine_commits_the_replayed_outcome(rates, tau):
    target, draft = random_pair(vocab=96, seed=4, eos=1)
    decoder = SpeculativeDecoder(target, draft)
    spec = SpecParams(method="sd", tree=TreeParams(shape="chain", num_draft_tokens=4))
    sampling = SamplingParams(max_tokens=41, ignore_eos=True)
    with replayed(ReplayedAcceptance(rates)):
        gen = decoder.generate(list(range(2, 12)), sampling, spec)
        list(gen)
    assert len(gen.output_ids) == 41 and gen.stats.tau == tau
    assert engine_target.verify_batch is verify_batch  # outside the block: verification as always


def test_the_committed_rates_cover_every_arm_gpu_check_replays():
    from evospec.bench.projection import ARMS
    acceptance = measured_acceptance()
    for (method, _), arm in ARMS.items():
        if method != "ar":
            rates = acceptance[arm]
            assert 0 < rates[0] <= 1 and len(rates) <= 4, arm
