"""Continuous batching against its oracle, the per-request loop: packed forwards, batched verification, the KV arena,
and the scheduler with every method, tree shape, vocabulary and sampling setting mixed in one batch."""
import copy
import functools
import random
import time

import numpy as np
import pytest
import torch

from evospec.config import SamplingParams, SchedulerConfig, SpecParams, TreeParams
from evospec.engine.budget import OnlineCost, SpeculationBudget, TokenCostTable, draft_kind
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.runner import SchedulerThread
from evospec.engine.scheduler import DeadlineExceeded, Failed, Finished, Scheduler
from evospec.errors import EvoSpecError, InvalidRequestError, OverloadedError
from evospec.kernels.tree import chain_then_tree_mask, chain_then_tree_positions
from evospec.model import KVArena, Segment
from evospec.testing import (
    Collector,
    chi_square_p,
    exact_two_token_joint,
    random_pair,
    run_all,
    samples,
    seeded_runs,
)

VOCAB = 96


@pytest.fixture(scope="module")
def decoder():
    target, draft = random_pair(vocab=VOCAB, seed=3, eos=1)
    return SpeculativeDecoder(target, draft, static_ids=torch.arange(VOCAB).flip(0)[:64])


def oracle(decoder, prompt, sampling, spec):
    gen = decoder.generate(prompt, sampling, spec)
    list(gen)
    return gen


# ---- packed forward and batched verification --------------------------------------------------------------------

def test_packed_forward_equals_one_sequence_at_a_time(decoder):
    model = decoder.target.model
    arena = KVArena(model, 256)
    prompts = [[5, 9, 13, 2, 7], [3], [40, 41, 42, 43, 44, 45, 46, 47]]
    trees = [torch.tensor([-1, 0, 0]), None, torch.tensor([-1, -1, 1])]
    caches, solo = [arena.reserve(32) for _ in prompts], [model.new_cache(32) for _ in prompts]
    segments, expected = [], []
    for prompt, parents, cache, own in zip(prompts, trees, caches, solo):
        n_tree = 0 if parents is None else parents.shape[0]
        ids = torch.tensor(prompt + [11] * n_tree)
        mask = chain_then_tree_mask(0, len(prompt), parents)
        positions = chain_then_tree_positions(0, len(prompt), parents)
        segments.append(Segment(cache, ids, positions, mask, 0))
        expected.append(model(ids, positions, own, mask))
    packed = model.forward_packed(segments)
    torch.testing.assert_close(packed, torch.cat(expected), rtol=1e-5, atol=1e-5)
    for cache, own, prompt in zip(caches, solo, prompts):  # each sequence's K/V landed in its own region
        torch.testing.assert_close(cache.keys[:, :, :len(prompt)], own.keys[:, :, :len(prompt)])


def test_kv_arena_reserves_releases_and_merges(decoder):
    arena = KVArena(decoder.target.model, 100)
    a, b, c = arena.reserve(30), arena.reserve(30), arena.reserve(30)
    assert arena.reserve(20) is None and arena.free_tokens == 10
    arena.release(b)
    arena.release(b)  # idempotent
    assert arena.largest_free == 30 and arena.reserve(31) is None
    arena.release(a)
    assert arena.largest_free == 60  # merged with its free neighbour
    arena.release(c)
    assert arena.free_tokens == 100 and arena.largest_free == 100
    region = arena.reserve(100)
    region.keys[0, 0, 3] = 7.0  # a region is a view: writes reach the arena
    assert arena.keys[0, 0, 3].eq(7.0).all()


# ---- the scheduler against the per-request loop -----------------------------------------------------------------

MIXED = [
    ("ar", TreeParams(), {}),
    ("sd", TreeParams(shape="chain", num_draft_tokens=3), {}),
    ("sd", TreeParams(shape="tree", depth=4, branching=3, budget=10), {}),
    ("frspec", TreeParams(shape="chain", num_draft_tokens=5), {"static_size": 48}),
    ("frspec", TreeParams(shape="tree", depth=3, branching=2, budget=6), {"static_size": 64}),
    ("evospec", TreeParams(shape="chain", num_draft_tokens=4), {"static_size": 32, "dynamic_size": 16}),
    ("evospec", TreeParams(shape="tree", depth=5, branching=2, budget=12), {"static_size": 48, "dynamic_size": 8}),
    ("lookup", TreeParams(shape="chain", num_draft_tokens=4), {}),
    ("lookup", TreeParams(shape="tree", depth=3, branching=2, budget=6), {}),
]


def mixed_requests(temperature_of):
    out = []
    for i, (method, tree, vocab) in enumerate(MIXED * 2):
        prompt = [(7 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(1 + (5 * i) % 23)]
        sampling = SamplingParams(max_tokens=12 + 3 * i, temperature=temperature_of(i), top_p=0.9 if i % 3 else 1.0,
                                  seed=1000 + i, ignore_eos=i % 2 == 0)
        out.append((prompt, sampling, SpecParams(method=method, tree=tree, vocab=vocab)))
    return out


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_mixed_batch_greedy_identical_to_per_request_loop(decoder, adaptive, verification):
    requests = mixed_requests(lambda i: 0.0)
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, prefill_chunk=16, adaptive=adaptive))
    sinks = run_all(scheduler, requests)
    for (prompt, sampling, spec), sink in zip(requests, sinks):
        ref = oracle(decoder, prompt, sampling, spec)
        assert sink.tokens == ref.output_ids, spec.method
        assert isinstance(sink.finished, Finished) and sink.finished.finish_reason == ref.finish_reason
    assert scheduler.arena.free_tokens == scheduler.arena.capacity  # every region returned
    assert scheduler.drafter.arena.free_tokens == scheduler.drafter.arena.capacity
    if not adaptive:
        assert sum(s.finished.stats.accepted for s in sinks) > 0


def test_mixed_batch_seeded_sampling_identical_to_per_request_loop(decoder, verification):
    """With the draft depth fixed, each request draws the same random numbers in the same order as alone."""
    requests = mixed_requests(lambda i: [0.0, 0.7, 1.0][i % 3])
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, prefill_chunk=8, adaptive=False,
                                                   draft_prefill="with_target"))
    sinks = run_all(scheduler, requests)
    for (prompt, sampling, spec), sink in zip(requests, sinks):
        assert sink.tokens == oracle(decoder, prompt, sampling, spec).output_ids


# A draft depth drawn at random each step keeps the target's distribution: the `sd-tree-random-depth` case of
# tests/unit/test_engine_sampling.py (with its negative control).


# ---- admission, chunked prefill, cancellation, deadlines --------------------------------------------------------

def test_long_prompt_prefills_in_chunks_while_others_decode(decoder):
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, prefill_chunk=8, adaptive=False))
    short, long_ = Collector(), Collector()
    scheduler.submit([5, 6], SamplingParams(max_tokens=20, ignore_eos=True), SpecParams(method="ar"), short)
    scheduler.step()
    scheduler.submit(list(range(2, 90)), SamplingParams(max_tokens=4, ignore_eos=True), SpecParams(method="sd"), long_)
    for _ in range(5):  # 87 prompt tokens = 11 chunks: the short request gets a token every step meanwhile
        before = len(short.tokens)
        scheduler.step()
        assert len(short.tokens) == before + 1
    assert not long_.tokens
    scheduler.run_until_idle()
    assert long_.tokens == oracle(decoder, list(range(2, 90)), SamplingParams(max_tokens=4, ignore_eos=True),
                                  SpecParams(method="sd")).output_ids


class RecordingDrafter:
    """Wraps the in-process batch drafter and logs each propose as (trees asked, draft prompt tokens prefilled)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, requests, prefills):
        self.calls.append((len(requests), sum(prefills.values())))
        return self.inner.propose(requests, prefills)

    def prefill(self, prefills):
        self.calls.append((0, sum(prefills.values())))
        return self.inner.prefill(prefills)


def test_deferred_draft_prefill_never_delays_the_first_token(decoder):
    """draft_prefill deferred (the default): the target's prefill runs alone; the draft catches up on the prompt in
    chunks after the first token, while the request decodes target-only; then it drafts. Greedy output is the
    target's, and those first steps are not fallback steps (nothing failed)."""
    prompt, sampling = list(range(2, 40)), SamplingParams(max_tokens=24, ignore_eos=True)
    spec = SpecParams(method="frspec", tree=TreeParams(shape="chain", num_draft_tokens=3), vocab={"static_size": 64})
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, prefill_chunk=8, adaptive=False))
    scheduler.drafter = RecordingDrafter(scheduler.drafter)
    sink = Collector()
    scheduler.submit(prompt, sampling, spec, sink)
    while not sink.tokens:
        scheduler.step()
    assert scheduler.drafter.calls == []  # 5 target prefill steps, no draft work before the first token
    scheduler.run_until_idle()
    catch_up = [tokens for trees, tokens in scheduler.drafter.calls if tokens]
    assert sum(catch_up) == len(prompt) - 1 and max(catch_up) <= 8  # in chunks of prefill_chunk
    assert sink.tokens == oracle(decoder, prompt, sampling, spec).output_ids
    stats = sink.finished.stats
    assert stats.drafted > 0 and stats.fallback_steps == 0 and stats.fallback_reason == ""


def test_catch_up_waits_for_steps_without_target_prefill(decoder):
    """A draft's catch-up never runs in a step that prefills another request's prompt (it would delay that
    request's first token); it runs once the target's prefill is done."""
    spec = SpecParams(method="frspec", tree=TreeParams(shape="chain", num_draft_tokens=3), vocab={"static_size": 64})
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, prefill_chunk=8, adaptive=False))
    drafter = scheduler.drafter = RecordingDrafter(scheduler.drafter)
    prefilling_at_catch_up = []
    real_prefill = drafter.prefill

    def prefill(prefills):
        prefilling_at_catch_up.append(any(r.target.prefill_remaining for r in scheduler._running.values()))
        return real_prefill(prefills)
    drafter.prefill = prefill
    first, second = Collector(), Collector()
    scheduler.submit(list(range(2, 20)), SamplingParams(max_tokens=30, ignore_eos=True), spec, first)
    while not first.tokens:
        scheduler.step()
    scheduler.submit(list(range(3, 60)), SamplingParams(max_tokens=30, ignore_eos=True), spec, second)
    scheduler.run_until_idle()
    assert prefilling_at_catch_up and not any(prefilling_at_catch_up)
    assert first.finished.stats.drafted > 0 and second.finished.stats.drafted > 0


def test_admission_waits_for_kv_and_refuses_what_never_fits(decoder):
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=64, max_waiting=2, adaptive=False))
    with pytest.raises(InvalidRequestError, match="lower max_tokens"):
        scheduler.submit([3] * 10, SamplingParams(max_tokens=60), SpecParams(method="ar"), Collector())
    sinks = [Collector() for _ in range(3)]
    for sink in sinks[:2]:  # 20 + 2 prompt + 4 + 2 = 28 KV tokens each
        scheduler.submit([3, 4], sampling, SpecParams(method="sd"), sink)
    scheduler.step()
    assert scheduler.num_running() == 2
    scheduler.submit([3, 4], sampling, SpecParams(method="ar"), sinks[2])
    scheduler.step()
    assert scheduler.num_running() == 2 and scheduler.num_waiting() == 1  # waits for a region
    scheduler.submit([3, 4], sampling, SpecParams(method="ar"), Collector())
    with pytest.raises(OverloadedError, match="max_waiting"):
        scheduler.submit([3, 4], sampling, SpecParams(method="ar"), Collector())
    scheduler.run_until_idle()
    assert all(isinstance(s.finished, Finished) and len(s.tokens) == 20 for s in sinks)
    with pytest.raises(InvalidRequestError, match="static_size"):
        scheduler.submit([3], sampling, SpecParams(method="frspec", vocab={"static_size": 10**6}), Collector())


def test_cancel_and_deadline_free_resources(decoder):
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=1024, adaptive=False))
    cancelled, late, ok = Collector(), Collector(), Collector()
    sampling = SamplingParams(max_tokens=50, ignore_eos=True)
    handle = scheduler.submit([3, 4], sampling, SpecParams(method="evospec", vocab={"static_size": 32}), cancelled)
    scheduler.submit([3, 4], sampling, SpecParams(method="sd"), late, deadline=0.0)  # already past
    scheduler.submit([3, 4], sampling, SpecParams(method="sd"), ok)
    scheduler.step()
    handle.cancel()
    scheduler.run_until_idle()
    assert cancelled.finished is None and len(cancelled.tokens) < 50  # no events after the cancel
    assert isinstance(late.finished, Failed) and isinstance(late.finished.error, DeadlineExceeded)
    assert isinstance(ok.finished, Finished) and len(ok.tokens) == 50
    assert scheduler.arena.free_tokens == scheduler.arena.capacity
    assert not scheduler.drafter.sessions


def test_scheduler_thread_serves_concurrent_submitters_and_stops(decoder):
    import threading
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096))
    runner = SchedulerThread(scheduler).start()
    done = [threading.Event() for _ in range(6)]
    sinks = []
    for i in range(6):
        sink = Collector()
        sinks.append(sink)

        def on_event(event, sink=sink, ev=done[i]):
            sink.events.append(event)
            if isinstance(event, Finished | Failed):
                ev.set()
        scheduler.submit([4 + i, 5], SamplingParams(max_tokens=16, ignore_eos=True),
                         SpecParams(method=["ar", "sd", "frspec"][i % 3], vocab={"static_size": 64}), on_event)
    assert all(e.wait(60) for e in done)
    runner.stop()
    for i, sink in enumerate(sinks):
        spec = SpecParams(method=["ar", "sd", "frspec"][i % 3], vocab={"static_size": 64})
        assert sink.tokens == oracle(decoder, [4 + i, 5], SamplingParams(max_tokens=16, ignore_eos=True),
                                     spec).output_ids


def test_budget_picks_depth_by_goodput_and_re_measures():
    from evospec.engine.budget import Acceptance, draft_features

    def budget(draft_level_seconds, per_token=0.0001):
        target, draft = TokenCostTable(), OnlineCost(4)
        for tokens in (1, 8, 64):
            target.update(tokens, 0.010 + per_token * tokens)
        for depth in (1, 2, 4):
            for sessions in (1, 8):
                draft.calibrate(draft_features(depth, sessions, sessions), depth * draft_level_seconds)
        return SpeculationBudget(target, draft, explore_every=5)

    chain = TreeParams(shape="chain", num_draft_tokens=6)
    sure, unsure = Acceptance([100.0] * 6, [95.0] * 6), Acceptance([100.0] * 6, [5.0] * 6)
    kind = ("frspec", 32768, 0)
    assert budget(0.0005).choose([(chain, sure, kind)] * 4, 0) == 6  # cheap draft, high acceptance: whole chain
    expensive = budget(0.02)
    picks = [expensive.choose([(chain, unsure, kind)] * 4, 0) for _ in range(5)]
    assert picks[:4] == [0, 0, 0, 0] and picks[4] > 0  # plain decoding, then one step to measure again
    busy = budget(0.0005, per_token=0.001)  # a target whose forward grows fast with tokens (compute-bound)
    light, heavy = busy.choose([(chain, sure, kind)], 0), busy.choose([(chain, sure, kind)] * 32, 0)
    assert light == 6 and 0 < heavy < light  # the busier the step, the shallower the speculation


def test_the_budget_learns_from_drafting_steps_not_from_prefilling_ones(decoder):
    """Steps that drafted trees feed the budget's draft costs and goodput; steps in which a draft session prefilled
    (its catch-up) are left out, since their cost is not drafting's."""
    target_cost, draft_prior = TokenCostTable(), OnlineCost(4)
    for tokens in (1, 8, 64):
        target_cost.update(tokens, 0.01)
    draft_prior.calibrate([1.0, 1.0, 1.0, 1.0], 1e-6)  # drafting looks free: the budget drafts
    budget = SpeculationBudget(target_cost, draft_prior)
    recorded = []
    real_record = budget.record_step_outcome
    budget.record_step_outcome = lambda outcome: recorded.append(outcome) or real_record(outcome)
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, prefill_chunk=8), budget=budget)
    spec = SpecParams(method="frspec", tree=TreeParams(shape="chain", num_draft_tokens=3), vocab={"static_size": 64})
    sink = Collector()
    scheduler.submit(list(range(2, 30)), SamplingParams(max_tokens=20, ignore_eos=True), spec, sink)
    scheduler.run_until_idle()
    assert sink.finished.stats.drafted > 0
    assert any(o.trees and not o.draft_prefilled for o in recorded)  # drafting steps count ...
    assert any(o.draft_prefilled for o in recorded)  # ... and the catch-up steps are marked
    assert any(drafted for (_, _, drafted) in budget._goodput)
    assert budget.draft_cost(("frspec", 64, 0)).weights.any()


def test_the_target_cost_follows_the_context_so_drafting_is_not_billed_for_it():
    """Calibrated at start-up over a short context; later plain steps of 1 token take twice as long (a long
    context): the price of the 8-token forward a drafting step runs doubles too, so a drafting step that costs
    just that is charged nothing beyond its draft's own time."""
    from evospec.engine.budget import draft_features
    table = TokenCostTable()
    for tokens, seconds in ((1, 0.010), (8, 0.012), (64, 0.040)):
        table.calibrate(tokens, seconds)
    for _ in range(30):
        table.update(1, 0.020)
    assert table(1) == pytest.approx(0.020, rel=0.01) and table(8) == pytest.approx(0.024, rel=0.01)
    table.update(256, 0.200)  # a prefill chunk beyond the calibrated sizes is a size of its own
    assert table(256) == pytest.approx(0.200) and table(64) == pytest.approx(0.080, rel=0.01)
    budget = SpeculationBudget(table, OnlineCost(4))
    budget.record_step(8, 0.024, depth=7, drafting={("sd",): (1, 1)}, draft_seconds=0.007)
    assert budget.draft_cost(("sd",))(draft_features(7, 1, 1)) == pytest.approx(0.007, rel=0.05)


def test_a_remote_draft_s_measured_forwards_replace_the_guess_it_starts_from():
    """A remote draft starts priced at a tenth of a target step per level (a guess, optimistic on purpose); its
    replica's warm-up measurement (`calibrate_draft`) replaces that for every kind that has not drafted yet, and
    prices the first catch-up at its measured prefill rate instead of the target's: with a draft level as dear as a
    target step neither drafting nor a catch-up pays, and a kind that already measured its cost keeps it."""
    from evospec.engine.budget import Acceptance, DraftCosts, draft_features, level_cost
    target_cost = TokenCostTable()
    for tokens in (1, 2, 4, 8, 64):
        target_cost.calibrate(tokens, 0.010 + 0.001 * (tokens - 1))
    guess = SpeculationBudget(target_cost, level_cost({1: 0.001}))
    chain, kind, learnt = TreeParams(shape="chain", num_draft_tokens=4), ("frspec", 64, 0), ("sd",)
    requests = [(chain, Acceptance([100.0] * 4, [80.0] * 4), kind)]
    per_token = functools.partial(guess.seconds_saved_per_token, requests)
    assert guess.choose(requests, 0) > 0 and guess.catch_up(per_token, kind, 100, lag=8).pays
    guess.draft_cost(learnt).update([1.0, 1.0, 1.0, 1.0], 0.002)  # `sd` drafted once: its cost is measured
    before = guess.draft_cost(learnt).weights.copy()

    guess.calibrate_draft(DraftCosts(level_seconds={1: 0.012, 8: 0.030}, prefill_tokens=16, prefill_seconds=0.8))
    assert guess.draft_cost(kind)(draft_features(1, 1, 1)) == pytest.approx(0.012, rel=0.05)
    assert guess.choose(requests, 0) == 0
    decision = guess.catch_up(per_token, kind, 100, lag=8)
    assert not decision.pays and decision.cost == pytest.approx(8 * 0.8 / 16) and "prefill rate" not in decision.why
    np.testing.assert_array_equal(guess.draft_cost(learnt).weights, before)


def test_while_a_kind_is_learning_its_catch_up_must_cover_its_cost_twice():
    """Until a kind's acceptance is measured its saving rests on an assumed (high) acceptance, an upper bound: a
    catch-up is bought only when that covers its cost `learning_margin` (2) times; once measured, once."""
    target_cost = TokenCostTable()
    for tokens in (1, 8, 64):
        target_cost.calibrate(tokens, 0.01)
    budget, kind = SpeculationBudget(target_cost, OnlineCost(4)), ("frspec", 64, 0)
    budget.record_draft_prefill(100, 0.1)  # 1 ms per context token: a 100-token lag costs 0.1 s
    assert not budget.catch_up(lambda: 0.0015, kind, remaining_tokens=100, lag=100).pays  # 0.15 s saved: 1.5x
    assert budget.catch_up(lambda: 0.0025, kind, remaining_tokens=100, lag=100).pays  # 2.5x
    for _ in range(budget.learn_trees):
        budget.record_acceptance(kind, 4, 4)
    assert budget.catch_up(lambda: 0.0015, kind, remaining_tokens=100, lag=100).pays


def test_a_catch_up_runs_only_where_it_pays(decoder):
    """The draft's prefill of a request's context is bought only when the speculation it enables is expected to
    save more over the request's remaining tokens than it costs: an expensive catch-up for a short answer never
    runs (the request decodes as `ar` would, counted as no fallback), a long answer still catches up."""
    from evospec.engine.budget import Acceptance
    chain = TreeParams(shape="chain", num_draft_tokens=4)
    kind = ("frspec", 64, 0)
    requests = [(chain, Acceptance([100.0] * 4, [90.0] * 4), kind)]
    target_cost, draft_prior = TokenCostTable(), OnlineCost(4)
    for tokens in (1, 8, 64):
        target_cost.calibrate(tokens, 0.01)
    draft_prior.calibrate([1.0, 1.0, 1.0, 1.0], 1e-6)
    budget = SpeculationBudget(target_cost, draft_prior)
    per_token = functools.partial(budget.seconds_saved_per_token, requests)
    # unmeasured: priced at the target's own forward over the lag (0.01 s here), so a long answer buys the first
    # catch-up (which measures the rate) and a 1-token one does not
    first = budget.catch_up(per_token, kind, remaining_tokens=1000, lag=1000)
    assert first.pays and first.cost == pytest.approx(0.01) and "not measured" in first.why
    assert not budget.catch_up(per_token, kind, remaining_tokens=1, lag=1000).pays
    budget.record_draft_prefill(100, 0.1)  # 1 ms per context token
    assert budget.catch_up(per_token, kind, remaining_tokens=1000, lag=100).pays  # acceptance unknown: assumed high
    assert not budget.catch_up(per_token, kind, remaining_tokens=2, lag=1000).pays  # ... and still too dear
    for _ in range(budget.learn_trees):
        budget.record_acceptance(kind, 4, 4)
    saved = budget.seconds_saved_per_token(requests)
    assert 0 < saved < 0.01
    assert budget.catch_up(per_token, kind, remaining_tokens=1000, lag=100).pays
    decision = budget.catch_up(per_token, kind, remaining_tokens=10, lag=1000)
    assert not decision.pays and decision.cost == pytest.approx(1.0) and decision.saved < decision.cost
    assert budget.expected_remaining(generated=1, max_tokens=500) == 499  # no answer has ended yet
    for length in (2, 40, 40, 41):  # a 2-token warm-up among them changes nothing
        budget.record_finished(length)
    assert budget.expected_remaining(1, 500) == 39 and budget.expected_remaining(1, 10) == 9
    assert budget.expected_remaining(100, 500) == 20  # past the typical length: half that again

    budget.record_draft_prefill(1, 1000.0)  # now a catch-up is ruinous: the request never drafts
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, prefill_chunk=8, lookup_fallback=False),
                          budget=budget)  # (no prompt-lookup chains either: the draft's own trees are counted here)
    spec = SpecParams(method="frspec", tree=chain, vocab={"static_size": 64})
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    sink = Collector()
    scheduler.submit(list(range(2, 30)), sampling, spec, sink)
    while len(sink.tokens) < 3:
        scheduler.step()
    assert scheduler.num_without_draft() == {"draft_unavailable": 0, "catch_up_deferred": 1}  # /metrics' gauge
    scheduler.run_until_idle()
    stats = sink.finished.stats
    assert stats.drafted == 0 and stats.fallback_steps == 0 and not stats.fallback_reason
    assert sink.tokens == oracle(decoder, list(range(2, 30)), sampling, SpecParams(method="ar")).output_ids


def test_catch_ups_and_depth_rest_on_one_acceptance_optimistic_while_learning():
    """Until a kind has `learn_trees` verified trees, both the depth choice and the catch-up assume its acceptance
    shrunk towards the optimistic one (else a draft caught up on that promise would never draft, never learn, and
    every request would pay a catch-up nobody uses); the trees it has measured count already, and once measured,
    its real acceptance decides both."""
    from evospec.engine.budget import Acceptance, draft_features
    target_cost, draft_prior = TokenCostTable(), OnlineCost(4)
    for tokens in range(1, 9):  # each verify row costs 40% of a decode: depth 1 pays at 0.9, not at 0.6
        target_cost.calibrate(tokens, 0.010 + 0.004 * (tokens - 1))
    draft_prior.calibrate(draft_features(1, 1, 1), 0.003)
    budget = SpeculationBudget(target_cost, draft_prior)
    budget.record_draft_prefill(100, 0.1)  # catch-ups cost 1 ms per context token
    chain, kind = TreeParams(shape="chain", num_draft_tokens=1), ("evospec", 32768, 256)
    requests = [(chain, Acceptance(), kind)]
    per_token = functools.partial(budget.seconds_saved_per_token, requests)
    assert budget.learning(kind) and budget.choose(requests, 0) == 1
    assert budget.catch_up(per_token, kind, remaining_tokens=1000, lag=100).pays
    for i in range(budget.learn_trees):
        budget.record_acceptance(kind, 1, int(i % 5 < 3))  # 60% accepted
    assert not budget.learning(kind) and budget.choose(requests, 0) == 0
    assert not budget.catch_up(per_token, kind, remaining_tokens=1000, lag=100).pays
    rejected = ("frspec", 32768, 0)  # still learning, but its first 10 trees were all rejected: no more catch-ups
    for _ in range(10):
        budget.record_acceptance(rejected, 1, 0)
    assert budget.learning(rejected) and budget.choose([(chain, Acceptance(), rejected)], 0) == 0
    per_token = functools.partial(budget.seconds_saved_per_token, [(chain, Acceptance(), rejected)])
    assert not budget.catch_up(per_token, rejected, remaining_tokens=1000, lag=100).pays


class SlowFailingCatchUp:
    """Wraps the in-process batch drafter; its first catch-up prefill waits `wait_s` and then fails every session,
    as a draft replica killed mid-step does (the target waits for its deadline first)."""

    def __init__(self, inner, wait_s: float):
        self.inner, self.wait_s, self.failed = inner, wait_s, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, prefills):
        if self.failed:
            return self.inner.prefill(prefills)
        self.failed += 1
        time.sleep(self.wait_s)
        return {key: ConnectionResetError("draft replica gone") for key in prefills}


def test_a_draft_failure_does_not_teach_the_budget_that_drafting_never_pays(decoder):
    """A catch-up that failed after a long wait (a killed draft replica: the target waits for its deadline) is not
    the draft's prefill rate, and a step in which the draft failed is not drafting's cost or goodput. Learnt, one
    kill made every later request's catch-up look ruinous: they all decoded as `ar`, with no fallback counted."""
    from evospec.engine.budget import StepOutcome
    target_cost, draft_prior = TokenCostTable(), OnlineCost(4)
    for tokens in (1, 8, 64):
        target_cost.calibrate(tokens, 0.01)
    draft_prior.calibrate([1.0, 1.0, 1.0, 1.0], 1e-6)  # drafting looks cheap: the budget drafts
    budget = SpeculationBudget(target_cost, draft_prior)
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=8192, prefill_chunk=64, draft_retry_s=1e-6,
                                                   draft_max_retry_s=1e-6), budget=budget)
    drafter = scheduler.drafter = SlowFailingCatchUp(scheduler.drafter, wait_s=0.3)
    spec = SpecParams(method="frspec", tree=TreeParams(shape="chain", num_draft_tokens=3), vocab={"static_size": 64})
    sink = Collector()
    scheduler.submit(list(range(2, 40)), SamplingParams(max_tokens=24, ignore_eos=True), spec, sink)
    while not drafter.failed:
        scheduler.step()
    assert budget._draft_prefill.steps == 0  # the failed wait is no prefill rate
    scheduler.run_until_idle()
    assert sink.finished.stats.draft_resumes == 1 and budget._draft_prefill.steps > 0
    assert budget._draft_prefill.rate > 10 * 37 / 0.3  # the resumed catch-up's own rate, not the failure's

    kind = draft_kind(spec)
    before = (copy.deepcopy(budget._goodput), budget.draft_cost(kind).weights.copy())
    budget.record_step_outcome(StepOutcome(depth=3, trees=[(kind, spec.tree)], drafting=[kind], prefilled=False,
                                           draft_prefilled=False, draft_failed=True, tokens=4, target_seconds=0.01,
                                           draft_seconds=5.0, committed=1))
    assert budget._goodput.keys() == before[0].keys() and (budget.draft_cost(kind).weights == before[1]).all()


def test_budget_safety_net_stops_drafting_that_measures_worse():
    from evospec.engine.budget import Acceptance, draft_features
    target, draft = TokenCostTable(), OnlineCost(4)
    target.update(1, 0.010)
    target.update(8, 0.011)
    draft.calibrate(draft_features(1, 4, 4), 0.0001)  # the model thinks drafting is almost free
    budget = SpeculationBudget(target, draft, explore_every=1000)
    sd, frspec = ("sd",), ("frspec", 32768, 0)
    requests = [(TreeParams(shape="chain", num_draft_tokens=4), Acceptance([10.0] * 4, [9.0] * 4), sd)] * 4
    assert budget.choose(requests, 0) == 4
    budget.record_goodput(frozenset([sd]), 4, drafted=False, committed=4, seconds=0.010)  # 400 tok/s plain
    budget.record_goodput(frozenset([sd]), 4, drafted=True, committed=10, seconds=0.050)  # 200 tok/s drafting
    assert budget.choose(requests, 0) == 4  # one step of each is noise on a shared machine, not a verdict
    for _ in range(2):
        budget.record_goodput(frozenset([sd]), 4, drafted=False, committed=4, seconds=0.010)
        budget.record_goodput(frozenset([sd]), 4, drafted=True, committed=10, seconds=0.050)
    assert budget.choose(requests, 0) == 0
    assert budget.choose(requests[:2], 0) == 4  # other batch sizes keep the model's choice
    assert budget.choose([(p, a, frspec) for p, a, _ in requests], 0) == 4  # and other draft kinds
    for _ in range(12):  # drafting now measures 4% below plain: within the noise margin, the model decides again
        budget.record_goodput(frozenset([sd]), 4, drafted=True, committed=96, seconds=0.250)
    assert budget.choose(requests, 0) == 4


def test_deep_narrow_greedy_trees_fit_their_kv_to_the_last_token(decoder):
    """A greedy tree forwards (depth - 1) * branching scratch nodes before pruning to its budget: the draft's KV
    region must hold them in the last steps too (in the per-request loop and in the arena)."""
    spec = SpecParams(method="sd", tree=TreeParams(shape="tree", depth=8, branching=2, budget=8))
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    sink = Collector()
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=1024, adaptive=False))
    scheduler.submit([5, 6, 7], sampling, spec, sink)
    scheduler.run_until_idle()
    assert isinstance(sink.finished, Finished), sink.finished
    assert sink.tokens == oracle(decoder, [5, 6, 7], sampling, spec).output_ids


def test_submit_after_stop_is_refused(decoder):
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=1024, adaptive=False))
    SchedulerThread(scheduler).start().stop()
    with pytest.raises(OverloadedError, match="shutting down"):
        scheduler.submit([3], SamplingParams(max_tokens=4), SpecParams(method="ar"), Collector())


class FailingDrafter:
    """Wraps the in-process batch drafter; its `fail_at`-th propose raises for every session (a draft crash)."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, requests, prefills):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionResetError("draft replica gone\nwith a second line")
        return self.inner.propose(requests, prefills)


class QueuedCloseDrafter:
    """Wraps the in-process batch drafter with a remote drafter's contract: `close` is queued and delivered by the
    next `flush` (the end of an engine step)."""

    def __init__(self, inner):
        self.inner, self.queued = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def close(self, key):
        self.queued.append(key)

    def flush(self):
        self.inner.flush()
        for key in self.queued:
            self.inner.close(key)
        self.queued = []


def test_an_idle_scheduler_still_delivers_the_close_of_a_cancelled_request(decoder):
    """The last running request is cancelled: its draft session's close must reach the draft although no step
    follows (the scheduler goes idle), not wait for the next request."""
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=1024, adaptive=False))
    scheduler.drafter = QueuedCloseDrafter(scheduler.drafter)
    handle = scheduler.submit([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True),
                              SpecParams(method="sd"), Collector())
    for _ in range(3):
        scheduler.step()
    assert scheduler.drafter.inner.sessions
    handle.cancel()
    scheduler.step()
    assert not scheduler.drafter.inner.sessions and not scheduler.drafter.queued


def test_a_failing_draft_never_breaks_a_stream(decoder):
    """Lossless fallback: every generation completes from its committed state target-only, greedy output equal to
    the target's, and its statistics count the steps without the draft and say why."""
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, adaptive=False, draft_retry_s=1e6))
    scheduler.drafter = FailingDrafter(scheduler.drafter, fail_at=4)
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    sinks = [Collector() for _ in range(4)]
    for i, sink in enumerate(sinks):
        scheduler.submit([5 + i, 6], sampling, SpecParams(method=["sd", "frspec", "evospec", "ar"][i],
                                                            vocab={"static_size": 64}), sink)
    assert scheduler.num_without_draft() == {"draft_unavailable": 0, "catch_up_deferred": 0}
    while scheduler.drafter.calls < 4:
        scheduler.step()
    assert scheduler.num_without_draft() == {"draft_unavailable": 3, "catch_up_deferred": 0}  # /metrics' gauge
    scheduler.run_until_idle()
    assert scheduler.num_without_draft() == {"draft_unavailable": 0, "catch_up_deferred": 0}
    for i, sink in enumerate(sinks):
        assert isinstance(sink.finished, Finished), sink.finished
        assert sink.tokens == oracle(decoder, [5 + i, 6], sampling, SpecParams(method="ar")).output_ids
        stats = sink.finished.stats
        if i < 3:
            assert stats.fallback_steps > 0 and stats.drafted > 0  # drafted before the failure, not after
            assert stats.fallback_reason == "ConnectionResetError: draft replica gone"
        else:
            assert stats.fallback_steps == 0 and stats.fallback_reason == ""
    assert not scheduler.drafter.inner.sessions
    assert scheduler.arena.free_tokens == scheduler.arena.capacity


class FlakyDrafter:
    """Wraps the in-process batch drafter; each session's tree fails with probability `p` (seeded), and the drafter
    reports itself unavailable for `down` proposes after each failure: drafts drop and resume all the time."""

    def __init__(self, inner, p: float, seed: int, down: int = 1, scheduler=None):
        self.inner, self.p, self.rng, self.down = inner, p, random.Random(seed), down
        self.scheduler = scheduler
        self.unavailable = 0
        self.opened: list[tuple[str, list[int]]] = []  # (key, context) of every open
        self.trees_after_resume = 0
        self.errors: list[str] = []  # broken invariants (the scheduler would turn a raise into a fallback)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def available(self) -> bool:
        self.unavailable = max(0, self.unavailable - 1)
        return self.unavailable == 0

    def open(self, key, request):
        self.opened.append((key, list(request.prompt_ids)))
        self.inner.open(key, request)

    def propose(self, requests, prefills):
        for key in requests if self.scheduler is not None else ():
            request = self.scheduler._running[key]
            if self.inner.sessions[key].tokens != request.prompt_ids + request.output_ids:
                self.errors.append(f"draft session {key[:8]} is not on the committed context")
        try:
            out = self.inner.propose(requests, prefills)
        except Exception as exc:
            self.errors.append(repr(exc))
            raise
        for key in requests:
            if sum(k == key for k, _ in self.opened) > 1:
                self.trees_after_resume += 1
            if self.rng.random() < self.p:
                out[key] = ConnectionResetError("draft replica gone")
                self.unavailable = self.down
        return out


@pytest.mark.parametrize("prefill_chunk", [256, 3], ids=["one-chunk", "chunked-catch-up"])
def test_speculation_resumes_after_draft_failures(decoder, prefill_chunk):
    """Drafts fail at random and come back: each failed generation resumes speculation on a new draft session over
    its exact committed context (caught up in chunks), drafts trees again, and its greedy output stays the
    target's. Statistics count the resumes and the steps without a tree."""
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=8192, adaptive=False, prefill_chunk=prefill_chunk,
                                                   draft_retry_s=1e-6, draft_max_retry_s=1e-6))
    flaky = scheduler.drafter = FlakyDrafter(scheduler.drafter, p=0.15, seed=1, down=2, scheduler=scheduler)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    specs = [SpecParams(method=m, tree=t, vocab={"static_size": 64, "dynamic_size": 8})
             for m in ("sd", "frspec", "evospec") for t in (TreeParams(shape="chain", num_draft_tokens=3),
                                                            TreeParams(shape="tree", depth=3, branching=2, budget=6))]
    sinks = [Collector() for _ in specs]
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11][: 2 + i] for i in range(len(specs))]
    for prompt, spec, sink in zip(prompts, specs, sinks):
        scheduler.submit(prompt, sampling, spec, sink)
    scheduler.run_until_idle()
    resumes = 0
    for prompt, sink in zip(prompts, sinks):
        assert isinstance(sink.finished, Finished), sink.finished
        assert sink.tokens == oracle(decoder, prompt, sampling, SpecParams(method="ar")).output_ids
        stats = sink.finished.stats
        resumes += stats.draft_resumes
        if stats.draft_resumes:
            assert stats.fallback_steps > 0 and stats.fallback_reason == "ConnectionResetError: draft replica gone"
    assert resumes > 0 and flaky.trees_after_resume > 0 and flaky.errors == []
    key_prompt = {key: context for key, context in flaky.opened}  # a resumed session's context: prompt + output
    for key, context in flaky.opened:
        assert context == key_prompt[key][: len(context)]
    assert not scheduler.drafter.inner.sessions
    assert scheduler.arena.free_tokens == scheduler.arena.capacity


def test_a_draft_refusing_for_good_is_not_retried(decoder):
    """An error a reconnect cannot fix (another static vocabulary) drops the draft once and never resumes it."""
    class Refusing(FlakyDrafter):
        def propose(self, requests, prefills):
            error = EvoSpecError("draft and target use different static vocabularies")
            error.retryable = False
            return {key: error for key in [*requests, *prefills]}

    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, adaptive=False, draft_retry_s=1e-6))
    scheduler.drafter = Refusing(scheduler.drafter, p=0, seed=0)
    sink = Collector()
    scheduler.submit([5, 6], SamplingParams(max_tokens=12, ignore_eos=True), SpecParams(method="sd"), sink)
    scheduler.run_until_idle()
    assert sink.tokens == oracle(decoder, [5, 6], SamplingParams(max_tokens=12, ignore_eos=True),
                                 SpecParams(method="ar")).output_ids
    assert sink.finished.stats.draft_resumes == 0 and len(scheduler.drafter.opened) == 1


@pytest.mark.slow
@pytest.mark.parametrize("lossless", [True, False], ids=["verifier", "negative-control"])
def test_resumed_speculation_keeps_the_target_distribution(monkeypatch, lossless):
    """Sampling with drafts that fail and resume at random: the joint of tokens 3 and 4 (reached through drafted,
    target-only, catching-up and resumed steps) matches the target's exact distribution (chi-square). The negative
    control must be rejected at the same count: a verifier that keeps every drafted token (the draft's
    distribution; the subtler controls of test_engine_sampling.py hide in tokens 3 and 4 behind this many
    target-only steps, p 0.79 at 3k samples)."""
    if not lossless:
        monkeypatch.setattr("evospec.verify.accepts", lambda u, q_x, r_x: q_x > 0)
    vocab, prompt = 6, [2, 5, 3]
    target, draft = random_pair(vocab=vocab, seed=7, eos=0, noise=0.5)
    dec = SpeculativeDecoder(target, draft)
    sampling = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    scheduler = Scheduler(dec, SchedulerConfig(kv_tokens=8192, max_running=150, adaptive=False, draft_retry_s=1e-6,
                                               draft_max_retry_s=1e-6, draft_prefill="with_target"))  # drafts at once
    flaky = scheduler.drafter = FlakyDrafter(scheduler.drafter, p=0.35, seed=2, down=0, scheduler=scheduler)
    spec = SpecParams(method="sd", tree=TreeParams(shape="tree", depth=2, branching=2, budget=4))
    n, counts = samples(6000), np.zeros(vocab * vocab)
    for sink in seeded_runs(scheduler, prompt, sampling, spec, n, batch=150):
        counts[sink.tokens[2] * vocab + sink.tokens[3]] += 1
    assert flaky.trees_after_resume > n * 0.1 and flaky.errors == []
    first_two = exact_two_token_joint(target, prompt, sampling)
    expected = sum(first_two[x1 * vocab + x2] * exact_two_token_joint(target, prompt + [x1, x2], sampling)
                   for x1 in range(vocab) for x2 in range(vocab))
    p_value = chi_square_p(counts, expected)
    assert p_value > 1e-3 if lossless else p_value < 1e-3
