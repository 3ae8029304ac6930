"""Greedy speculative output == target-only greedy output, token for token (chain and tree, many prompts), with each
implementation of batched verification (the `verification` fixture)."""
import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.testing import random_pair

TREES = [TreeParams(shape="chain", num_draft_tokens=1), TreeParams(shape="chain", num_draft_tokens=5),
         TreeParams(shape="tree", depth=4, branching=3, budget=10), TreeParams(shape="tree", depth=6, branching=2, budget=40)]


def run(decoder, prompt, sampling, spec):
    gen = decoder.generate(prompt, sampling, spec)
    chunks = [c.token_ids for c in gen]
    assert sum(chunks, []) == gen.output_ids
    return gen


@pytest.fixture(scope="module")
def decoder():
    target, draft = random_pair(vocab=96, seed=3, eos=1)
    static = torch.arange(96).flip(0)  # a full-size "static" ranking, so frspec here equals sd in reach
    return SpeculativeDecoder(target, draft, static_ids=static)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"{t.shape}-{t.max_nodes}")
@pytest.mark.parametrize("prompt_len", [1, 2, 7, 30])
def test_greedy_identical(decoder, tree, prompt_len, verification):
    prompt = [(7 * i + 3) % 95 + 1 for i in range(prompt_len)]
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = run(decoder, prompt, sampling, SpecParams(method="ar"))
    spec = run(decoder, prompt, sampling, SpecParams(method="sd", tree=tree))
    assert spec.output_ids == ref.output_ids
    assert len(ref.output_ids) == 40 and spec.finish_reason == "length"
    assert spec.stats.steps < ref.stats.steps  # the draft helped at least once
    assert ref.stats.steps == 40 and ref.stats.tau == 1.0


def test_frspec_restricted_vocab_still_identical(decoder, verification):
    target, draft = random_pair(vocab=96, seed=3, eos=1)
    static = torch.arange(0, 96, 2)  # half the vocabulary: many target tokens are misses
    dec = SpeculativeDecoder(target, draft, static_ids=static)
    sampling = SamplingParams(max_tokens=50, ignore_eos=True)
    ref = run(dec, [5, 9, 13], sampling, SpecParams(method="ar"))
    for tree in TREES:
        out = run(dec, [5, 9, 13], sampling, SpecParams(method="frspec", tree=tree, vocab={"static_size": 48}))
        assert out.output_ids == ref.output_ids
        assert all(t % 2 == 0 for t in _accepted_tokens(dec, [5, 9, 13], sampling, tree))


def _accepted_tokens(dec, prompt, sampling, tree):
    """Every token the frspec draft proposed lies in S (even ids)."""
    gen = dec.generate(prompt, sampling, SpecParams(method="frspec", tree=tree, vocab={"static_size": 48}))
    seen = []
    orig = dec.draft.propose

    def spy(session):
        t = orig(session)
        seen.extend(t.token_ids.tolist())
        return t
    dec.draft.propose = spy
    try:
        list(gen)
    finally:
        dec.draft.propose = orig
    return seen


@pytest.mark.parametrize("tree", TREES[1:3], ids=["chain", "tree"])
def test_eos_and_max_tokens_inside_accepted_path(tree):
    """Pick an EOS that the target emits mid-generation; stop exactly where target-only decoding stops."""
    target, draft = random_pair(vocab=96, seed=5, eos=1)
    probe = SpeculativeDecoder(target, draft)
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    free_run = run(probe, [4, 8], sampling, SpecParams(method="ar")).output_ids
    eos = free_run[12]
    first = free_run.index(eos)
    dec = SpeculativeDecoder(target, draft, eos_ids=(eos,))
    for max_tokens in (first, first + 1, first + 5, 3):
        sampling = SamplingParams(max_tokens=max_tokens)
        ref = run(dec, [4, 8], sampling, SpecParams(method="ar"))
        out = run(dec, [4, 8], sampling, SpecParams(method="sd", tree=tree))
        assert out.output_ids == ref.output_ids
        assert out.finish_reason == ref.finish_reason
        expected = "stop" if max_tokens > first else "length"
        assert out.finish_reason == expected
        assert len(out.output_ids) == min(first, max_tokens)


def _tree_speculation_matches_ar(decoder, method: str) -> SpecParams:
    """`method` with a small tree and a 48-token static vocabulary over a quantized draft: greedy output equal to
    `ar`'s, some draft tokens accepted. Returns the spec it ran."""
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = SpecParams(method=method, tree=TreeParams(shape="tree", depth=3, branching=2, budget=6),
                      vocab={"static_size": 48, "dynamic_size": 8})
    ref = run(decoder, [4, 9, 16], sampling, SpecParams(method="ar"))
    out = run(decoder, [4, 9, 16], sampling, spec)
    assert out.output_ids == ref.output_ids and out.stats.accepted > 0
    return spec


@pytest.mark.parametrize("method", ["sd", "frspec", "evospec"])
def test_int8_draft_is_lossless(method):
    """A dynamically quantized (int8) draft proposes different trees, never different output."""
    import copy

    from evospec.model import quantize_int8
    target, draft = random_pair(vocab=96, seed=3, eos=1)
    int8_draft = quantize_int8(copy.deepcopy(draft))
    assert int8_draft.layers[0].mlp.up_proj.__class__.__name__ == "Linear" and hasattr(
        int8_draft.layers[0].mlp.up_proj, "_packed_params")  # really quantized
    _tree_speculation_matches_ar(SpeculativeDecoder(target, int8_draft, static_ids=torch.arange(96).flip(0)), method)


@pytest.mark.parametrize("method", ["frspec", "evospec"])
def test_gguf_draft_with_a_quantized_static_head_is_lossless(method):
    """A draft in format gguf (its 32-wide maps in Q5_0, its head in Q8_0) whose static vocabulary reads the quantized
    head's rows proposes different trees, never different output."""
    import copy

    from evospec.kernels import kquant
    from evospec.model.weight_formats import apply_weight_format
    if not kquant.available():
        pytest.skip("the k-quant kernel needs AVX2 and gcc")
    target, draft = random_pair(vocab=96, seed=3, eos=1)
    gguf_draft = apply_weight_format(copy.deepcopy(draft), "gguf", None, verifies=False)
    assert gguf_draft.layers[0].mlp.up_proj.kinds == ["q5_0"] and gguf_draft.head.kinds == ["q8_0"]
    decoder = SpeculativeDecoder(target, gguf_draft, static_ids=torch.arange(96).flip(0))
    spec = _tree_speculation_matches_ar(decoder, method)
    static_rows = decoder.policies.get(spec).new_session([4, 9, 16]).active.static_rows
    assert isinstance(static_rows, kquant.KQuantLinear)  # the quantized head's rows, not dense ones


def test_int8_needs_float32_on_cpu():
    from evospec.config import ModelConfig
    with pytest.raises(ValueError, match="float32"):
        ModelConfig(dtype="bfloat16", quantize="int8")
    assert ModelConfig(quantize="int8").dtype == "auto"


@pytest.mark.parametrize("weight_format", ["int8-weight-only", "int4-weight-only", "int8-per-token", "gguf"])
def test_greedy_identical_in_bf16_weight_formats(weight_format, verification):
    """bf16 (logits rounded coarsely, so near-ties are common): a target in a row-invariant weight format, verifying
    chains and trees, gives ar's tokens exactly over many prompts (kernels/quantized.py, attend_row_by_row)."""
    from evospec.model.weight_formats import apply_weight_format
    # gguf's blocks take whole super-blocks of 256 inputs (narrower maps fall back to int8)
    target, draft = random_pair(vocab=256, seed=11, eos=1, hidden=256 if weight_format == "gguf" else 128,
                                target_layers=3)
    target = apply_weight_format(target.to(torch.bfloat16), weight_format, None)
    decoder = SpeculativeDecoder(target, draft, static_ids=torch.arange(256))
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    helped = 0
    for seed in range(6):
        prompt = torch.randint(2, 256, (5 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = run(decoder, prompt, sampling, SpecParams(method="ar"))
        for tree in TREES[1:3]:
            spec = run(decoder, prompt, sampling, SpecParams(method="sd", tree=tree))
            assert spec.output_ids == ref.output_ids, (seed, tree)
            helped += spec.stats.steps < ref.stats.steps
    assert helped  # the draft was accepted somewhere: verify forwards of several rows really ran
