"""Statistical losslessness of stochastic verification: the committed tokens follow the target distribution.

Chi-square goodness of fit over seeded samples on a tiny vocabulary (10k in CI, 20k nightly: `samples`), for chain
and tree drafts drawn without replacement from the draft distribution actually used, T in {0.7, 1.0}, with top-p. A
negative control (a verifier that skips the residual correction) must fail the same test at the same count, so the
test can fail.
"""
import numpy as np
import pytest
import torch

from evospec.config import SamplingParams
from evospec.sampling import logits_to_probs, sample_without_replacement
from evospec.testing import chi_square_p, samples
from evospec.tree import DraftTree
from evospec.verify import verify_on_device, verify_stochastic

VOCAB = 6
FULL_SAMPLES = 20_000


def make_logits(gen):
    """Target and draft logits for the root and for every token as a parent (depth-2 contexts)."""
    target = torch.randn(1 + VOCAB, VOCAB, generator=gen) * 1.5
    draft = target + torch.randn(1 + VOCAB, VOCAB, generator=gen)  # correlated, not equal
    return target, draft


def draft_tree(draft_probs_rows, branching, depth2_branching, gen):
    """Root children: `branching` tokens without replacement; each gets `depth2_branching` children."""
    tokens, parents, probs = [], [], {}
    probs[-1] = draft_probs_rows[0]
    for tok in sample_without_replacement(draft_probs_rows[0], branching, gen).tolist():
        tokens.append(tok)
        parents.append(-1)
    for node in range(len(tokens)):
        probs[node] = draft_probs_rows[1 + tokens[node]]
        for tok in sample_without_replacement(probs[node], depth2_branching, gen).tolist():
            tokens.append(tok)
            parents.append(node)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), probs, torch.arange(VOCAB))


def sample_two_tokens(target_probs_rows, draft_probs_rows, branching, depth2, seed, verifier=verify_stochastic,
                      full_samples=FULL_SAMPLES):
    """Counts of (first, second) committed tokens; the second only when the first was an accepted node."""
    gen = torch.Generator().manual_seed(seed)
    first = np.zeros(VOCAB)
    second = np.zeros((VOCAB, VOCAB))
    for _ in range(samples(full_samples)):
        tree = draft_tree(draft_probs_rows, branching, depth2, gen)
        rows = torch.stack([target_probs_rows[0]] + [target_probs_rows[1 + t] for t in tree.token_ids.tolist()])
        result = verifier(tree, rows, gen)
        committed = result.committed_tokens
        first[committed[0]] += 1
        if len(committed) >= 2:
            second[committed[0], committed[1]] += 1
    return first, second


CASES = [  # (name, branching at root, branching at depth 2, sampling)
    ("chain-T1", 1, 1, SamplingParams(temperature=1.0)),
    ("chain-T0.7-topp", 1, 1, SamplingParams(temperature=0.7, top_p=0.8)),
    ("tree-T1", 3, 2, SamplingParams(temperature=1.0)),
    ("tree-T0.7-topp", 3, 2, SamplingParams(temperature=0.7, top_p=0.9)),
    ("tree-T1-topk", 2, 2, SamplingParams(temperature=1.0, top_k=4)),
]


@pytest.mark.parametrize("name,branching,depth2,sampling", CASES, ids=[c[0] for c in CASES])
def test_committed_tokens_follow_target(name, branching, depth2, sampling):
    gen = torch.Generator().manual_seed(11)
    target_logits, draft_logits = make_logits(gen)
    target_probs = logits_to_probs(target_logits, sampling)
    draft_probs = logits_to_probs(draft_logits, sampling)
    first, second = sample_two_tokens(target_probs, draft_probs, branching, depth2, seed=1)
    assert chi_square_p(first, target_probs[0].numpy()) > 1e-3
    # given the first token came from an accepted node x, the second follows the target's p(. | x)
    for x in range(VOCAB):
        if second[x].sum() >= 500:
            assert chi_square_p(second[x], target_probs[1 + x].numpy()) > 1e-3, f"second token after {x}"


def batch_verifier(tree, target_probs, generator):
    """The batch-first (GPU) verifier on a batch of one (logits whose softmax is the processed distribution)."""
    return verify_on_device([tree], target_probs.log(), [SamplingParams(temperature=1.0)], [generator])[0]


def test_batch_verification_follows_target():
    """The tree case with top-p, through `verify_on_device` (5k samples: the batch costs more per call on one tree)."""
    _, branching, depth2, sampling = CASES[3]
    gen = torch.Generator().manual_seed(11)
    target_logits, draft_logits = make_logits(gen)
    target_probs = logits_to_probs(target_logits, sampling)
    draft_probs = logits_to_probs(draft_logits, sampling)
    first, second = sample_two_tokens(target_probs, draft_probs, branching, depth2, seed=2, verifier=batch_verifier,
                                      full_samples=FULL_SAMPLES // 4)
    assert chi_square_p(first, target_probs[0].numpy()) > 1e-3
    for x in range(VOCAB):
        if second[x].sum() >= 500:
            assert chi_square_p(second[x], target_probs[1 + x].numpy()) > 1e-3, f"second token after {x}"


def biased_verifier(tree, target_probs, generator):
    """Wrong on purpose: accepts by min(1, p/q) but draws the bonus from p, not from the residual."""
    from evospec.verify import VerifyResult
    children = tree.children().get(-1, [])
    q = tree.draft_probs[-1]
    for c in children:
        x = int(tree.token_ids[c])
        if torch.rand((), generator=generator).item() * q[x].item() < target_probs[0, x].item():
            return VerifyResult([c], [x], int(torch.multinomial(target_probs[1 + c], 1, generator=generator)))
    return VerifyResult([], [], int(torch.multinomial(target_probs[0], 1, generator=generator)))


@pytest.mark.parametrize("full_samples", [FULL_SAMPLES, FULL_SAMPLES // 4], ids=["per-tree", "batch"])
def test_negative_control_is_detected(full_samples):
    """At each count the tests above run (the batch verifier's is smaller), the biased verifier is rejected."""
    gen = torch.Generator().manual_seed(11)
    target_logits, draft_logits = make_logits(gen)
    sampling = SamplingParams(temperature=1.0)
    first, _ = sample_two_tokens(logits_to_probs(target_logits, sampling), logits_to_probs(draft_logits, sampling),
                                 1, 1, seed=1, verifier=biased_verifier, full_samples=full_samples)
    assert chi_square_p(first, logits_to_probs(target_logits, sampling)[0].numpy()) < 1e-6


def test_seeded_verification_is_deterministic():
    gen = torch.Generator().manual_seed(11)
    target_logits, draft_logits = make_logits(gen)
    s = SamplingParams(temperature=1.0)
    tp, dp = logits_to_probs(target_logits, s), logits_to_probs(draft_logits, s)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(50):
            tree = draft_tree(dp, 3, 2, g)
            rows = torch.stack([tp[0]] + [tp[1 + t] for t in tree.token_ids.tolist()])
            out.append(verify_stochastic(tree, rows, g).committed_tokens)
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.65))
    assert (probs[0] > 0).tolist() == [False, False, True, True]
    assert probs[0, 3].item() == pytest.approx(0.4 / 0.7)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert probs[0].tolist() == [0.0, 0.0, 0.0, 1.0]


def full_sort_nucleus_probs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by its definition: sort every token, drop one when the mass strictly before it reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf")).softmax(-1)


@pytest.mark.parametrize("scale, top_p", [(4.0, 0.9), (1.0, 0.5), (0.05, 0.99), (0.01, 0.9), (8.0, 0.999)])
def test_top_p_ranks_few_candidates_and_keeps_the_full_sort_s_nucleus(scale, top_p, monkeypatch):
    """Peaked rows settle within the first candidates; flat ones (scale 0.05, 0.01: a nucleus of thousands) make the
    candidates grow to the whole vocabulary. Either way the kept tokens and their probabilities are the full sort's."""
    from evospec import sampling
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 16)
    generator = torch.Generator().manual_seed(int(100 * top_p))
    logits = torch.randn(3, 5000, generator=generator) * scale
    logits[1, :10] += 6.0  # one row with a handful of likely tokens
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    expected = full_sort_nucleus_probs(logits, top_p)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)
    assert (probs > 0).sum(-1).min() >= 1
