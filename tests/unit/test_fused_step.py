"""The native decoder step (kernels/fused_step.py, kquant.c layer_forward): the same hidden states as torch's layers
up to float rounding, bitwise row-invariant (a verify row, a tree row, a row packed beside another sequence's: the
decode of its token), used only where it applies."""
import pytest
import torch

from evospec.kernels.fused_step import FusedStep
from evospec.kernels.kquant import available
from evospec.kernels.tree import chain_then_tree_mask
from evospec.model.qwen3 import ROW_INVARIANT_MAX_ROWS, Qwen3Config, Segment
from evospec.testing import random_qwen3

pytestmark = pytest.mark.skipif(not available(), reason="the k-quant kernel needs AVX2 and gcc")


def _config(qwen3: bool, hidden: int = 256) -> Qwen3Config:
    return Qwen3Config(vocab_size=512, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=not qwen3,
                       qk_norm=qwen3, tie_word_embeddings=False)


def _gguf(cfg: Qwen3Config, verifies: bool = True, dtype: torch.dtype = torch.float32):
    from evospec.model.weight_formats import apply_weight_format
    return apply_weight_format(random_qwen3(cfg, seed=6, dtype=dtype), "gguf", None, verifies=verifies)


def _prefill_then_verify(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    cache = model.new_cache(len(ids) + 4)
    first = model(ids[:prefix], torch.arange(prefix), cache, chain_then_tree_mask(0, prefix, None))
    cache.advance(prefix)
    rest = len(ids) - prefix
    return torch.cat([first, model(ids[prefix:], torch.arange(prefix, len(ids)), cache,
                                   chain_then_tree_mask(prefix, rest, None))])


@pytest.mark.parametrize("qwen3", [False, True], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("verifies", [True, False], ids=["target", "draft"])
def test_the_native_step_computes_what_torch_layers_compute(qwen3, verifies):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms), fused maps (a target) and separate ones (a draft): the final
    hidden states of a prefill and a verify equal torch's layers' over the same weights up to float rounding."""
    model = _gguf(_config(qwen3), verifies)
    assert isinstance(model.fused_step, FusedStep)
    assert (model.layers[0].self_attn.qkv_proj is not None) == verifies
    ids = torch.randint(0, 512, (14,), generator=torch.Generator().manual_seed(1))
    native = _prefill_then_verify(model, ids, 8)
    model.fused_step = None
    torch_layers = _prefill_then_verify(model, ids, 8)
    assert torch.allclose(native, torch_layers, rtol=1e-4, atol=1e-4), (native - torch_layers).abs().max()


def test_tree_rows_and_packed_rows_are_bitwise_their_decodes():
    """A tree verify (rows attending scattered ancestors) packed beside another sequence's decode: each tree row is
    bitwise the 1-token decode of its token after its ancestors, and the other sequence's row is bitwise its decode
    alone."""
    model = _gguf(_config(True))
    gen = torch.Generator().manual_seed(3)
    prompt, other = torch.randint(0, 512, (9,), generator=gen), torch.randint(0, 512, (6,), generator=gen)
    # a tree under the prompt's last token: 0 -> 1 -> 3 and 0 -> 2 (parents), ids [4]
    parents, tree_ids = [-1, 0, 0, 1], torch.randint(0, 512, (4,), generator=gen)
    cache, other_cache = model.new_cache(20), model.new_cache(12)
    for c, ids in ((cache, prompt), (other_cache, other[:-1])):
        model(ids, torch.arange(len(ids)), c, chain_then_tree_mask(0, len(ids), None))
        c.advance(len(ids))
    depths = [0, 1, 1, 2]
    tree = Segment(cache, tree_ids, torch.tensor([9 + d for d in depths]),
                   chain_then_tree_mask(9, 0, torch.tensor(parents)), 9)
    beside = Segment.chain(other_cache, [int(other[-1])])
    packed = model.forward_packed([tree, beside])
    alone = model.forward_packed([Segment.chain(other_cache, [int(other[-1])])])
    assert torch.equal(packed[4], alone[0])
    for node, path in ((1, [0, 1]), (3, [0, 1, 3]), (2, [0, 2])):  # decode each node after its ancestors
        fresh = model.new_cache(20)
        model(prompt, torch.arange(9), fresh, chain_then_tree_mask(0, 9, None))
        fresh.advance(9)
        for step in path:
            hidden = model.forward_packed([Segment.chain(fresh, [int(tree_ids[step])])])
            fresh.advance(1)
        assert torch.equal(hidden[0], packed[node]), node


def test_a_decode_packed_beside_a_long_prefill_is_bitwise_its_decode_alone():
    """A forward mixing a decode (native step) and a prefill chunk longer than ROW_INVARIANT_MAX_ROWS (torch's
    layers) runs them as two forwards: the decode's row is bitwise what it is alone, the chunk's rows what they are
    alone."""
    model = _gguf(_config(True))
    gen = torch.Generator().manual_seed(5)
    n = ROW_INVARIANT_MAX_ROWS + 3
    long_ids, prompt = torch.randint(0, 512, (n,), generator=gen), torch.randint(0, 512, (41,), generator=gen)
    cache = model.new_cache(48)
    model(prompt[:-1], torch.arange(40), cache, chain_then_tree_mask(0, 40, None))
    cache.advance(40)
    alone_chunk = model.forward_packed([Segment.chain(model.new_cache(n), long_ids.tolist())])
    alone_decode = model.forward_packed([Segment.chain(cache, [int(prompt[-1])])])
    packed = model.forward_packed([Segment.chain(cache, [int(prompt[-1])]),
                                   Segment.chain(model.new_cache(n), long_ids.tolist())])
    assert torch.equal(packed[0], alone_decode[0]) and torch.equal(packed[1:], alone_chunk)


def test_where_the_native_step_does_not_run(monkeypatch):
    """Not for a segment longer than ROW_INVARIANT_MAX_ROWS (a prefill chunk: torch's SDPA), not in bf16, not after
    LoRA wraps the maps (the adapters run in torch)."""
    from evospec.adapt.lora import install_lora
    model = _gguf(_config(True))
    calls = []
    monkeypatch.setattr(FusedStep, "run", lambda self, x, *a: calls.append(len(x)) or x)
    n = ROW_INVARIANT_MAX_ROWS + 1
    model(torch.zeros(n, dtype=torch.long), torch.arange(n), model.new_cache(n), chain_then_tree_mask(0, n, None))
    model(torch.zeros(3, dtype=torch.long), torch.arange(3), model.new_cache(3), chain_then_tree_mask(0, 3, None))
    assert calls == [3]
    assert _gguf(_config(True), dtype=torch.bfloat16).fused_step is None
    draft = _gguf(_config(True), verifies=False)
    assert draft.fused_step is not None
    install_lora(draft, ("q_proj", "down_proj"))
    assert draft.fused_step is None


def test_gguf_under_dtype_auto_runs_in_float32_with_the_native_step():
    """A model loaded in bf16 under `dtype: auto` (a bf16-native CPU) that ends in gguf is put in float32, where the
    native step runs; an explicit bf16 keeps bf16 and torch's layers."""
    from evospec.model.weight_formats import apply_weight_format
    auto = apply_weight_format(random_qwen3(_config(True), seed=6, dtype=torch.bfloat16), "gguf", None,
                               dtype_auto=True)
    assert auto.embed_tokens.weight.dtype == torch.float32 and auto.fused_step is not None
    explicit = apply_weight_format(random_qwen3(_config(True), seed=6, dtype=torch.bfloat16), "gguf", None)
    assert explicit.embed_tokens.weight.dtype == torch.bfloat16 and explicit.fused_step is None
