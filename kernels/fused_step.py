"""A decode or verify step of a model in format gguf with one native call per decoder layer (kquant.c
layer_forward): the maps, and everything torch ran between them (RMSNorm, q/k norm, RoPE, the K/V writes, each
row's attention, SiLU, the residual adds).

Why: torch's eager layer is ~60 small operations; on 2 AVX2 cores they cost ~8 ms of a 1.5B target's ~57 ms decode
step (28 layers) and of a 0.5B draft's ~26 ms (24 layers), where llama.cpp's whole step takes 53 and 22 ms
(docs/results.md). Here a layer is one parallel region.

When: every segment of the forward has at most model/qwen3.py's ROW_INVARIANT_MAX_ROWS rows (decodes, verifies, drafted trees, short
prefill chunks), activations in float32, every map of every layer a KQuantLinear (LoRA-wrapped maps run in torch:
`install_lora` drops the step), head_dim a multiple of 8. Longer prefill chunks run torch's layers (SDPA).

Row invariance holds as in the maps: each row's norm, rotation, attention (over exactly the slots it sees, in slot
order) and activation are computed by the same operations whatever the number of rows, so a verify row is bitwise
the decode of its token, and which thread computes a row never matters.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from evospec.kernels.kquant import KQuantLinear, Part, library


class Layer(ctypes.Structure):
    """kquant.c's Layer: the tables of one layer's maps and its norms' weights."""
    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("n_qkv", ctypes.c_int64), ("n_o", ctypes.c_int64),
                ("n_gate_up", ctypes.c_int64), ("n_down", ctypes.c_int64), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]


class Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float)]


class RowAttention(ctypes.Structure):
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("layer_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("write_slot", ctypes.c_int64), ("count", ctypes.c_int64),
                ("slots", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.layer_work_floats.argtypes, lib.layer_work_floats.restype = [i64, p], i64
    lib.layer_forward.argtypes = [p, i64, i64, p, p, p, p, p, i32, p, p, p, i64]
    lib.layer_forward.restype = None
    return lib


def _table(maps: list[KQuantLinear]) -> ctypes.Array:
    """The maps' parts (same input) as one kernel table, each map's columns after the previous map's."""
    parts, column = [], 0
    for linear in maps:
        for part in linear._parts:
            parts.append(Part(part.kind, part.rows, part.column + column, part.values, part.high, part.scales,
                              part.mins, part.d, part.dmin, part.bias))
        column += linear.out_features
    return (Part * len(parts))(*parts)


def _maps(layer: nn.Module) -> list[list[nn.Module]] | None:
    """A decoder layer's maps as [q/k/v, o, gate/up, down] (each a list in output order), or None when one is not a
    KQuantLinear (another format, a LoRA wrapper)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
    groups = [qkv, [attn.o_proj], gate_up, [mlp.down_proj]]
    return groups if all(type(m) is KQuantLinear for group in groups for m in group) else None


def _norm_weight(norm: nn.Module) -> torch.Tensor | None:
    weight = getattr(norm, "weight", None)
    return None if weight is None else weight.detach().float().contiguous()


class FusedStep:
    """The native layers of one model (built once at load: `for_model`); `run` replaces the layers' torch forward."""

    def __init__(self, layers: nn.ModuleList, cfg, groups: list[list[list[KQuantLinear]]]):
        self.lib = _declare(library())
        self.dims = Dims(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.rms_norm_eps)
        self._keep: list = []  # what the tables point into
        self.layers = []
        for layer, group in zip(layers, groups):
            tables = [_table(maps) for maps in group]
            norms = [_norm_weight(layer.input_layernorm), _norm_weight(layer.post_attention_layernorm),
                     _norm_weight(layer.self_attn.q_norm), _norm_weight(layer.self_attn.k_norm)]
            self._keep += [tables, norms, group]
            self.layers.append(Layer(*(ctypes.addressof(t) for t in tables), *(len(t) for t in tables),
                                     *(None if n is None else n.data_ptr() for n in norms)))
        self.widest_input = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
        self.scratch_per_row = self.lib.scratch_bytes(1, self.widest_input) + 64

    @classmethod
    def for_model(cls, model: nn.Module) -> FusedStep | None:
        """The step for `model` (a Qwen3 in format gguf, float32), or None where it does not apply."""
        cfg = model.cfg
        if model.embed_tokens.weight.dtype != torch.float32 or cfg.head_dim % 8 or cfg.hidden_size % 8:
            return None
        groups = [_maps(layer) for layer in model.layers]
        if any(group is None for group in groups):
            return None
        return cls(model.layers, cfg, groups)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list) -> torch.Tensor:
        """x [T, hidden] float32 (the embeddings of the segments' tokens, packed), cos/sin [T, head_dim] -> the last
        layer's output [T, hidden]. Every segment has row_slots (Qwen3._packed); each writes its K/V."""
        x = x.contiguous()  # the embeddings, fresh: updated in place layer by layer
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        rows, _slot_tensors = self._rows(segments)  # (the tensors `rows` points into, alive until we return)
        m = x.shape[0]
        threads = torch.get_num_threads()
        max_count = max(row.count for row in rows)
        work = torch.empty(self.lib.layer_work_floats(m, ctypes.byref(self.dims)), dtype=torch.float32)
        scratch = torch.empty(m * self.scratch_per_row, dtype=torch.uint8)
        scores = torch.empty(threads * (max_count + 8), dtype=torch.float32)
        dims = ctypes.byref(self.dims)
        for index, layer in enumerate(self.layers):
            self.lib.layer_forward(x.data_ptr(), m, index, ctypes.byref(layer), dims, cos.data_ptr(), sin.data_ptr(),
                                   rows, threads, work.data_ptr(), scratch.data_ptr(), scores.data_ptr(), max_count)
        return x

    @staticmethod
    def _rows(segments: list) -> tuple[ctypes.Array, list]:
        """Each row's cache, write slot and visible slots, in packed order (and the slot tensors they point into)."""
        rows, keep = [], []
        for seg in segments:
            keys, values = seg.cache.keys, seg.cache.values
            if keys.dtype != torch.float32 or keys.stride(3) != 1 or keys.stride(2) != keys.shape[3]:
                raise ValueError("the native step needs a float32 cache with contiguous slots")
            if len(seg.row_slots) != seg.num_tokens:
                raise ValueError(f"a segment of {seg.num_tokens} tokens has a mask of {len(seg.row_slots)} rows")
            for i, (count, slots) in enumerate(seg.row_slots):
                pointer = None
                if slots is not None:
                    slots = slots.to(torch.int64).contiguous()
                    keep.append(slots)
                    pointer = slots.data_ptr()
                rows.append(RowAttention(keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
                                         seg.write_start + i, count, pointer))
        return (RowAttention * len(rows))(*rows), keep
