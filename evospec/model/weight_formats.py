"""The weight format a model runs in on this machine (`model.quantize`), chosen at load by measurement under `auto`.

Formats (docs/models.md, "Weight formats"; quality per format: docs/results.md, "Weight formats: speed and quality"):
- `none`: dense weights in the model's dtype (`torch.nn.functional.linear` through kernels/linear.py).
- `int8`: torch dynamic quantization of the decoder layers (int8 weights and activations, float32 model; the draft's
  format: its output is only proposed, and its kernels are not row-invariant, so never the target's).
- `int8-weight-only`: int8 weights per output channel, activations in the model's dtype (kernels/quantized.py).
- `int4-weight-only`: int4 weights in groups of 32 (int8 where torch's kernel cannot take the shape, and for the
  projections the source GGUF itself keeps above 4 bits: Q4_K_M keeps half the layers' v and down projections and
  the LM head in Q6_K); activations in the model's dtype.
- `int8-per-token`: int8 weights per output channel times int8 activations quantized per token (W8A8 dynamic
  per-token, `torch._int_mm`): exactly row-invariant (integer sums), and with AMX a k-row verify costs about what a
  1-row decode does (weight-only kernels loop over rows). SmoothQuant-smoothed at load (model/smoothing.py):
  +1.15% perplexity over 20 held-out abstracts on the real target (unsmoothed +1.70%; int4 +0.69%).
- `gguf`: the source GGUF's own Q4_K / Q6_K blocks, and Q5_0 / Q8_0 where a map's input width is not a multiple of
  256 (the 0.5B draft's 896), times int8 activation blocks, through our native kernel (kernels/kquant.py; needs AVX2
  and a C compiler): the weights and the numerics llama.cpp runs, row-invariant. A model without a GGUF source is
  rounded as llama.cpp's Q4_K_M would round it: Q4_K (Q5_0 where the width is not a multiple of 256), head Q6_K.
- `auto`: on a CUDA device, `none`; on a CPU, the fastest of the row-invariant formats on this machine, measured at
  load on the model's own projection shapes and LM head (random weights, fused as a target runs them; 10-20
  seconds on 2 cores), `gguf` where it is within SOURCE_BITS_TIE of the fastest. The answer is remembered per
  machine (`FormatChoices`: CPU model and flags, torch version and threads, the model's shapes, this code), so later
  start-ups on the same machine skip the measurement; a different machine, model or kernel measures again.
  `int4-weight-only` and `gguf` are candidates only when the model was converted from a 4-bit GGUF (its
  `provenance.json`), so `auto` never serves a model below the precision it was published in. The embedded tiny pair stays `none` (the
  float32 reference). Where dense weights time faster than every weight-only format (slow weight-only kernels in
  float32 on a CPU without native bf16), `auto` gives `none`, with a warning: greedy identity is then not bitwise.

A target in a FUSABLE format runs q/k/v and gate/up as one map each. These formats quantize the decoder's
projections and the LM head (a separate copy for `full_logits`; the dense head stays for the draft's pruned
vocabularies). They are row-invariant (kernels/quantized.py, kernels/kquant.c), which keeps
a verify forward's logits bitwise equal to the 1-token decode forwards', so greedy speculation is the target's own.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from evospec.kernels import kquant
from evospec.kernels.fused_step import FusedStep
from evospec.kernels.kquant import (
    KQuantLinear,
    KQuantUnavailable,
    KQuantWeight,
    concatenated,
    q4k_from_dense,
    q4k_from_gguf,
    q5_0_from_dense,
    q5_0_from_gguf,
    q6k_from_dense,
    q6k_from_gguf,
    q8_0_from_dense,
    q8_0_from_gguf,
)
from evospec.kernels.linear import linear
from evospec.kernels.quantized import Int8PerTokenLinear, Int8WeightLinear, quantized_linear
from evospec.model.qwen3 import Qwen3, Qwen3Config, plain_projections, quantize_int8
from evospec.model.smoothing import smooth_for_per_token

log = logging.getLogger(__name__)

WEIGHT_ONLY = ("int8-weight-only", "int4-weight-only")
# kernels/quantized.py's formats and kernels/kquant.py's `gguf`: CPU only, row-invariant
ROW_INVARIANT = (*WEIGHT_ONLY, "int8-per-token", "gguf")
# Formats whose maps are per output row (all-int8: one scale per row; gguf: blocks per row), so a target's q/k/v
# (and gate/up) stacked into one map compute exactly what the separate maps do, in one call (and one activation
# quantization).
FUSABLE = ("int8-weight-only", "int8-per-token", "gguf")
BITS = {"int8-weight-only": 8, "int4-weight-only": 4}
FOUR_BIT_FORMATS = ("int4-weight-only", "gguf")  # what a 4-bit GGUF keeps at 6 bits, these hold in 8 / Q6_K
# GGUF module names -> ours, for the projections a source GGUF may keep at higher precision than its file type.
GGUF_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}
FOUR_BIT_GGUF_TYPES = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS"}


class WeightFormatError(ValueError):
    """A format this machine or model cannot run: one line naming `model.quantize` and the machine's ISA."""


def projection_shapes(cfg: Qwen3Config, fused: bool = False) -> list[tuple[int, int]]:
    """[out, in] of the projections of one decoder layer: q, k, v, o, gate, up, down; fused: qkv, o, gate_up, down
    (a target in a FUSABLE format)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    if fused:
        return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    return [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]


def source_gguf(folder: Path) -> Path | None:
    """The GGUF file a fetched model was converted from (its provenance.json, beside the folder's store), or None."""
    provenance = folder / "provenance.json"
    if not provenance.exists():
        return None
    name = json.loads(provenance.read_text()).get("gguf")
    path = folder.parent / "gguf" / name if name else None
    return path if path is not None and path.exists() else None


def gguf_index(gguf: Path) -> dict[str, dict]:
    """{our module name ("layers.3.mlp.down_proj", "lm_head"): {"type": GGUF tensor type ("Q4_K", "Q6_K", ...),
    "rows": output rows, "offset": byte offset of its data in the file, "bytes": its size}}. Parsing a GGUF takes
    7-14 s (its tokenizer metadata), so the answer is kept beside it (`<file>.index.json`, one per file)."""
    saved = gguf.with_name(gguf.name + ".index.json")
    if saved.exists() and saved.stat().st_mtime >= gguf.stat().st_mtime:
        return json.loads(saved.read_text())
    from gguf import GGUFReader

    index = {}
    for tensor in GGUFReader(gguf).tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and parts[2] in GGUF_PROJECTIONS and parts[-1] == "weight":
            name = f"layers.{parts[1]}.{GGUF_PROJECTIONS[parts[2]]}"
        elif tensor.name == "output.weight":
            name = "lm_head"
        else:
            continue
        index[name] = {"type": tensor.tensor_type.name, "rows": int(tensor.shape[-1]),
                       "offset": int(tensor.data_offset), "bytes": int(tensor.n_bytes)}
    try:
        saved.write_text(json.dumps(index))
    except OSError:  # a read-only store: parse again next time
        pass
    return index


def gguf_types(gguf: Path) -> dict[str, str]:
    """{our module name: GGUF tensor type} of the projections and the LM head (gguf_index)."""
    return {name: entry["type"] for name, entry in gguf_index(gguf).items()}


GGUF_BLOCK_TYPES = {"Q4_K": q4k_from_gguf, "Q6_K": q6k_from_gguf, "Q5_0": q5_0_from_gguf, "Q8_0": q8_0_from_gguf}


def gguf_blocks(gguf: Path) -> dict[str, KQuantWeight]:
    """{our module name: its weight as the GGUF stores it} for the Q4_K, Q6_K, Q5_0 and Q8_0 projections and head
    (the others, if any, are re-quantized from the dense weights by quantize_gguf)."""
    data = np.memmap(gguf, dtype=np.uint8, mode="r")
    blocks = {}
    for name, entry in gguf_index(gguf).items():
        unpack = GGUF_BLOCK_TYPES.get(entry["type"])
        if unpack is not None:
            blocks[name] = unpack(data[entry["offset"]:entry["offset"] + entry["bytes"]], entry["rows"])
    return blocks


def is_four_bit_source(folder: Path | None) -> bool:
    """Whether the model was converted from a GGUF whose projections are mostly 4-bit (Q4_K_M, Q4_0, ...)."""
    gguf = source_gguf(folder) if folder is not None else None
    if gguf is None:
        return False
    types = list(gguf_types(gguf).values())
    return sum(t in FOUR_BIT_GGUF_TYPES for t in types) * 2 > len(types)


def check_runs_here(fmt: str, device: torch.device, dtype: torch.dtype) -> None:
    """WeightFormatError unless `fmt` runs on this device: the weight-only kernels are torch's CPU ones."""
    if fmt not in ROW_INVARIANT:
        return
    isa = torch.backends.cpu.get_cpu_capability()
    if device.type != "cpu":
        raise WeightFormatError(f"model.quantize: {fmt} runs on the CPU only (device {device}); use none or auto")
    if fmt == "gguf":
        try:
            kquant.library()
        except (KQuantUnavailable, OSError) as err:
            raise WeightFormatError(f"model.quantize: gguf cannot run on this CPU (ISA {isa}): {err}") from err
    try:
        probe = nn.Linear(kquant.QK, 16, bias=False)
        format_linear(probe, fmt, dtype)(torch.zeros(2, kquant.QK, dtype=dtype))
    except (RuntimeError, NotImplementedError) as err:
        raise WeightFormatError(f"model.quantize: {fmt} is not supported by torch on this CPU (ISA {isa}, "
                                f"dtype {dtype}): {str(err).splitlines()[0]}") from err


def format_linear(layer: nn.Linear, fmt: str, dtype: torch.dtype, keep_8bit: bool = False) -> nn.Module:
    """`layer` as the quantized map of row-invariant format `fmt`; keep_8bit: int8 weights under int4."""
    if fmt == "int8-per-token":
        return Int8PerTokenLinear(layer.weight, layer.bias, dtype)
    if fmt == "gguf":
        return _kquant_map([layer], [None], dtype)
    return quantized_linear(layer, 8 if keep_8bit else BITS[fmt], dtype)


def _fused(layers: list[nn.Linear], fmt: str, dtype: torch.dtype) -> nn.Module:
    """The maps `layers` (same input) as one map of `fmt` whose output is theirs concatenated."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=layers[0].bias is not None, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if layers[0].bias is not None:
        stacked.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
    return format_linear(stacked, fmt, dtype)


# (parent, fused map, the maps it stacks, in output order): Attention.project_qkv and MLP.forward read the fused maps
FUSED_GROUPS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def fuse_projections(model: Qwen3, build: Callable[[list[nn.Linear], list[str]], nn.Module]) -> None:
    """Replace each layer's q/k/v by one `qkv_proj` and gate/up by one `gate_up_proj`: build(the maps, their names
    ("layers.3.self_attn.q_proj", ...)) makes the stacked map (FUSABLE formats)."""
    for index, layer in enumerate(model.layers):
        for parent_name, fused_name, names in FUSED_GROUPS:
            parent = getattr(layer, parent_name)
            setattr(parent, fused_name, build([getattr(parent, name) for name in names],
                                              [f"layers.{index}.{parent_name}.{name}" for name in names]))
            for name in names:
                delattr(parent, name)


def quantize_weights(model: Qwen3, fmt: str, keep_8bit: set[str] = frozenset(), fuse: bool = False) -> Qwen3:
    """Replace the decoder's projections by quantized maps of `fmt` (outputs in the model's dtype), and give
    `full_logits` an int8 head (per-token under int8-per-token, weight-only otherwise). keep_8bit: module names
    ("layers.3.mlp.down_proj", "lm_head") kept at int8 under int4 (those the source GGUF keeps above 4 bits).
    fuse: stack q/k/v and gate/up into one map each where `fmt` is FUSABLE (a target: fewer kernel calls per
    step; a draft keeps the separate maps its online adaptation wraps)."""
    dtype = model.embed_tokens.weight.dtype
    if fuse and fmt in FUSABLE:
        fuse_projections(model, lambda layers, _: _fused(layers, fmt, dtype))
    for qualified, (parent, name) in plain_projections(model).items():
        setattr(parent, name, format_linear(getattr(parent, name), fmt, dtype, qualified in keep_8bit))
    head = Int8PerTokenLinear if fmt == "int8-per-token" else Int8WeightLinear
    model.head = head(model.head_weight, None, dtype)
    model.weight_format = fmt
    return model


def _kquant_map(layers: list[nn.Linear], blocks: list[KQuantWeight | None], dtype: torch.dtype) -> nn.Module:
    """`layers` (same input; their outputs concatenated) as one k-quant map: each from its GGUF blocks where given,
    else re-quantized from its dense weight, to Q4_K, or to Q5_0 where the input size is not a multiple of 256 (as
    llama.cpp's Q4_K_M does). An input size no block takes (not a multiple of 32) gives int8-weight-only maps
    instead (row-invariant too)."""
    shape = (layers[0].out_features, layers[0].in_features)
    if not kquant.block_supported(*shape):
        return _fused(layers, "int8-weight-only", dtype) if len(layers) > 1 else format_linear(
            layers[0], "int8-weight-only", dtype)
    rounded = q4k_from_dense if kquant.supported(*shape) else q5_0_from_dense
    weights = [given if given is not None else rounded(layer.weight) for layer, given in zip(layers, blocks)]
    parts: list[list[KQuantWeight]] = []
    for weight in weights:  # consecutive weights of one kind share a kernel call
        if parts and parts[-1][0].kind == weight.kind:
            parts[-1].append(weight)
        else:
            parts.append([weight])
    biases = [layer.bias for layer in layers]
    bias = None if biases[0] is None else torch.cat([b.detach().float() for b in biases])
    return KQuantLinear([concatenated(group) for group in parts], bias, dtype)


def quantize_gguf(model: Qwen3, blocks: dict[str, KQuantWeight], fuse: bool) -> Qwen3:
    """Format `gguf`: every projection and the LM head as k-quant maps (kernels/kquant.py) holding the source GGUF's
    own blocks (`blocks`, by module name; a module missing there is re-quantized to Q4_K from its dense weight, the
    head to Q6_K, as for a model with no GGUF source). fuse: q/k/v and gate/up as one map each (a target)."""
    dtype = model.embed_tokens.weight.dtype
    if fuse:
        fuse_projections(model, lambda layers, names: _kquant_map(layers, [blocks.get(n) for n in names], dtype))
    for qualified, (parent, name) in plain_projections(model).items():
        setattr(parent, name, _kquant_map([getattr(parent, name)], [blocks.get(qualified)], dtype))
    head = blocks.get("lm_head")
    head_layer = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False, device="meta")
    head_layer.weight = nn.Parameter(model.head_weight.detach(), requires_grad=False)
    if head is None and kquant.supported(*model.head_weight.shape):
        head = q6k_from_dense(model.head_weight)
    elif head is None and kquant.block_supported(*model.head_weight.shape):
        head = q8_0_from_dense(model.head_weight)
    model.head = _kquant_map([head_layer], [head], dtype)
    model.weight_format = "gguf"
    return model


def higher_precision_modules(folder: Path | None) -> set[str]:
    """Module names the source GGUF keeps above 4 bits (empty without a GGUF source)."""
    gguf = source_gguf(folder) if folder is not None else None
    if gguf is None:
        return set()
    return {name for name, kind in gguf_types(gguf).items() if kind not in FOUR_BIT_GGUF_TYPES}


SOURCE_BITS_TIE = 1.05  # choose_format: gguf this close to the fastest is chosen (back-to-back timings: up to 8% apart)
EVICT_BYTES = 96 << 20  # more than a server CPU's last-level cache: a decode step reads its weights from memory


PRUNE_FACTOR = 2.0  # formats_seconds: a format this many times the fastest after one timed round is not timed again
HEAD_SLICE = 16384  # LM head rows timed per format; the head's cost is that times vocab / HEAD_SLICE (linear in rows)


def _projection_map(out_features: int, in_features: int, fmt: str, dtype: torch.dtype, head: bool = False):
    """A random projection of this shape in format `fmt`, as a callable x -> y. head: as the format holds the LM
    head and the projections a 4-bit GGUF keeps at 6 bits (int8 under the weight-only formats, Q6_K under gguf, as
    quantize_weights / quantize_gguf do)."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.float32)
    nn.init.normal_(layer.weight, std=0.02)
    if fmt == "none":
        weight = layer.weight.to(dtype)
        return lambda x: linear(x, weight)
    if head and fmt == "gguf" and kquant.supported(out_features, in_features):
        return KQuantLinear([q6k_from_dense(layer.weight)], None, dtype)
    if head and fmt == "gguf" and kquant.block_supported(out_features, in_features):
        return KQuantLinear([q8_0_from_dense(layer.weight)], None, dtype)
    if head and fmt in WEIGHT_ONLY:
        return Int8WeightLinear(layer.weight, None, dtype)
    return format_linear(layer, fmt, dtype)


@torch.inference_mode()
def formats_seconds(cfg: Qwen3Config, formats: list[str], dtype: torch.dtype, rows: tuple[int, ...] = (1, 4),
                    repeats: int = 7, fused: bool = False, six_bit_down: float = 0.0) -> dict[str, float]:
    """{format: estimated seconds of the decoder's projections and the LM head for one forward per row count in
    `rows`, summed (a decode step and a verify step)}: each distinct projection shape timed with random weights,
    times the number of layers, plus a slice of the head in the format's head kernel scaled to the vocabulary.
    fused: a target's stacked q/k/v and gate/up where the format is FUSABLE. six_bit_down: the share of layers
    whose down projection the source GGUF keeps above 4 bits (Q4_K_M: half), timed as the 4-bit formats hold it.

    Each timing is the best of `repeats` calls, each after the caches were flushed by writing EVICT_BYTES elsewhere
    (one projection's weights would otherwise stay in the L3 between calls, which a whole model's never do), and
    the formats are timed in turn within each repeat, so a burst of other work on the CPU (the other replica
    loading beside this one) slows every candidate alike instead of one. A format over PRUNE_FACTOR x the fastest
    after the first round is not timed again (its figure is that round's): on an AVX2 CPU the weight-only formats
    took 4-37x gguf's time, and their six more rounds were seconds of every start-up."""
    calls = []  # (format, run, x, weight): every timed call, and what its time counts for
    head_rows = min(HEAD_SLICE, cfg.vocab_size)
    layers = cfg.num_hidden_layers
    for fmt in formats:
        *others, down = projection_shapes(cfg, fused and fmt in FUSABLE)
        kept = six_bit_down if fmt in FOUR_BIT_FORMATS else 0.0
        shapes = [(shape, layers, False) for shape in others] + [(down, layers * (1 - kept), False)]
        shapes += [(down, layers * kept, True)] if kept else []
        shapes.append(((head_rows, cfg.hidden_size), cfg.vocab_size / head_rows, True))
        for (out_features, in_features), weight, head in shapes:
            run = _projection_map(out_features, in_features, fmt, dtype, head)
            calls += [(fmt, run, torch.randn(n, in_features, dtype=dtype), weight) for n in rows]
    for _, run, x, _ in calls:
        run(x)  # the first call of a shape chooses and warms its kernel up
    best = [float("inf")] * len(calls)
    scratch = torch.empty(EVICT_BYTES, dtype=torch.uint8)
    timed = list(range(len(calls)))
    for round_ in range(repeats):
        for i in timed:
            scratch.fill_(1)
            start = time.perf_counter()
            calls[i][1](calls[i][2])
            best[i] = min(best[i], time.perf_counter() - start)
        if round_ == 0:
            totals = _totals(calls, best, formats)
            slow = {fmt for fmt, seconds in totals.items() if seconds > PRUNE_FACTOR * min(totals.values())}
            timed = [i for i in timed if calls[i][0] not in slow]
    return _totals(calls, best, formats)


def _totals(calls: list[tuple], best: list[float], formats: list[str]) -> dict[str, float]:
    """formats_seconds' figure per format: each timed call's best time times what it counts for."""
    return {fmt: sum(weight * b for (f, _, _, weight), b in zip(calls, best) if f == fmt) for fmt in formats}


def format_seconds(cfg: Qwen3Config, fmt: str, dtype: torch.dtype, rows: tuple[int, ...] = (1, 4),
                   repeats: int = 7, fused: bool = False) -> float:
    """formats_seconds for one format."""
    return formats_seconds(cfg, [fmt], dtype, rows, repeats, fused)[fmt]


def choose_format(cfg: Qwen3Config, dtype: torch.dtype, four_bit_source: bool,
                  fused: bool = False, six_bit_down: float = 0.0) -> tuple[str, dict[str, float]]:
    """`auto` on a CPU: the fastest row-invariant format measured here (fused: as a target stacks its maps), unless
    dense weights are faster still (a CPU whose quantized kernels are slow in this dtype, e.g. float32 activations
    without native bf16: then `none`, and greedy speculation is no longer bitwise the target's; logged). Returns
    the choice and the seconds measured per candidate (logged). Within SOURCE_BITS_TIE of the fastest, `gguf` wins:
    it computes with the source file's own weights (no re-quantization), as llama.cpp does, and timings a few
    percent apart are this measurement's noise (docs/models.md, "Weight formats")."""
    four_bit = ["int4-weight-only"] + (["gguf"] if kquant.available() else [])
    candidates = ["int8-weight-only", "int8-per-token"] + (four_bit if four_bit_source else [])
    seconds = formats_seconds(cfg, [*candidates, "none"], dtype, fused=fused, six_bit_down=six_bit_down)
    best = min(candidates, key=seconds.get)
    if "gguf" in candidates and seconds["gguf"] <= SOURCE_BITS_TIE * seconds[best]:
        best = "gguf"
    if seconds["none"] < seconds[best]:
        log.warning("weight format auto -> none: dense %s weights measured faster than %s on this CPU (%.3f vs %.3f "
                    "s); verify forwards are then not row-invariant, so greedy speculation can leave `ar` at a "
                    "near-tie (docs/models.md, \"Weight formats\")", dtype, best, seconds["none"], seconds[best])
        return "none", seconds
    return best, seconds


class FormatChoices:
    """`auto`'s answers measured on this machine, kept in one JSON file (at most MAX_ENTRIES, the oldest dropped):
    each under a key that hashes what the timing depended on (the machine description given, torch's version and
    threads, the question asked: the model's shapes, dtype, source bits and fusing, and this module's and the
    kernels' source). Delete the file, or set EVOSPEC_MEASURE_FORMATS=1, to measure again."""

    MAX_ENTRIES = 64
    REMEASURE_ENV = "EVOSPEC_MEASURE_FORMATS"

    def __init__(self, path: Path, machine: dict):
        self.path, self.machine = path, machine

    def key(self, question: dict) -> str:
        code = [Path(__file__), Path(kquant.__file__), Path(kquant.__file__).with_suffix(".c")]
        sources = hashlib.sha256(b"".join(f.read_bytes() for f in code if f.exists())).hexdigest()
        what = {"machine": self.machine, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "question": question, "code": sources}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]

    def _entries(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: measure (and write it anew)
            return {}

    def get(self, question: dict) -> dict | None:
        if os.environ.get(self.REMEASURE_ENV) == "1":
            return None
        return self._entries().get(self.key(question))

    def put(self, question: dict, fmt: str, seconds: dict[str, float]) -> None:
        entries = self._entries()
        entries[self.key(question)] = {"format": fmt, "seconds": seconds, "machine": self.machine,
                                       "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        entries = dict(list(entries.items())[-self.MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(entries, indent=1))
            partial.replace(self.path)  # atomic: two replicas starting together never read half a file
        except OSError as exc:  # a read-only cache: measure again next time
            log.warning("could not remember the weight format choice in %s: %s", self.path, exc)


def auto_format(cfg: Qwen3Config, dtype: torch.dtype, folder: Path | None, device: torch.device,
                embedded: bool = False, verifies: bool = True,
                choices: FormatChoices | None = None) -> tuple[str, dict[str, float]]:
    """`auto` resolved for a model of `cfg` computing in `dtype` (module docstring): `none` on a GPU and for the
    embedded tiny pair; on a CPU `choose_format`'s answer, from `choices` when this machine already measured it.
    Returns the format and the seconds measured per candidate (logged)."""
    if device.type != "cpu" or embedded:
        return "none", {}
    kept = higher_precision_modules(folder)
    six_bit_down = sum(name.endswith("mlp.down_proj") for name in kept) / cfg.num_hidden_layers
    four_bit = is_four_bit_source(folder)
    question = {"dims": [cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size], "dtype": str(dtype),
                "four_bit_source": four_bit, "fused": verifies, "six_bit_down": six_bit_down,
                "kquant": kquant.available()}
    known = choices.get(question) if choices is not None else None
    if known is not None:
        log.info("weight format auto -> %s (measured on this machine at %s, remembered in %s; delete it to measure "
                 "again: %s)", known["format"], known["measured_at"], choices.path, known["seconds"])
        return known["format"], known["seconds"]
    fmt, measured = choose_format(cfg, dtype, four_bit, fused=verifies, six_bit_down=six_bit_down)
    measured = {k: float(f"{v:.4g}") for k, v in measured.items()}  # 4 significant digits: a tiny model's ms stay apart
    log.info("weight format auto -> %s (seconds of the projections and head per decode + 4-row verify, measured "
             "here: %s)", fmt, measured)
    if choices is not None:
        choices.put(question, fmt, measured)
    return fmt, measured


def gguf_block_weights(folder: Path | None) -> set[str]:
    """Parameter names ("layers.3.mlp.down_proj.weight") whose weights `gguf` takes from the source GGUF's own
    blocks: a loader need not read their dense copies (load_qwen3's `skip`). Empty without a GGUF source."""
    gguf = source_gguf(folder) if folder is not None else None
    if gguf is None:
        return set()
    return {f"{name}.weight" for name, kind in gguf_types(gguf).items()
            if name != "lm_head" and kind in GGUF_BLOCK_TYPES}


def apply_weight_format(model: Qwen3, fmt: str, folder: Path | None, embedded: bool = False,
                        verifies: bool = True, dtype_auto: bool = False) -> Qwen3:
    """Load-time step: put `model` (dense, loaded in its dtype) into format `fmt` ("auto" resolved here).
    verifies: the model is a target, whose verify forwards must round as its decodes do: in a row-invariant format
    its decode and verify segments also attend row by row (Qwen3.row_invariant_attention). A draft's forwards are
    proposals, so it keeps the faster many-row attention. dtype_auto: the dtype was `auto`, so a model that ends in
    gguf runs in float32 (its kernels compute in float32, and the native step runs only there: a bf16-native CPU
    gains nothing from bf16 activations around GGUF blocks)."""
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    measured: dict[str, float] = {}
    if fmt == "auto":
        fmt, measured = auto_format(model.cfg, dtype, folder, device, embedded, verifies)
    check_runs_here(fmt, device, dtype)
    model.weight_format_seconds = measured
    if fmt == "int8":
        return quantize_int8(model)
    if fmt == "int8-per-token":
        smooth_for_per_token(model, folder, keep=not embedded)
    if fmt == "gguf":
        if dtype_auto and dtype != torch.float32:
            model = model.float()
        gguf = source_gguf(folder) if folder is not None else None
        model = quantize_gguf(model, gguf_blocks(gguf) if gguf is not None else {}, fuse=verifies)
        model.row_invariant_attention = verifies
        model.fused_step = FusedStep.for_model(model)
        return model
    if fmt in ROW_INVARIANT:
        model = quantize_weights(model, fmt, higher_precision_modules(folder) if fmt == "int4-weight-only" else set(),
                                 fuse=verifies)
        model.row_invariant_attention = verifies
        return model
    model.weight_format = "none"
    return model

