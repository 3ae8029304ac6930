"""Prompt lookup (`lookup`, evospec/engine/lookup.py): what the n-gram index proposes, that its chains are verified
losslessly (greedy token for token `ar`'s, in the per-request loop and the batching scheduler; sampled: the target's
distribution, with a negative control), and that the adaptive scheduler drafts them, priced at their rows alone."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evospec.config import SamplingParams, SchedulerConfig, SpecParams, TreeParams
from evospec.engine.budget import (
    LOOKUP_SECONDS_PER_SESSION,
    Acceptance,
    OnlineCost,
    SpeculationBudget,
    StepOutcome,
    TokenCostTable,
    draft_features,
    draft_kind,
)
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.lookup import NgramIndex, chain_tree
from evospec.engine.scheduler import Scheduler
from evospec.sampling import logits_to_probs
from evospec.testing import chi_square_p, random_pair, run_all, samples
from evospec.verify import sample_by_inverse_cdf, verify_on_device, verify_stochastic

VOCAB = 96


@pytest.fixture(scope="module")
def decoder():
    target, draft = random_pair(vocab=VOCAB, seed=3, eos=1)
    return SpeculativeDecoder(target, draft, static_ids=torch.arange(VOCAB))


# ---- the index ---------------------------------------------------------------------------------------------------

def test_the_occurrence_whose_match_runs_back_furthest_proposes_what_followed_it():
    #        0  1  2  3  4  5  6  7  8  9  10 11 12 13
    tokens = [1, 2, 3, 4, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4]
    index = NgramIndex(tokens, min_n=2, chain_by_match=())
    assert index.match() == (4, 4)  # "3 4" at 2 and 6: the one at 2 matches "1 2 3 4" back from the end
    assert index.propose(3) == [9, 2, 3]
    assert NgramIndex(tokens, min_n=2, candidates=1, chain_by_match=()).propose(3) == [7, 8, 1]  # the latest alone
    assert NgramIndex(tokens, min_n=2, max_match=2, chain_by_match=()).propose(3) == [7, 8, 1]  # a tie: the latest
    index.extend([5])
    assert index.match() is None and index.propose(3) == []  # "4 5" never occurred before
    index.extend([1, 2])
    assert index.propose(2) == [3, 4]  # "1 2" at 0 and 10, both matching 2 tokens back: the latest


def test_a_short_match_proposes_a_short_chain():
    tokens = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3]  # the end "1 2 3" matches 3 tokens back
    limits = ((4, 1), (6, 2))
    assert NgramIndex(tokens, chain_by_match=limits).propose(4) == [4]
    assert NgramIndex(tokens, chain_by_match=()).propose(4) == [4, 5, 6, 8]
    longer = [7, 1, 2, 3, 4, 5, 6, 8, 7, 1, 2, 3]  # "7 1 2 3": 4 tokens
    assert NgramIndex(longer, chain_by_match=limits).propose(4) == [4, 5]
    longest = [0, 9, 7, 1, 2, 3, 4, 5, 6, 0, 9, 7, 1, 2, 3]  # 6 tokens: the step's depth
    assert NgramIndex(longest, chain_by_match=limits).propose(4) == [4, 5, 6, 0]
    assert NgramIndex(longest, chain_by_match=limits).propose(2) == [4, 5]


def test_short_suffixes_propose_nothing():
    index = NgramIndex([1, 2, 1, 2], min_n=3)
    assert index.propose(4) == []  # "1 2" repeats, but no 3-gram does
    assert NgramIndex([], min_n=3).propose(4) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex([1], min_n=3, max_match=2)
    with pytest.raises(ValueError, match="candidates"):
        NgramIndex([1], candidates=0)


def brute_force_proposal(tokens: list[int], min_n: int, max_match: int, candidates: int, limits, k: int) -> list[int]:
    """What the index must propose, by scanning the context: every earlier occurrence of its last min_n tokens."""
    end = len(tokens)
    if end < min_n:
        return []
    followers = [s + min_n for s in range(end - min_n) if tokens[s:s + min_n] == tokens[end - min_n:]][-candidates:]
    best = None
    for follower in followers:
        length = min_n
        while (length < max_match and follower - length > 0
               and tokens[follower - length - 1] == tokens[end - length - 1]):
            length += 1
        if best is None or length >= best[0]:
            best = (length, follower)
    if best is None:
        return []
    limit = next((chain for shorter, chain in limits if best[0] < shorter), k)
    return tokens[best[1]:best[1] + min(k, limit)]


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 3), st.integers(0, 4), st.integers(1, 3),
       st.sampled_from([(), ((4, 1), (6, 2)), ((3, 2),)]), st.integers(1, 5))
def test_a_proposal_is_what_followed_the_best_matching_earlier_occurrence(tokens, min_n, extra, candidates, limits,
                                                                          k):
    max_match = min_n + extra
    half = len(tokens) // 2  # built in two parts: extending is the same as building at once
    index = NgramIndex(tokens[:half], min_n, max_match, candidates, limits)
    index.extend(tokens[half:])
    assert index.propose(k) == brute_force_proposal(tokens, min_n, max_match, candidates, limits, k)


def test_chain_tree_greedy_and_sampled():
    greedy = chain_tree([5, 7, 5], SamplingParams(temperature=0.0))
    assert greedy.token_ids.tolist() == [5, 7, 5] and greedy.parents.tolist() == [-1, 0, 1] and not greedy.draft_probs
    sampled = chain_tree([5, 7, 5], SamplingParams(temperature=0.8))
    assert sampled.active_ids.tolist() == [5, 7]
    assert {node: q.tolist() for node, q in sampled.draft_probs.items()} == {-1: [1, 0], 0: [0, 1], 1: [1, 0]}
    assert chain_tree([], SamplingParams()).size == 0


# ---- lossless: greedy ------------------------------------------------------------------------------------------------

REPEATING = [5, 6, 7, 8, 9, 10] * 5 + [5, 6, 7]


@pytest.mark.parametrize("tree", [TreeParams(shape="chain", num_draft_tokens=4),
                                  TreeParams(shape="tree", depth=3, branching=2, budget=6)], ids=["chain", "tree"])
def test_greedy_lookup_is_ar_token_for_token(decoder, tree, verification):
    sampling = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for prompt in (REPEATING, [(7 * j + 3) % 90 + 2 for j in range(40)]):
        ref = decoder.generate(prompt, sampling, SpecParams(method="ar"))
        got = decoder.generate(prompt, sampling, SpecParams(method="lookup", tree=tree))
        assert list(got) and list(ref)
        assert got.output_ids == ref.output_ids
    assert got.stats.drafted > 0 and got.stats.drafted <= got.stats.steps * tree.levels


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_the_scheduler_drafts_lookup_chains_and_commits_ars_tokens(decoder, adaptive, verification):
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [REPEATING, REPEATING[3:] * 2, [(5 * j + 1) % 90 + 2 for j in range(30)]]
    vocab = {"static_size": 64, "dynamic_size": 8}
    requests = [(p, sampling, SpecParams(method=m, vocab=vocab)) for p in prompts for m in ("lookup", "ar", "evospec")]
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=8192, prefill_chunk=32, adaptive=adaptive))
    sinks = run_all(scheduler, requests)
    by_prompt = {}
    for (prompt, _, spec), sink in zip(requests, sinks):
        by_prompt.setdefault(tuple(prompt), {})[spec.method] = sink
    for outputs in by_prompt.values():
        assert outputs["lookup"].tokens == outputs["ar"].tokens == outputs["evospec"].tokens
    assert sum(out["lookup"].finished.stats.drafted for out in by_prompt.values()) > 0
    assert all(out["ar"].finished.stats.drafted == 0 for out in by_prompt.values())
    assert scheduler.arena.free_tokens == scheduler.arena.capacity


# ---- lossless: sampling ----------------------------------------------------------------------------------------------

SMALL_VOCAB = 6
FULL_SAMPLES = 20_000


def first_of_reference(tree, probs, generator) -> int:
    return verify_stochastic(tree, probs, generator).committed_tokens[0]


def first_of_batched(tree, probs, generator) -> int:
    """verify_on_device takes logits: log p gives p back at temperature 1."""
    return verify_on_device([tree], probs.log(), [SamplingParams(temperature=1.0)], [generator])[0].committed_tokens[0]


def first_of_naive(tree, probs, generator) -> int:
    """Negative control: accepts the proposed token with probability p(x) but, on a rejection, samples p itself (no
    residual without x): x is then over-represented."""
    u = torch.rand(2, generator=generator)
    proposed = int(tree.token_ids[0])
    return proposed if u[0] < probs[0, proposed] else int(sample_by_inverse_cdf(probs[0], u[1]))


def first_token_counts(first_of, chain, probs, seed) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    tree = chain_tree(chain, SamplingParams(temperature=1.0))
    rows = torch.stack([probs[0]] + [probs[1 + t] for t in chain])
    counts = np.zeros(SMALL_VOCAB)
    for _ in range(samples(FULL_SAMPLES)):
        counts[first_of(tree, rows, generator)] += 1
    return counts


@pytest.mark.parametrize("first_of", [first_of_reference, first_of_batched], ids=["reference", "batched"])
def test_sampled_lookup_commits_the_targets_distribution(first_of):
    gen = torch.Generator().manual_seed(5)
    probs = logits_to_probs(torch.randn(1 + SMALL_VOCAB, SMALL_VOCAB, generator=gen) * 1.5,
                            SamplingParams(temperature=1.0))
    chain = [int(probs[0].argmax()), 2, 2]  # the likeliest token first: a rejection must move its mass elsewhere
    assert chi_square_p(first_token_counts(first_of, chain, probs, seed=1), probs[0].numpy()) > 1e-3
    control = first_token_counts(first_of_naive, chain, probs, seed=1)
    assert chi_square_p(control, probs[0].numpy()) < 1e-6  # the same count rejects a verifier without the residual


def test_the_budget_prices_a_lookup_chain_at_its_rows_alone():
    """A draft model whose level costs nearly a target row's worth of time does not pay at this acceptance; the
    same chain from prompt lookup (no draft forward) does, from the first step (no draft cost to learn first)."""
    target_cost = TokenCostTable()
    for tokens in range(1, 9):
        target_cost.calibrate(tokens, 0.060 + 0.020 * (tokens - 1))  # a 2-core CPU: ~20 ms per verify row
    draft_prior = OnlineCost(4)
    draft_prior.calibrate(draft_features(1, 1, 1), 0.050)  # a draft level: ~50 ms
    budget = SpeculationBudget(target_cost, draft_prior)
    chain = TreeParams(shape="chain", num_draft_tokens=4)
    assert budget.choose([(chain, Acceptance(), draft_kind(SpecParams(method="evospec")))], 0) == 0
    assert budget.choose([(chain, Acceptance(), draft_kind(SpecParams(method="lookup")))], 0) >= 1


def test_the_sizing_replay_walks_an_answer_as_the_scheduler_would():
    """bench/lookup.py's replay: no match for two steps (one token each), then "1 2" proposes the rest, accepted in
    full, plus the target's own next token; each step priced at its rows."""
    from evospec.bench.lookup import Variant, replay
    cost = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}
    bigrams = Variant(min_n=2, candidates=1, chain_by_match=(), k=3)
    run = replay([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 9], bigrams, cost)
    assert (run.tokens, run.steps, run.drafted, run.accepted, run.seconds) == (6, 3, 3, 3, 4.5)
    wrong = replay([1, 2, 3, 4, 5], [1, 2, 7, 7, 7, 7], bigrams, cost)
    # "1 2" proposes 3 4 5, rejected at once; later "7 7" proposes the one 7 that followed it, accepted
    assert (wrong.steps, wrong.drafted, wrong.accepted) == (6, 4, 1)


def test_a_step_that_also_prefilled_teaches_drafting_nothing():
    """A forward over a prompt chunk and a lookup chain took longer than the cost table says (its error at prefill
    sizes): that excess is not the chain's, so the kind's learnt cost stays a probe and lookup keeps drafting. In a
    step of decoding alone the same forward teaches the target's cost table, not lookup (no weights of its own)."""
    target_cost = TokenCostTable()
    for tokens in range(1, 9):
        target_cost.calibrate(tokens, 0.060 + 0.020 * (tokens - 1))
    budget = SpeculationBudget(target_cost, OnlineCost(4))
    kind, chain = draft_kind(SpecParams(method="lookup")), TreeParams(shape="chain", num_draft_tokens=4)
    before = budget.draft_cost(kind).weights.copy()

    def outcome(prefilled: bool) -> StepOutcome:
        return StepOutcome(depth=0, lookup_depth=4, trees=[(kind, chain)], drafting=[kind], prefilled=prefilled,
                           draft_prefilled=False, draft_failed=False, tokens=256 + 5, target_seconds=6.0,
                           draft_seconds=1e-4, committed=3)

    for _ in range(20):
        budget.record_step_outcome(outcome(prefilled=True))
    assert (budget.draft_cost(kind).weights == before).all()
    assert budget.choose([(chain, Acceptance(), kind)], 0) >= 1
    budget.record_step_outcome(outcome(prefilled=False))
    assert budget.draft_cost(kind)(draft_features(4, 1, 1)) < 2 * LOOKUP_SECONDS_PER_SESSION
    assert budget.target_cost(256 + 5) == pytest.approx(6.0)


def test_long_prompts_chained_at_c4_do_not_price_chains_out_of_a_short_request():
    """Chains verified beside three long-context requests took twice what the cost table (calibrated over a short
    context) says. That is the target's attention over long contexts, not lookup's: later, one short request with
    chains that pass still gets them (charged to lookup, the excess priced chains out of every later request, and
    nothing re-measured it)."""
    target_cost = TokenCostTable()
    for tokens in range(1, 33):
        target_cost.calibrate(tokens, 0.060 + 0.020 * (tokens - 1))
    budget = SpeculationBudget(target_cost, OnlineCost(4), explore_every=10**6)
    kind, chain = draft_kind(SpecParams(method="lookup")), TreeParams(shape="chain", num_draft_tokens=4)
    for _ in range(200):  # c = 4, long contexts: every forward twice the table, a chain of 4 on one request
        budget.record_step_outcome(StepOutcome(
            depth=0, lookup_depth=4, trees=[(kind, chain)], drafting=[kind] * 4, prefilled=False,
            draft_prefilled=False, draft_failed=False, tokens=4 + 4,
            target_seconds=2 * target_cost(8), draft_seconds=1e-4, committed=4))
    for _ in range(20):  # c = 1, a short context: plain steps at the table's start-up price
        budget.record_step_outcome(StepOutcome(
            depth=0, lookup_depth=0, trees=[], drafting=[kind], prefilled=False, draft_prefilled=False,
            draft_failed=False, tokens=1, target_seconds=0.060, draft_seconds=1e-4, committed=1))
    passing = Acceptance()
    for _ in range(20):
        passing.record(4, 4)
    assert budget.choose([(chain, passing, kind)], 0, source="lookup") == 4


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no-fallback"])
def test_a_draft_that_does_not_pay_falls_back_to_lookup_chains(decoder, fallback, verification):
    """The budget finds that the draft model never pays (a level costs seconds): with `lookup_fallback` the evospec
    request still verifies prompt-lookup chains, and commits `ar`'s tokens either way."""
    target_cost = TokenCostTable()
    for tokens in range(1, 65):
        target_cost.calibrate(tokens, 0.060 + 0.020 * (tokens - 1))
    draft_prior = OnlineCost(4)
    draft_prior.calibrate(draft_features(1, 1, 1), 10.0)
    budget = SpeculationBudget(target_cost, draft_prior, explore_every=10**6)
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=8192, prefill_chunk=32, lookup_fallback=fallback),
                          budget=budget)
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec = SpecParams(method="evospec", vocab={"static_size": 64, "dynamic_size": 8})
    [sink] = run_all(scheduler, [(REPEATING, sampling, spec)])
    ref = decoder.generate(REPEATING, sampling, SpecParams(method="ar"))
    list(ref)
    assert sink.tokens == ref.output_ids
    stats = sink.finished.stats
    assert (stats.drafted > 0) == fallback and stats.fallback_steps == 0
    assert scheduler.drafter.arena.free_tokens == scheduler.drafter.arena.capacity  # its draft session was closed
