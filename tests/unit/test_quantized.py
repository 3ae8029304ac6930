"""Weight formats (kernels/quantized.py, evospec/model/weight_formats.py): each kernel the machine may choose is
row-invariant (k rows give bitwise the rows one at a time give), so a verify forward's logits are bitwise the 1-token
decodes'; quantization error is that of its bits; `auto` and bad formats behave as documented."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from evospec.bench.batch_invariance import forward_invariance
from evospec.config import ModelConfig
from evospec.kernels.quantized import (Int4WeightLinear, Int8PerTokenLinear, Int8WeightLinear, int4_supported,
                                       quantized_linear)
from evospec.model.weight_formats import (ROW_INVARIANT, WeightFormatError, apply_weight_format, check_runs_here,
                                          format_seconds, projection_shapes, quantize_weights)
from evospec.testing import random_qwen3, tiny_config

# The real pair's projection shapes (Qwen2.5-Coder-1.5B and 0.5B), a head slice, the tiny pair's, and the 1.5B's fused
# q/k/v and gate/up.
SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (4096, 1536), (896, 896), (128, 896), (4864, 896),
          (896, 4864), (256, 128), (128, 256), (2048, 1536), (17920, 1536)]  # the last two: the target's fused maps
KERNELS = {"int8": Int8WeightLinear, "int4": Int4WeightLinear, "int8-per-token": Int8PerTokenLinear}


def _layer(out_features: int, in_features: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(out_features * 7 + in_features)
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight, std=in_features ** -0.5)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_kernel_rows_are_computed_independently(shape, kernel, dtype):
    out_features, in_features = shape
    if kernel == "int4" and not int4_supported(out_features, in_features):
        pytest.skip("the int4 kernel does not take this shape (quantized_linear gives it int8)")
    layer = KERNELS[kernel](_layer(out_features, in_features, bias=True).weight, torch.randn(out_features), dtype)
    x = torch.randn(16, in_features, dtype=dtype)
    one_at_a_time = torch.cat([layer(x[i:i + 1]) for i in range(16)])
    for k in (2, 3, 5, 8, 16):
        assert torch.equal(layer(x[:k]), one_at_a_time[:k]), f"{k} rows round differently from 1"


@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.08)])
@torch.no_grad()
def test_quantization_error_is_that_of_its_bits(bits, bound):
    layer = _layer(512, 1024, bias=True)
    quantized = quantized_linear(layer, bits, torch.float32)
    x = torch.randn(4, 1024)
    exact = layer(x)
    error = float((quantized(x) - exact).norm() / exact.norm())
    assert 0 < error < bound
    dense = quantized.dequantized()  # what the kernel multiplies by, for LoRA's backward
    assert torch.allclose(x @ dense.T + layer.bias, quantized(x), atol=1e-3, rtol=1e-3)


@torch.no_grad()
def test_per_token_quantization_error_is_that_of_int8_on_both_operands():
    layer = _layer(512, 1024, bias=True)
    quantized = Int8PerTokenLinear(layer.weight, layer.bias, torch.float32)
    x = torch.randn(4, 1024)
    x[1] *= 1000  # one loud row: per-token scales keep the others' precision
    exact = layer(x)
    error = (quantized(x) - exact).norm(dim=1) / exact.norm(dim=1)
    assert bool((error > 0).all() and (error < 0.02).all()), error
    assert quantized(x).dtype == torch.float32
    assert Int8PerTokenLinear(layer.weight, None, torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_an_unsupported_int4_shape_gets_int8():
    assert isinstance(quantized_linear(_layer(24, 40), 4, torch.float32), Int8WeightLinear)
    with pytest.raises(ValueError, match="int4 weights need"):
        Int4WeightLinear(_layer(24, 40).weight, None, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("weight_format", ROW_INVARIANT)
@pytest.mark.parametrize("pad", [False, True], ids=["plain", "padded-single-token"])
def test_verify_logits_are_bitwise_the_decodes(weight_format, dtype, pad):
    """The whole forward (attention, norms, every projection, the head): k verify rows vs k 1-token decodes."""
    deltas = forward_invariance(dtype, layers=2, rows=(2, 5, 8), prefix=12, hidden=384, mlp=512, vocab=1024,
                                weight_format=weight_format, pad_single_token=pad)
    assert deltas == {2: 0.0, 5: 0.0, 8: 0.0}


def test_negative_control_dense_bf16_is_checked_by_the_same_measure():
    """The measure can fail: the quantization changes logits (same model, dense vs int4 differ)."""
    cfg = tiny_config(vocab=512, hidden=128, layers=2, eos=1)
    dense = random_qwen3(cfg, seed=3)
    quantized = apply_weight_format(random_qwen3(cfg, seed=3), "int4-weight-only", None)
    from evospec.kernels.tree import chain_then_tree_mask
    ids = torch.arange(6)
    logits = []
    for model in (dense, quantized):
        cache = model.new_cache(8)
        logits.append(model.full_logits(model(ids, torch.arange(6), cache, chain_then_tree_mask(0, 6, None))))
    assert not torch.equal(*logits)
    assert quantized.weight_format == "int4-weight-only" and dense.weight_format == "none"


def test_auto_keeps_the_embedded_pair_dense_and_measures_otherwise():
    cfg = tiny_config(vocab=512, hidden=128, layers=1, eos=1)
    assert apply_weight_format(random_qwen3(cfg, seed=0), "auto", None, embedded=True).weight_format == "none"
    model = apply_weight_format(random_qwen3(cfg, seed=0), "auto", None)
    # No GGUF source: int4 is not a candidate; auto times the int8 formats against dense and keeps the fastest.
    assert set(model.weight_format_seconds) == {"int8-weight-only", "int8-per-token", "none"}
    # The seconds are logged rounded, so two formats can tie there: the one kept is (one of) the fastest.
    chosen = model.weight_format
    assert model.weight_format_seconds[chosen] == min(model.weight_format_seconds.values())
    kernel = {"int8-weight-only": Int8WeightLinear, "int8-per-token": Int8PerTokenLinear, "none": nn.Linear}[chosen]
    assert type(model.layers[0].self_attn.o_proj) is kernel and (model.head is None) == (chosen == "none")


def test_format_seconds_counts_every_layer():
    cfg = tiny_config(vocab=512, hidden=128, layers=2, eos=1)
    assert len(projection_shapes(cfg)) == 7
    assert format_seconds(cfg, "int8-weight-only", torch.float32, repeats=1) > 0


def test_a_format_this_machine_cannot_run_fails_naming_the_field():
    with pytest.raises(WeightFormatError, match=r"model.quantize: int4-weight-only runs on the CPU only"):
        check_runs_here("int4-weight-only", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="runs on the CPU only"):
        ModelConfig(device="cuda:0", quantize="int8-weight-only")
    assert ModelConfig().quantize == "auto"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("weight_format", ROW_INVARIANT)
def test_tree_verify_rows_are_bitwise_the_decodes_of_their_paths(weight_format, dtype):
    """A tree verify (root + branching nodes, rows attending scattered ancestors) against `ar`: each node's logits
    equal those of decoding its path one token at a time after the same prefix."""
    from evospec.kernels.tree import chain_then_tree_mask, chain_then_tree_positions
    from evospec.model.qwen3 import Qwen3Config
    cfg = Qwen3Config(vocab_size=1024, hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=2, head_dim=32, attention_bias=True, qk_norm=False,
                      tie_word_embeddings=False)
    model = apply_weight_format(random_qwen3(cfg, seed=5, dtype=dtype), weight_format, None)
    prefix = torch.randint(0, 1024, (20,), generator=torch.Generator().manual_seed(2))
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 3, 5])  # a root's two children, then branches to depth 4
    tree_tokens = torch.randint(0, 1024, (8,), generator=torch.Generator().manual_seed(3))

    def prefilled():
        cache = model.new_cache(40)
        model(prefix[:-1], torch.arange(19), cache, chain_then_tree_mask(0, 19, None))
        cache.advance(19)
        return cache

    cache = prefilled()  # the verify: the last prefix token (the root) as a chain of 1, then the tree
    ids = torch.cat([prefix[-1:], tree_tokens])
    tree_logits = model.full_logits(model(ids, chain_then_tree_positions(19, 1, parents), cache,
                                          chain_then_tree_mask(19, 1, parents)))
    for node in range(8):
        path, at = [], node
        while at >= 0:
            path.insert(0, int(tree_tokens[at]))
            at = int(parents[at])
        cache = prefilled()
        for token in [int(prefix[-1])] + path:  # ar: one token per forward
            hidden = model(torch.tensor([token]), torch.tensor([cache.length]), cache,
                           chain_then_tree_mask(cache.length, 1, None))
            cache.advance(1)
        assert torch.equal(model.full_logits(hidden)[0], tree_logits[node + 1]), f"node {node}"


@pytest.mark.parametrize("weight_format", ["int8-weight-only", "int8-per-token"])
def test_fused_projections_compute_what_the_separate_ones_do(weight_format):
    """A target stacks q/k/v and gate/up into one map each (one kernel call, one activation quantization): the
    logits are bitwise those of the separate maps; a draft (verifies=False) keeps the separate maps."""
    from evospec.kernels.tree import chain_then_tree_mask
    cfg = tiny_config(vocab=512, hidden=128, layers=2, eos=1)
    fused = apply_weight_format(random_qwen3(cfg, seed=4, dtype=torch.bfloat16), weight_format, None)
    separate = quantize_weights(random_qwen3(cfg, seed=4, dtype=torch.bfloat16), weight_format, fuse=False)
    separate.row_invariant_attention = True
    draft = apply_weight_format(random_qwen3(cfg, seed=4, dtype=torch.bfloat16), weight_format, None, verifies=False)
    assert fused.layers[0].self_attn.qkv_proj is not None and not hasattr(fused.layers[0].self_attn, "q_proj")
    assert draft.layers[0].mlp.gate_up_proj is None and hasattr(draft.layers[0].mlp, "gate_proj")
    ids = torch.arange(7)
    logits = []
    for model in (fused, separate):
        cache = model.new_cache(8)
        logits.append(model.full_logits(model(ids, torch.arange(7), cache, chain_then_tree_mask(0, 7, None))))
    assert torch.equal(*logits)
