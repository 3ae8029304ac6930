"""Our runner matches transformers (fp32) for prefill, decode and tree forward, for both architectures it serves:
Qwen3 (q/k norm, tied head) and Qwen2 (q/k/v biases, untied head), and greedy decoding is token-identical."""
import json

import pytest
import torch

from evospec.kernels.tree import chain_then_tree_mask, chain_then_tree_positions
from evospec.model import load_qwen3

transformers = pytest.importorskip("transformers")


SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0)


def tiny_hf(arch: str):
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False))


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def hf_and_ours(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = tiny_hf(request.param).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))  # non-trivial norms and biases too
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == request.param
    assert config["tie_word_embeddings"] == (request.param == "qwen3")
    ours = load_qwen3(folder)
    if request.param == "qwen2":  # the architecture differences are really exercised
        attn = ours.layers[0].self_attn
        assert attn.q_proj.bias is not None and ours.lm_head is not None
        assert torch.equal(ours.head_weight, hf.lm_head.weight) and not torch.equal(ours.head_weight,
                                                                                   hf.model.embed_tokens.weight)
    return hf, ours


def test_greedy_decoding_is_identical(hf_and_ours):
    """Our plain step loop (`ar`) and transformers' greedy generate produce the same tokens."""
    from evospec.config import SamplingParams, SpecParams
    from evospec.engine.generate import SpeculativeDecoder
    hf, ours = hf_and_ours
    prompt = [5, 17, 3, 99, 42]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    gen = SpeculativeDecoder(ours, eos_ids=(-1,)).generate(prompt, SamplingParams(max_tokens=24),
                                                          SpecParams(method="ar"))
    list(gen)
    assert gen.output_ids == ref


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode_match(hf_and_ours):
    hf, ours = hf_and_ours
    ids = [5, 17, 3, 99, 42, 7, 64, 1]
    ref = hf_logits(hf, ids)
    cache = ours.new_cache(32)
    h = ours(torch.tensor(ids[:5]), torch.arange(5), cache, chain_then_tree_mask(0, 5, None))
    cache.advance(5)
    torch.testing.assert_close(ours.full_logits(h), ref[:5], atol=1e-4, rtol=1e-4)
    for pos in range(5, len(ids)):  # one token at a time against the cache
        h = ours(torch.tensor([ids[pos]]), torch.tensor([pos]), cache, chain_then_tree_mask(pos, 1, None))
        cache.advance(1)
        torch.testing.assert_close(ours.full_logits(h)[0], ref[pos], atol=1e-4, rtol=1e-4)


def test_tree_forward_matches_each_branch(hf_and_ours):
    hf, ours = hf_and_ours
    prefix = [11, 22, 33, 44]
    # tree: 0:a, 1:b (root children); 2: child of 0; 3: child of 2; 4: child of 1
    tokens = [50, 60, 70, 80, 90]
    parents = torch.tensor([-1, -1, 0, 2, 1])
    cache = ours.new_cache(32)
    ours(torch.tensor(prefix[:-1]), torch.arange(3), cache, chain_then_tree_mask(0, 3, None))
    cache.advance(3)
    ids = torch.tensor([prefix[-1]] + tokens)
    h = ours(ids, chain_then_tree_positions(3, 1, parents), cache, chain_then_tree_mask(3, 1, parents))
    logits = ours.full_logits(h)
    branches = {0: [50], 1: [60], 2: [50, 70], 3: [50, 70, 80], 4: [60, 90]}
    for node, path in branches.items():
        ref = hf_logits(hf, prefix + path)[-1]
        torch.testing.assert_close(logits[1 + node], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], hf_logits(hf, prefix)[-1], atol=1e-4, rtol=1e-4)


def test_commit_path_then_continue_matches(hf_and_ours):
    """Compacting the accepted tree path's K/V gives the same cache as decoding that path directly."""
    hf, ours = hf_and_ours
    prefix = [11, 22, 33, 44]
    parents = torch.tensor([-1, -1, 0, 1, 3])
    tokens = [50, 60, 70, 80, 90]
    cache = ours.new_cache(32)
    ours(torch.tensor(prefix[:-1]), torch.arange(3), cache, chain_then_tree_mask(0, 3, None))
    cache.advance(3)
    ids = torch.tensor([prefix[-1]] + tokens)
    ours(ids, chain_then_tree_positions(3, 1, parents), cache, chain_then_tree_mask(3, 1, parents))
    cache.commit([3, 3 + 1 + 1, 3 + 1 + 3])  # pending 44, node 1 (60), node 3 (80): path 60 -> 80
    assert cache.length == 6
    h = ours(torch.tensor([90]), torch.tensor([6]), cache, chain_then_tree_mask(6, 1, None))
    ref = hf_logits(hf, prefix + [60, 80, 90])[-1]
    torch.testing.assert_close(ours.full_logits(h)[0], ref, atol=1e-4, rtol=1e-4)


def test_bf16_load_and_forward_runs(hf_and_ours, tmp_path):
    hf, _ = hf_and_ours
    hf.save_pretrained(tmp_path)
    model = load_qwen3(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    cache = model.new_cache(8)
    h = model(torch.tensor([1, 2, 3]), torch.arange(3), cache, chain_then_tree_mask(0, 3, None))
    ref = hf_logits(hf, [1, 2, 3])
    assert (model.full_logits(h).argmax(-1) == ref.argmax(-1)).float().mean() >= 2 / 3


def test_single_token_padding_changes_nothing(hf_and_ours):
    """The padded 1-token path (chosen when a 2-row matmul is faster) gives the same logits and greedy tokens."""
    from evospec.config import SamplingParams, SpecParams
    from evospec.engine.generate import SpeculativeDecoder
    _, ours = hf_and_ours
    runs = {}
    for pad in (False, True):
        ours.pad_single_token = pad
        gen = SpeculativeDecoder(ours, eos_ids=(-1,)).generate([5, 17, 3], SamplingParams(max_tokens=20),
                                                              SpecParams(method="ar"))
        list(gen)
        cache = ours.new_cache(8)
        ours(torch.tensor([5, 17]), torch.arange(2), cache, chain_then_tree_mask(0, 2, None))
        cache.advance(2)
        h = ours(torch.tensor([3]), torch.tensor([2]), cache, chain_then_tree_mask(2, 1, None))
        runs[pad] = (gen.output_ids, ours.full_logits(h))
    ours.pad_single_token = False
    assert runs[True][0] == runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=1e-5, rtol=1e-5)
