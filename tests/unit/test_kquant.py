"""The `gguf` weight format (kernels/kquant.py, kernels/kquant.c, model/weight_formats.py): GGUF Q4_K / Q6_K blocks
read as the gguf package reads them, products close to the dequantized weights', every output row computed on its
own (k rows give bitwise what 1 row gives, for the real pair's shapes), and a target in the format verifying with
the 1-token decodes' logits and ar's greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from evospec.kernels import kquant
from evospec.kernels.kquant import (
    KQuantLinear,
    q4k_from_dense,
    q4k_from_gguf,
    q5_0_from_dense,
    q5_0_from_gguf,
    q6k_from_dense,
    q6k_from_gguf,
    q8_0_from_dense,
    q8_0_from_gguf,
)

pytestmark = pytest.mark.skipif(not kquant.available(), reason="the k-quant kernel needs AVX2 and gcc")

# The real target's shapes (Qwen2.5-Coder-1.5B: q, k/v, o, down, fused q/k/v and gate/up) and a head slice.
SHAPES = [(1536, 1536), (256, 1536), (1536, 8960), (2048, 1536), (17920, 1536), (4096, 1536), (8, 256)]
# The real draft's (Qwen2.5-Coder-0.5B: q/o, k/v, gate/up, fused q/k/v, gate/up) and a small one: 896 = 28 x 32
# inputs, so a GGUF holds these maps in Q5_0 / Q8_0 blocks
DRAFT_SHAPES = [(896, 896), (128, 896), (4864, 896), (1152, 896), (9728, 896), (8, 96)]
# GGUF type: (bytes per block, inputs per block, where the float16 scales are)
LAYOUTS = {"Q4_K": (kquant.Q4K_BLOCK_BYTES, kquant.QK, [slice(0, 2), slice(2, 4)]),
           "Q6_K": (kquant.Q6K_BLOCK_BYTES, kquant.QK, [slice(208, 210)]),
           "Q5_0": (kquant.Q5_0_BLOCK_BYTES, kquant.QK0, [slice(0, 2)]),
           "Q8_0": (kquant.Q8_0_BLOCK_BYTES, kquant.QK0, [slice(0, 2)])}
FROM_GGUF = {"Q4_K": q4k_from_gguf, "Q6_K": q6k_from_gguf, "Q5_0": q5_0_from_gguf, "Q8_0": q8_0_from_gguf}


def random_blocks(rows: int, in_features: int, kind: str, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes of a `kind` (LAYOUTS) weight: random quants and scales, small positive float16 d."""
    rng = np.random.default_rng(seed)
    size, inputs, fields = LAYOUTS[kind]
    blocks = rng.integers(0, 256, (rows, in_features // inputs, size), dtype=np.uint8)
    scale = rng.uniform(1e-4, 1e-3, (rows, in_features // inputs)).astype(np.float16)
    for field in fields:
        blocks[..., field] = scale[..., None].view(np.uint8).reshape(*scale.shape, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_gguf_blocks_hold_the_weights_the_gguf_package_reads(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    raw = random_blocks(24, 512, kind)
    ours = FROM_GGUF[kind](raw, 24).dequantized()
    theirs = dequantize(raw, GGMLQuantizationType[kind]).reshape(24, 512)
    assert torch.equal(ours, torch.from_numpy(theirs.astype(np.float32)))


@pytest.mark.parametrize("quantize,bound", [(q4k_from_dense, 0.1), (q6k_from_dense, 0.03), (q5_0_from_dense, 0.06),
                                            (q8_0_from_dense, 0.01)])
def test_dense_weights_quantize_with_the_error_of_their_bits(quantize, bound):
    weight = torch.randn(64, 512) * 0.02
    error = (quantize(weight).dequantized() - weight).norm() / weight.norm()
    assert 0 < error < bound


def test_q5_0_rounds_as_llama_cpp_does():
    """Our rounding of a dense weight to Q5_0 gives the blocks the gguf package's quantize gives (llama.cpp's
    quantize_row_q5_0_ref), byte for byte once laid out as the GGUF stores them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    weight = torch.randn(16, 96) * 0.02
    theirs = q5_0_from_gguf(quantize(weight.numpy(), GGMLQuantizationType.Q5_0), 16)
    ours = q5_0_from_dense(weight)
    assert torch.equal(ours.dequantized(), theirs.dequantized())


@pytest.mark.parametrize("kind", ["q4k", "q6k", "mixed", "q5_0", "q8_0", "mixed32"])
def test_products_are_the_dequantized_weights_times_int8_activations(kind):
    torch.manual_seed(0)
    inputs = 768 if kind in ("q4k", "q6k", "mixed") else 864  # 864 = 27 blocks of 32: not a multiple of 256
    w1, w2 = torch.randn(96, inputs) * 0.02, torch.randn(32, inputs) * 0.02
    first, second = {"q4k": (q4k_from_dense, q4k_from_dense), "q6k": (q6k_from_dense, q6k_from_dense),
                     "mixed": (q4k_from_dense, q6k_from_dense), "q5_0": (q5_0_from_dense, q5_0_from_dense),
                     "q8_0": (q8_0_from_dense, q8_0_from_dense), "mixed32": (q5_0_from_dense, q8_0_from_dense)}[kind]
    parts = [first(torch.cat([w1, w2]))] if first is second else [first(w1), second(w2)]
    bias = torch.randn(128)
    layer = KQuantLinear(parts, bias, torch.float32)
    x = torch.randn(5, inputs)
    reference = x @ layer.dequantized().T + bias
    error = (layer(x) - reference).norm() / reference.norm()
    assert error < 0.02  # int8 activations per 256 inputs: ~0.4% measured; a wrong block or scale is ~100%


# Each shape as its map is split: a Q4_K part then a Q6_K one (a fused q/k/v with v in Q6_K), or for the draft's
# widths a Q5_0 part then a Q8_0 one (its v projections are Q8_0 in half the layers)
ROW_CASES = [(shape, q4k_from_dense, q6k_from_dense) for shape in SHAPES] + \
            [(shape, q5_0_from_dense, q8_0_from_dense) for shape in DRAFT_SHAPES]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape,first,second", ROW_CASES,
                         ids=[f"{o}x{i}-{a.__name__[:-11]}" for (o, i), a, _ in ROW_CASES])
def test_kernel_rows_are_computed_independently(shape, first, second, dtype):
    """k rows give bitwise the outputs of k 1-row calls (the kernel takes rows 1-4 at a time in registers and more
    in L1: every group size and remainder)."""
    out_features, in_features = shape
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features) * in_features ** -0.5
    split = out_features // 4 * 3
    layer = KQuantLinear([first(weight[:split]), second(weight[split:])], torch.randn(out_features), dtype)
    x = torch.randn(40, in_features, dtype=dtype)
    one_at_a_time = torch.cat([layer(x[i:i + 1]) for i in range(40)])
    for k in (2, 3, 4, 5, 7, 8, 16, 19, 40):
        assert torch.equal(layer(x[:k]), one_at_a_time[:k]), f"{k} rows round differently from 1"


def test_threads_split_columns_only():
    layer = KQuantLinear([q4k_from_dense(torch.randn(300, 512))], None, torch.float32)
    x = torch.randn(3, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(threads)


def test_gguf_format_reads_a_gguf_file_as_stored(tmp_path):
    """gguf_index / gguf_blocks on a file written by the gguf package: each projection's blocks as stored."""
    import gguf
    from gguf.quants import dequantize

    from evospec.model.weight_formats import gguf_blocks, gguf_index, gguf_types
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    raws = {"blk.0.attn_q.weight": ("Q4_K", random_blocks(16, 256, "Q4_K", 1)),
            "blk.0.ffn_down.weight": ("Q6_K", random_blocks(8, 512, "Q6_K", 2)),
            "blk.0.attn_k.weight": ("Q5_0", random_blocks(8, 96, "Q5_0", 4)),
            "blk.0.attn_v.weight": ("Q8_0", random_blocks(8, 96, "Q8_0", 5)),
            "output.weight": ("Q6_K", random_blocks(32, 256, "Q6_K", 3))}
    for name, (kind, raw) in raws.items():
        kind_enum = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind_enum)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours_names = ["layers.0.self_attn.q_proj", "layers.0.mlp.down_proj", "layers.0.self_attn.k_proj",
                  "layers.0.self_attn.v_proj", "lm_head"]
    assert gguf_types(path) == {ours: kind for ours, (kind, _) in zip(ours_names, raws.values())}
    assert (tmp_path / "tiny.gguf.index.json").exists() and gguf_index(path)["lm_head"]["rows"] == 32
    blocks = gguf_blocks(path)
    for ours, (name, (kind, raw)) in zip(ours_names, raws.items()):
        expected = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(raw.shape[0], -1)
        assert torch.equal(blocks[ours].dequantized(), torch.from_numpy(expected.astype(np.float32))), name


def _qwen2_config():
    from evospec.model.qwen3 import Qwen3Config
    return Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=True, qk_norm=False,
                       tie_word_embeddings=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_target_in_gguf_verifies_with_the_decodes_logits(dtype):
    """Every projection and the head in k-quant blocks (shapes of whole super-blocks): k verify rows give bitwise
    the logits of k 1-token decodes; the model really runs the kernel (not a fallback)."""
    from evospec.kernels.tree import chain_then_tree_mask
    from evospec.model.weight_formats import apply_weight_format
    from evospec.testing import random_qwen3
    model = apply_weight_format(random_qwen3(_qwen2_config(), seed=6, dtype=dtype), "gguf", None)
    assert model.weight_format == "gguf" and model.row_invariant_attention
    maps = [model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj, model.layers[0].mlp.gate_up_proj,
            model.layers[0].mlp.down_proj, model.head]
    assert all(type(m) is KQuantLinear for m in maps) and model.head.kinds == ["q6k"]
    ids = torch.randint(0, 512, (14,), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(20)
    model(ids[:8], torch.arange(8), cache, chain_then_tree_mask(0, 8, None))
    cache.advance(8)
    verify = model.full_logits(model(ids[8:], torch.arange(8, 14), cache, chain_then_tree_mask(8, 6, None)))
    for i in range(8, 14):
        hidden = model(ids[i:i + 1], torch.tensor([i]), cache, chain_then_tree_mask(i, 1, None))
        cache.advance(1)
        assert torch.equal(model.full_logits(hidden)[0], verify[i - 8]), f"row {i - 8}"


def test_a_draft_in_gguf_runs_32_input_blocks():
    """A model whose width is not a multiple of 256 (the 0.5B draft's 896; here 96) in gguf without a GGUF source:
    its projections rounded to Q5_0 (down, 256 wide, to Q4_K) and its head to Q8_0, as llama.cpp's Q4_K_M rounds
    them; its logits are the float model's with those weights up to the activations' 8-bit rounding."""
    from evospec.kernels.tree import chain_then_tree_mask
    from evospec.model.qwen3 import Qwen3Config, plain_projections
    from evospec.model.weight_formats import apply_weight_format
    from evospec.testing import random_qwen3
    cfg = Qwen3Config(vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True, qk_norm=False,
                      tie_word_embeddings=False)
    dense = random_qwen3(cfg, seed=3, dtype=torch.float32)
    model = apply_weight_format(random_qwen3(cfg, seed=3, dtype=torch.float32), "gguf", None, verifies=False)
    layer = model.layers[0]
    assert layer.self_attn.q_proj.kinds == ["q5_0"] and layer.mlp.up_proj.kinds == ["q5_0"]
    assert layer.mlp.down_proj.kinds == ["q4k"] and model.head.kinds == ["q8_0"]
    for name, (parent, attribute) in plain_projections(dense).items():  # the float model of the same weights
        getattr(parent, attribute).weight.data = model.get_submodule(name).dequantized()
    dense.lm_head.weight.data = model.head.dequantized()
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(2))
    expected = dense.full_logits(dense(ids, torch.arange(12), dense.new_cache(12), chain_then_tree_mask(0, 12, None)))
    logits = model.full_logits(model(ids, torch.arange(12), model.new_cache(12), chain_then_tree_mask(0, 12, None)))
    assert (logits - expected).norm() / expected.norm() < 0.03  # a wrong block or scale would be ~100%


def test_an_unsupported_input_size_falls_back_to_int8():
    from evospec.kernels.quantized import Int8WeightLinear
    from evospec.model.weight_formats import format_linear
    assert type(format_linear(nn.Linear(100, 64), "gguf", torch.float32)) is Int8WeightLinear
    assert format_linear(nn.Linear(384, 64), "gguf", torch.float32).kinds == ["q5_0"]
    assert format_linear(nn.Linear(512, 64), "gguf", torch.float32).kinds == ["q4k"]


def test_a_machine_without_the_kernel_fails_naming_the_field(monkeypatch):
    from evospec.model.weight_formats import WeightFormatError, check_runs_here

    def unavailable():
        raise kquant.KQuantUnavailable("the k-quant kernel is built on first use and needs a C compiler (gcc)")
    monkeypatch.setattr(kquant, "library", unavailable)
    with pytest.raises(WeightFormatError, match=r"^model.quantize: gguf cannot run on this CPU \(ISA .*gcc"):
        check_runs_here("gguf", torch.device("cpu"), torch.float32)



AVX2_PROBE = """
import sys, torch
from evospec.kernels.kquant import KQuantLinear, q4k_from_dense, q5_0_from_dense, q6k_from_dense, q8_0_from_dense
torch.manual_seed(0)
w = torch.randn(320, 1536) * 0.03
outputs = []
for parts in ([q4k_from_dense(w[:256]), q6k_from_dense(w[256:])], [q5_0_from_dense(w[:256]), q8_0_from_dense(w[256:])]):
    layer = KQuantLinear(parts, torch.randn(320), torch.float32)
    x = torch.randn(20, 1536)
    rows = torch.cat([layer(x[i:i + 1]) for i in range(20)])
    assert torch.equal(layer(x), rows), "rows round differently"
    outputs.append(rows)
torch.save(torch.stack(outputs), sys.argv[1])
"""


def test_the_avx2_path_computes_what_the_default_build_does(tmp_path):
    """The kernel's AVX2 build (what an AVX2-only CPU runs), forced on this machine in a child process: row-invariant,
    and within float rounding of this machine's own build (the integer sums are equal; only the float lanes they are
    accumulated in differ)."""
    import os
    import subprocess
    import sys
    outputs = {}
    for name, env in (("native", {}), ("avx2", {"EVOSPEC_KQUANT_AVX2": "1"})):
        path = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", AVX2_PROBE, str(path)], check=True, timeout=300,
                       env={**os.environ, **env})
        outputs[name] = torch.load(path)
    assert torch.allclose(outputs["avx2"], outputs["native"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gguf_seconds,chosen", [(1.04, "gguf"), (1.10, "int4-weight-only")])
def test_auto_takes_the_source_bits_when_they_time_within_noise_of_the_fastest(monkeypatch, gguf_seconds, chosen):
    from evospec.model import weight_formats
    from evospec.testing import tiny_config
    timed = {"int8-weight-only": 1.5, "int8-per-token": 1.4, "int4-weight-only": 1.0, "gguf": gguf_seconds,
             "none": 3.0}
    seen = {}

    def fake_seconds(cfg, formats, dtype, fused=False, six_bit_down=0.0):
        seen.update(formats=formats, six_bit_down=six_bit_down)
        return {fmt: timed[fmt] for fmt in formats}
    monkeypatch.setattr(weight_formats, "formats_seconds", fake_seconds)
    fmt, _ = weight_formats.choose_format(tiny_config(vocab=512, hidden=256, layers=2, eos=1), torch.bfloat16, True,
                                          fused=True, six_bit_down=0.5)
    assert fmt == chosen and "gguf" in seen["formats"] and seen["six_bit_down"] == 0.5


def test_format_timing_counts_the_head_and_the_six_bit_downs(monkeypatch):
    """auto times what the format will hold: a slice of the LM head in the head's kernel, and the down projections
    a 4-bit GGUF keeps at 6 bits as the 4-bit formats hold them (only for those formats)."""
    from evospec.model import weight_formats
    from evospec.testing import tiny_config
    built = []
    real = weight_formats._projection_map

    def recording(out_features, in_features, fmt, dtype, head=False):
        built.append((fmt, out_features, in_features, head))
        return real(out_features, in_features, fmt, dtype, head)
    monkeypatch.setattr(weight_formats, "_projection_map", recording)
    cfg = tiny_config(vocab=4096, hidden=256, layers=2, eos=1)
    seconds = weight_formats.formats_seconds(cfg, ["gguf", "int8-per-token"], torch.float32, rows=(1,), repeats=1,
                                             six_bit_down=0.5)
    assert set(seconds) == {"gguf", "int8-per-token"}
    down = (cfg.hidden_size, cfg.intermediate_size)
    for fmt in ("gguf", "int8-per-token"):
        assert (fmt, 4096, 256, True) in built  # the head
    assert ("gguf", *down, True) in built and ("int8-per-token", *down, True) not in built


def test_auto_stops_timing_a_format_far_slower_than_the_fastest(monkeypatch):
    """formats_seconds: after the first timed round, a format over PRUNE_FACTOR x the fastest is not timed again
    (start-up time); the contenders run every round; every format still gets a figure."""
    import time as clock

    from evospec.model import weight_formats
    from evospec.testing import tiny_config
    calls = {"gguf": 0, "int8-weight-only": 0}

    def stub(out_features, in_features, fmt, dtype, head=False):
        def run(x):
            calls[fmt] += 1
            clock.sleep(0.0002 if fmt == "gguf" else 0.002)
        return run
    monkeypatch.setattr(weight_formats, "_projection_map", stub)
    monkeypatch.setattr(weight_formats, "EVICT_BYTES", 1024)
    cfg = tiny_config(vocab=4096, hidden=256, layers=2, eos=1)
    seconds = weight_formats.formats_seconds(cfg, ["gguf", "int8-weight-only"], torch.float32, rows=(1,), repeats=5)
    assert seconds["int8-weight-only"] > weight_formats.PRUNE_FACTOR * seconds["gguf"]
    per_round = calls["gguf"] // 6  # maps of one format: warm-up + 5 rounds
    assert calls["gguf"] == 6 * per_round and calls["int8-weight-only"] == 2 * per_round


def test_a_failed_build_is_one_line(monkeypatch, tmp_path):
    """A compiler that fails (here `false`) or is missing gives KQuantUnavailable with one line, and nothing half
    written is left where the next process would load it."""
    monkeypatch.setattr(kquant, "_LIBRARY", None)
    monkeypatch.setenv("EVOSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(kquant.KQuantUnavailable, match=r"^building the k-quant kernel failed"):
        kquant.library()
    assert not list((tmp_path / "kernels").glob("*.so"))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(kquant.KQuantUnavailable, match="needs a C compiler"):
        kquant.library()
    assert not kquant.available()


def test_a_pruned_head_reads_the_quantized_heads_own_rows():
    """FR-Spec / EvoSpec's static block of a draft in gguf: the head's Q8_0 blocks of the static ids, whose logits
    are bitwise the full quantized head's at those ids (each output column is computed on its own); with dynamic
    slots appended as dense rows."""
    from evospec.vocab.active import static_vocab
    torch.manual_seed(0)
    dense = torch.randn(64, 96) * 0.1
    head = KQuantLinear([q8_0_from_dense(dense)], None, torch.float32)
    ids = torch.tensor([5, 0, 63, 17, 18])
    active = static_vocab(dense, ids, head)
    assert isinstance(active.static_rows, KQuantLinear) and active.num_static == 5
    hidden = torch.randn(3, 96)
    assert torch.equal(active.logits(hidden), head(hidden)[:, ids])
    session = active.with_dynamic_slots(dense, 2)
    session.set_dynamic_many(dense, [1], [40], [0.0])
    logits = session.logits(hidden)
    assert logits.shape == (3, 7) and torch.isinf(logits[:, 5]).all()
    assert torch.allclose(logits[:, 6], hidden @ dense[40])
    assert isinstance(static_vocab(dense, ids).static_rows, torch.Tensor)  # no quantized head: dense rows
