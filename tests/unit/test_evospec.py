"""EvoSpec: dynamic buffer eviction and residency, retrieval sources, update ordering, losslessness."""
import random

import numpy as np
import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.drafter import FeedbackRequest, feedbacks_for
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.testing import HostSyncCounter, random_feedback_batch, random_pair
from evospec.verify import VerifyResult
from evospec.vocab.dynamic import DynamicBuffer
from evospec.vocab.policy import SOURCES, EvoSpecPolicy, EvoSpecSettings
from evospec.vocab.retrieval import (
    TARGET_PRIORITY,
    CoocIndex,
    EmbeddingIndex,
    StatisticalRetriever,
    TargetFeedback,
    feedbacks_on_device,
    target_feedback,
    target_feedbacks,
)


def test_buffer_fills_free_slots_then_evicts_weakest_after_residency():
    buf = DynamicBuffer(capacity=2, min_residency=2, decay=1.0)
    changes = buf.merge({10: 1.0, 11: 2.0}, step=0)
    assert {c.token_id for c in changes} == {10, 11} and len(buf) == 2
    assert buf.merge({12: 5.0}, step=1) == []  # residents too young to evict
    changes = buf.merge({12: 5.0}, step=2)
    assert [(c.token_id, c.evicted) for c in changes] == [(12, 10)]  # 10 had the lowest score
    assert buf.evictions == 1 and 12 in buf and 10 not in buf


def test_buffer_keeps_residents_that_outscore_candidates_and_refreshes_them():
    buf = DynamicBuffer(capacity=1, min_residency=0, decay=0.5)
    buf.merge({7: 4.0}, step=0)
    assert buf.merge({8: 1.0}, step=1) == []  # 7 decayed to 2.0, still above 1.0
    buf.merge({7: 9.0}, step=2)  # refreshed
    assert buf.merge({8: 3.0}, step=3) == []  # 9.0 * 0.5 = 4.5 > 3.0
    assert [c.token_id for c in buf.merge({8: 5.0}, step=4)] == [8]


class ReferenceBuffer:
    """The buffer's policy written plainly (a scan of every slot per candidate): the oracle of DynamicBuffer."""

    def __init__(self, capacity, min_residency, decay):
        self.capacity, self.min_residency, self.decay = capacity, min_residency, decay
        self.ids, self.scores, self.inserted_at, self.slot_of = [-1] * capacity, [0.0] * capacity, [0] * capacity, {}

    def merge(self, candidates, step):
        self.scores = [s * self.decay for s in self.scores]
        fresh = []
        for tok, score in candidates.items():
            slot = self.slot_of.get(tok)
            if slot is None:
                fresh.append((score, tok))
            else:
                self.scores[slot] = max(self.scores[slot], score)
        changes = []
        for score, tok in sorted(fresh, reverse=True):
            free = next((i for i, t in enumerate(self.ids) if t < 0), None)
            if free is None:
                evictable = [i for i in range(self.capacity) if step - self.inserted_at[i] >= self.min_residency]
                weakest = min(evictable, key=lambda i: self.scores[i]) if evictable else None
                free = weakest if weakest is not None and self.scores[weakest] < score else None
            if free is None:
                break
            old = self.ids[free]
            self.slot_of.pop(old, None)
            self.ids[free], self.scores[free], self.inserted_at[free] = tok, score, step
            self.slot_of[tok] = free
            changes.append((free, tok, old))
        return changes


@pytest.mark.parametrize("capacity,min_residency,decay", [(1, 0, 0.5), (4, 0, 1.0), (8, 2, 0.9), (32, 4, 0.9)])
def test_buffer_merge_equals_the_plain_policy(capacity, min_residency, decay):
    """Random candidate streams with many score ties: the vectorized buffer makes exactly the plain policy's
    choices (slots, evictions, order)."""
    rng = random.Random(capacity * 100 + min_residency)
    fast, slow = DynamicBuffer(capacity, min_residency, decay), ReferenceBuffer(capacity, min_residency, decay)
    for step in range(300):
        candidates = {rng.randrange(60): float(rng.randrange(6)) for _ in range(rng.randrange(0, 12))}
        got = [(c.slot, c.token_id, c.evicted) for c in fast.merge(candidates, step)]
        assert got == slow.merge(candidates, step), step
        assert fast.slot_of == slow.slot_of


def test_statistical_counts_decay_and_stay_in_long_tail():
    long_tail = [False, False, True, True, True]
    stat = StatisticalRetriever(long_tail, decay=0.5)
    stat.observe([0, 2, 2, 3])
    stat.observe([4])
    cands = stat.candidates(5)
    assert set(cands) == {2, 3, 4}  # id 0 is in S
    assert cands[2] == pytest.approx(1.0) and cands[4] == pytest.approx(1.0) and cands[3] == pytest.approx(0.5)
    assert list(stat.candidates(2)) in ([2, 4], [4, 2])  # the top k by decayed count


def test_cooc_index_expands_seen_tokens():
    cooc = CoocIndex(torch.tensor([1, 5]), torch.tensor([[3, -1], [4, 3]]), torch.tensor([[1.0, 0.0], [0.5, 0.25]]))
    ids, w = cooc.expand([5, 9, 1])
    assert sorted(zip(ids.tolist(), w.tolist())) == [(3, 0.25), (3, 1.0), (4, 0.5)]


def test_semantic_index_returns_nearest_allowed_rows():
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [-1.0, 0.0]])
    index = EmbeddingIndex(emb, torch.tensor([0, 1, 2, 3]))
    allowed = torch.tensor([False, True, True, True])  # 0 is the nearest row but not allowed (in S)
    ids, sims = index.query(torch.tensor([[1.0, 0.05]]), k=2, allowed=allowed)
    assert ids.tolist() == [[2, 1]] and sims[0, 0] > 0.99


def test_low_rank_index_finds_the_exact_neighbours_with_exact_scores():
    """Rows near a 12-dim subspace of a 96-dim space (as real embeddings concentrate): the 16-dim scan plus exact
    re-ranking returns the exact search's neighbours and cosines."""
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(12, 96, generator=gen)
    emb = torch.randn(3000, 12, generator=gen) @ basis + 0.05 * torch.randn(3000, 96, generator=gen)
    pool = torch.arange(3000)
    allowed = torch.rand(3000, generator=gen) < 0.7
    exact, low = EmbeddingIndex(emb, pool, rank=96), EmbeddingIndex(emb, pool, rank=16, oversample=4)
    assert exact.projection is None and low.projection.shape == (96, 16)
    queries = emb[:20] + 0.1 * torch.randn(20, 96, generator=gen)
    want_ids, want_sims = exact.query(queries, 8, allowed)
    got_ids, got_sims = low.query(queries, 8, allowed)
    assert bool(allowed[got_ids].all())
    recall = np.mean([len(set(g) & set(w)) / 8 for g, w in zip(got_ids.tolist(), want_ids.tolist())])
    assert recall >= 0.95
    assert torch.allclose(got_sims[:, 0], want_sims[:, 0], atol=1e-5)


def test_target_feedback_reports_misses_and_likely_outsiders():
    in_active = torch.tensor([True, True, False, False, False])
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.25, 0.04, 0.01],    # accepted position: 0 was accepted
                                     [0.1, 0.05, 0.2, 0.05, 0.6]]))   # bonus row: committed 4, a miss
    fb = target_feedback(logits, committed=[0, 4], in_active=in_active, top_m=2, min_prob=0.03)
    assert fb.misses == 1 and fb.positions == 2
    # candidates come from the bonus row: the miss (4) first, then likely outsiders (2); 3 is below min_prob
    assert set(fb.candidates) == {4, 2}
    assert fb.candidates[4] > fb.candidates[2] >= TARGET_PRIORITY
    assert fb.candidates[2] == pytest.approx(TARGET_PRIORITY + 0.2)
    only_misses = target_feedback(logits, [0, 4], in_active, with_candidates=False)
    assert (only_misses.misses, only_misses.candidates) == (1, {})


def masked_feedback_candidates(row: torch.Tensor, in_active: torch.Tensor, top_m: int, min_prob: float) -> dict:
    """The plain definition: the top_m most likely ids outside A, kept when their probability is >= min_prob."""
    probs = row.softmax(-1)
    top = row.masked_fill(in_active, float("-inf")).topk(top_m)
    return {i: TARGET_PRIORITY + probs[i].item() for i in top.indices.tolist() if probs[i] >= min_prob}


@pytest.mark.parametrize("seed", range(20))
def test_target_feedback_candidates_equal_the_masked_definition(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 500
    row = torch.randn(vocab, generator=gen) * (1 + seed % 5)  # from flat to peaked distributions
    in_active = torch.rand(vocab, generator=gen) < 0.5
    fb = target_feedback(row[None], committed=[int(in_active.nonzero()[0])], in_active=in_active, min_prob=0.02)
    want = masked_feedback_candidates(row, in_active, top_m=4, min_prob=0.02)
    assert fb.candidates.keys() == want.keys()
    assert all(fb.candidates[i] == pytest.approx(want[i], abs=1e-5) for i in want)


@pytest.mark.parametrize("seed", range(12))
def test_batched_feedback_equals_the_per_request_feedback(seed):
    logits, committed, masks, wanted = random_feedback_batch(seed, requests=1 + seed % 6)
    batched = feedbacks_on_device(logits, committed, masks, wanted)
    for fb, args in zip(batched, zip(logits, committed, masks, wanted)):
        want = target_feedback(*args)
        assert (fb.misses, fb.positions, fb.candidates.keys()) == (want.misses, want.positions, want.candidates.keys())
        assert all(fb.candidates[i] == pytest.approx(want.candidates[i], rel=1e-6) for i in want.candidates)
    assert target_feedbacks(logits, committed, masks, wanted) == [target_feedback(*a) for a in
                                                                  zip(logits, committed, masks, wanted)]  # CPU


def test_batched_feedback_synchronises_once():
    """On a GPU the per-request feedback reads values several times per request (nonzero, item, tolist); the batch
    reads them once per step. The masks are the target's A mirrors, which live on its device."""
    logits, committed, masks, wanted = random_feedback_batch(0, requests=8)
    with HostSyncCounter(host_tensors=[]) as counter:
        feedbacks_on_device(logits, committed, masks, wanted)
    assert counter.calls == ["tolist"]
    with HostSyncCounter(host_tensors=[]) as counter:
        for args in zip(logits, committed, masks, wanted):
            target_feedback(*args)
    assert len(counter.calls) > 8  # the counter sees the per-request form's synchronisations


@pytest.fixture(scope="module")
def pair():
    return random_pair(vocab=96, seed=4, eos=1)


def evo_decoder(pair, static=48):
    target, draft = pair
    return SpeculativeDecoder(target, draft, static_ids=torch.arange(0, 96, 96 // static)[:static])


def test_buffer_updates_happen_only_between_steps(pair):
    """Spy on the vocabulary: every tree is verified against the A it was drafted with (no change in between)."""
    dec = evo_decoder(pair)
    events = []
    orig_propose, orig_verify = dec.draft.propose, dec.target.verify

    def propose(session):
        events.append(("draft", session.vocab.active.row_ids.clone()))
        return orig_propose(session)

    def verify(session, tree):
        events.append(("verify", tree.active_ids.clone() if tree.active_ids is not None else None))
        return orig_verify(session, tree)
    dec.draft.propose, dec.target.verify = propose, verify
    spec = SpecParams(method="evospec", tree=TreeParams(shape="tree", depth=3, branching=2, budget=6),
                      vocab={"static_size": 48, "dynamic_size": 8})
    gen = dec.generate([3, 50, 51, 77], SamplingParams(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True), spec)
    list(gen)
    pairs = list(zip(events[::2], events[1::2]))
    assert pairs and all(d[0] == "draft" and v[0] == "verify" and torch.equal(d[1], v[1]) for d, v in pairs)
    assert gen.stats.buffer_updates > 0  # the buffer did change, between steps
    assert len({tuple(d[1].tolist()) for d, _ in pairs}) > 1


def test_target_fed_buffer_learns_missed_tokens(pair):
    dec = evo_decoder(pair, static=12)
    sampling = SamplingParams(max_tokens=60, ignore_eos=True)
    fr = dec.generate([5, 6, 7], sampling, SpecParams(method="frspec", vocab={"static_size": 12}))
    evo = dec.generate([5, 6, 7], sampling, SpecParams(method="evospec", vocab={"static_size": 12, "dynamic_size": 32,
                                                                                 "retrieval": ("target",)}))
    list(fr), list(evo)
    assert evo.output_ids == fr.output_ids
    assert evo.stats.miss_rate < fr.stats.miss_rate and evo.stats.tau > fr.stats.tau


TREES = [TreeParams(shape="chain", num_draft_tokens=4), TreeParams(shape="tree", depth=4, branching=2, budget=10)]


@pytest.mark.parametrize("retrieval", [("statistical",), ("semantic",), ("target",),
                                       ("statistical", "semantic", "target")])
@pytest.mark.parametrize("tree", TREES, ids=["chain", "tree"])
def test_evospec_greedy_identical(pair, retrieval, tree):
    dec = evo_decoder(pair, static=24)
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    for prompt in ([9], [3, 60, 61, 62, 90, 91]):
        ref = dec.generate(prompt, sampling, SpecParams(method="ar"))
        out = dec.generate(prompt, sampling, SpecParams(method="evospec", tree=tree,
                                                        vocab={"static_size": 24, "dynamic_size": 8,
                                                               "retrieval": retrieval}))
        list(ref), list(out)
        assert out.output_ids == ref.output_ids


# The evospec sampling distribution (the first two tokens against the target's exact joint, with its negative
# control) is a case of tests/unit/test_engine_sampling.py.


def test_unconfirmed_buffer_ids_are_penalized_until_the_target_confirms_them(pair):
    target, draft = pair
    static = torch.arange(0, 48)
    policy = EvoSpecPolicy(draft.head_weight, static, EvoSpecSettings(dynamic_size=4, use_semantic=False,
                                                                      unconfirmed_bias=-3.0, update_lag=0))
    session = policy.new_session([60, 61, 60, 5])  # long-tail 60, 61 come from the prompt: guessed, not confirmed
    slots = {c.token_id: c.slot for c in session.initial_changes}
    assert set(slots) == {60, 61}
    assert all(session.active.dynamic_bias[s] == -3.0 for s in slots.values())
    session.observe(VerifyResult([], [], 61), None)  # the target generated 61
    assert session.active.dynamic_bias[slots[61]] == 0.0 and session.active.dynamic_bias[slots[60]] == -3.0
    hidden = torch.randn(2, draft.head_weight.shape[1])
    logits = session.active.logits(hidden)
    raw = hidden @ draft.head_weight[60]
    assert torch.allclose(logits[:, 48 + slots[60]], raw - 3.0, atol=1e-5)


def observations(steps: int, seed: int = 0) -> list[tuple[VerifyResult, TargetFeedback]]:
    """A random stream of verified steps over the 96-token pair, with target-fed candidates."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        tokens = [rng.randrange(2, 96) for _ in range(rng.randrange(1, 4))]
        cands = {rng.randrange(2, 96): TARGET_PRIORITY + rng.random() for _ in range(2)}
        out.append((VerifyResult(list(range(len(tokens) - 1)), tokens[:-1], tokens[-1]), TargetFeedback(1, 3, cands)))
    return out


def test_deferred_updates_are_the_same_updates_one_step_later(pair):
    """update_lag 1 computes each step's update on the worker and applies it at the next step: exactly the changes
    (slots, ids, biases) that update_lag 0 applies at once, one observe call later."""
    _, draft = pair
    static = torch.arange(0, 48)
    sessions = {lag: EvoSpecPolicy(draft.head_weight, static, EvoSpecSettings(dynamic_size=8, update_lag=lag,
                                                                               semantic_every=3)).new_session([60, 70])
                for lag in (0, 1)}
    assert sessions[0].initial_changes == sessions[1].initial_changes  # the prompt's fill is applied before drafting
    now, later = [], []
    for result, feedback in observations(40):
        now.append((sessions[0].observe(result, feedback), sessions[0].active.dynamic_bias.clone()))
        later.append((sessions[1].observe(result, feedback), sessions[1].active.dynamic_bias.clone()))
    assert later[0][0] == [] and any(changes for changes, _ in now)
    for (changes_now, bias_now), (changes_later, bias_later) in zip(now, later[1:]):
        assert changes_now == changes_later and torch.equal(bias_now, bias_later)


def test_buffer_hits_are_counted_by_the_source_that_put_the_id_there(pair):
    """The target counts a hit for each committed token that was in D when drafted, by the source of that id (the
    same function counts misses, against the same A)."""
    _, draft = pair
    static = torch.arange(0, 48)
    policy = EvoSpecPolicy(draft.head_weight, static, EvoSpecSettings(dynamic_size=8, use_semantic=False,
                                                                      update_lag=0))
    session = policy.new_session([5, 60])  # 60 ∉ S in the prompt: statistical
    assert session.source_of == {60: "statistical"}
    stats = SpecStats()

    def step(accepted: list[int], bonus: int, candidates: dict[int, float] | None = None) -> None:
        result = VerifyResult(list(range(len(accepted))), accepted, bonus)
        logits = torch.zeros(len(result.committed_tokens), 96)
        fb, = feedbacks_for([FeedbackRequest(VerifiedStep(result, logits), session.in_active(), True, stats,
                                             session.source_of)])
        session.observe(result, TargetFeedback(fb.misses, fb.positions, candidates or fb.candidates))
    step([], 70)  # 70 ∉ A: a miss, and a target-fed candidate
    assert session.source_of[70] == "target" and (stats.misses, stats.buffer_hits) == (1, 0)
    step([60, 70], 7)  # both in D when drafted
    step([70], 80)  # 70 again; 80 was not in D: a miss
    assert (stats.buffer_hits_statistical, stats.buffer_hits_semantic, stats.buffer_hits_target) == (1, 0, 2)
    assert stats.misses == 2 and stats.verified_positions == 6


def test_deferred_updates_keep_greedy_identical_and_count_hits(pair):
    dec = evo_decoder(pair, static=24)
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    spec = SpecParams(method="evospec", vocab={"static_size": 24, "dynamic_size": 8})
    ref = dec.generate([3, 60, 61, 62], sampling, SpecParams(method="ar"))
    out = dec.generate([3, 60, 61, 62], sampling, spec)
    list(ref), list(out)
    assert dec.policies.evospec.update_lag == 1 and out.output_ids == ref.output_ids
    assert out.stats.buffer_hits > 0
    assert out.stats.buffer_hits == sum(out.stats.as_dict()[f"buffer_hits_{s}"] for s in SOURCES)
