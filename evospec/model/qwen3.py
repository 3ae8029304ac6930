"""A compact Qwen-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU) for speculative decoding: Qwen3 and Qwen2.

The two architectures differ in three places, all read from config.json (`model_type`): Qwen3 normalizes q and k per
head (q_norm/k_norm) and has no attention biases; Qwen2 (Qwen2.5, Qwen2.5-Coder) has biases on the q/k/v projections
and no q/k norm. Whether the LM head is tied to the embeddings comes from `tie_word_embeddings` (Qwen3 small models:
tied; Qwen2.5-Coder 0.5B/1.5B: untied). Unlike `transformers.Qwen3ForCausalLM`, `forward` takes explicit slots,
positions and a boolean attention mask, so one call can decode a token tree, and returns hidden states so the caller
chooses the LM head (full or pruned). It loads standard Hugging Face folders (config.json + *.safetensors). No
device is hard-coded.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from evospec.kernels.fused_step import FusedStep
from evospec.kernels.kv import compact_kv
from evospec.kernels.linear import project
from evospec.kernels.pruned_head import head_product
from evospec.kernels.tree import chain_then_tree_mask

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False  # biases on q/k/v (Qwen2: always)
    qk_norm: bool = True  # per-head RMSNorm of q and k (Qwen3)
    tie_word_embeddings: bool = True
    eos_token_id: int = 151645

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "Qwen3Config":
        model_type = cfg.get("model_type", "qwen3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; this runner serves "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        qwen2 = model_type == "qwen2"
        rope = cfg.get("rope_parameters") or {}
        eos = cfg.get("eos_token_id", 151645)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
            attention_bias=True if qwen2 else cfg.get("attention_bias", False),
            qk_norm=not qwen2,
            tie_word_embeddings=cfg.get("tie_word_embeddings", not qwen2),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions: [n] -> cos, sin: [n, head_dim] (the 'rotate half' layout Qwen3 uses)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, head_dim]; cos/sin: [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Position-indexed cache of one sequence: keys/values [layers, kv_heads, max_len, head_dim]; `length` committed
    slots. Its own tensors, or a view of a shared `KVArena` region (the batching scheduler's sessions).

    Slots >= length are scratch (a tree being decoded); `commit` keeps the chosen scratch slots, compacted.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.max_len = keys.shape[2]
        self.length = 0
        self.arena_start: int | None = None  # set when the cache is a view of a KVArena region

    @classmethod
    def allocate(cls, cfg: Qwen3Config, max_len: int, device: torch.device, dtype: torch.dtype) -> "KVCache":
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def commit(self, scratch_slots: list[int]) -> None:
        """Append the given scratch slots (absolute, increasing, all >= length) to the committed prefix. Slots already
        in place (an accepted chain right after the prefix) are not copied."""
        if not scratch_slots:
            return
        first_moved = next((i for i, s in enumerate(scratch_slots) if s != self.length + i), len(scratch_slots))
        if first_moved < len(scratch_slots):
            src = torch.tensor(scratch_slots[first_moved:], dtype=torch.long, device=self.keys.device)
            compact_kv(self.keys, src, self.length + first_moved)
            compact_kv(self.values, src, self.length + first_moved)
        self.length += len(scratch_slots)

    def advance(self, n: int) -> None:
        """Mark the n slots after the committed prefix (just written by a chain forward) as committed."""
        self.length += n

    def move_to_scratch(self, slots: list[int]) -> None:
        """Move the given scratch slots (increasing, slots[i] >= length + i) to the scratch right after the
        committed prefix, in order, without committing them (a pre-drafted tree taking a drafted tree's place)."""
        if slots:
            src = torch.tensor(slots, dtype=torch.long, device=self.keys.device)
            compact_kv(self.keys, src, self.length)
            compact_kv(self.values, src, self.length)


@dataclass
class Segment:
    """One sequence's share of a packed forward: `n` new tokens written at slots write_start..+n of its cache."""
    cache: KVCache
    input_ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    mask: torch.Tensor  # [n, write_start + n] bool over the cache's slots, True = may attend
    write_start: int
    # Set by a forward with row-invariant attention: per row, the slots it attends, as (count, None) for the first
    # `count` slots or (count, slot ids) for a tree row's scattered ancestors (visible_slots).
    row_slots: list[tuple[int, torch.Tensor | None]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def chain(cls, cache: KVCache, token_ids: list[int]) -> Segment:
        """`token_ids` as a causal chain right after the cache's filled slots (a prefill chunk, a draft's feed)."""
        start, n = cache.length, len(token_ids)
        return cls(cache, torch.tensor(token_ids, dtype=torch.long), torch.arange(start, start + n),
                   chain_then_tree_mask(start, n, None), start)

    @classmethod
    def prefill(cls, cache: KVCache, tokens: list[int], n: int) -> Segment:
        """The next `n` tokens of the sequence `tokens` not in `cache` yet, never its last one (pending: the next
        tree's feed or verification starts from it). ValueError when fewer than `n` remain."""
        remaining = len(tokens) - 1 - cache.length
        if not 0 < n <= remaining:
            raise ValueError(f"prefill of {n} tokens; {remaining} remain")
        return cls.chain(cache, tokens[cache.length:cache.length + n])


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.qkv_proj: nn.Module | None = None  # q, k and v as one map (a fused weight format), else None
        self.qkv_widths = (nh * hd, nkv * hd, nkv * hd)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return project(self.qkv_proj, x).split(self.qkv_widths, dim=-1)
        return project(self.q_proj, x), project(self.k_proj, x), project(self.v_proj, x)

    def forward(self, x, cos, sin, layer: int, segments: list[Segment] | None) -> torch.Tensor:
        """x: [T, hidden], the segments' tokens packed in order; cos/sin: [T, head_dim]. Projections run over all T
        rows at once (the weight-bound part); attention runs per segment over its own cache (layer `layer`), where
        each segment's K/V are written in place first. segments None: x is one sequence, attended causally."""
        t = x.shape[0]
        hd = self.cfg.head_dim
        q, k, v = self.project_qkv(x)
        q = self.q_norm(q.reshape(t, -1, hd)).transpose(0, 1)  # [heads, T, hd]
        k = self.k_norm(k.reshape(t, -1, hd)).transpose(0, 1)  # [kv_heads, T, hd]
        v = v.reshape(t, -1, hd).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if segments is None:  # training forward: one causal sequence, no cache
            out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                                 enable_gqa=True)[0]  # [heads, T, hd]
            return project(self.o_proj, out.transpose(0, 1).reshape(t, -1))
        outputs, offset = [], 0
        for seg in segments:
            n, start = seg.num_tokens, seg.write_start
            end = start + n
            keys, values = seg.cache.keys[layer], seg.cache.values[layer]  # [kv_heads, max_len, hd]
            keys[:, start:end] = k[:, offset:offset + n]
            values[:, start:end] = v[:, offset:offset + n]
            if seg.row_slots is not None:
                outputs.append(attend_row_by_row(q[:, offset:offset + n], keys, values, seg.row_slots))
            else:
                outputs.append(F.scaled_dot_product_attention(
                    q[:, offset:offset + n].unsqueeze(0), keys[:, :end].unsqueeze(0), values[:, :end].unsqueeze(0),
                    attn_mask=seg.mask, enable_gqa=True)[0])  # [heads, n, hd]
            offset += n
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # [heads, T, hd]
        return project(self.o_proj, out.transpose(0, 1).reshape(t, -1))


ROW_INVARIANT_MAX_ROWS = 64  # segments up to this many rows (decodes, verifies) attend row by row when asked


def visible_slots(mask: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """mask [n, slots] -> per row (count, None) when the row attends exactly its first `count` slots (a decode, a
    chain), else (count, the slot ids it attends, increasing) (a tree row: the prefix and its ancestors)."""
    counts = mask.sum(dim=1)
    leading = mask.int().cumprod(dim=1).sum(dim=1)
    return [(int(c), None if int(c) == int(lead) else mask[i].nonzero()[:, 0])
            for i, (c, lead) in enumerate(zip(counts.tolist(), leading.tolist()))]


def attend_one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query row's attention, q [heads, 1, hd] over keys/values [kv_heads, n, hd] (grouped: query head h reads
    kv head h // (heads / kv_heads)), computed in float32 with two batched products and a softmax. Why not SDPA:
    torch's CPU flash kernel takes ~0.4 ms for one bf16 query over 300 keys (1.3 ms over 1000; 28 layers per
    token), where this takes ~0.05 (0.12) ms (2-core Zen 4, torch 2.13; docs/results.md). Returns [heads, 1, hd]
    in q's dtype."""
    heads, _, hd = q.shape
    kv_heads = keys.shape[0]
    grouped = q.reshape(kv_heads, heads // kv_heads, hd).float()
    scores = torch.bmm(grouped, keys.float().transpose(1, 2)).mul_(hd ** -0.5)  # [kv_heads, group, n]
    out = torch.bmm(torch.softmax(scores, dim=-1), values.float())
    return out.to(q.dtype).reshape(heads, 1, hd)


def attend_row_by_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      row_slots: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """Row-invariant attention: q [heads, n, hd] over one cache layer's keys/values [kv_heads, slots, hd], each row
    one `attend_one_query` over exactly the slots it sees, in slot order (contiguous float32 copies, so a row's
    operands have the same values and layout as the decode of its token would). A one-token decode is the same
    call, so a verify row gets bitwise the output the decode of that token would (a many-row SDPA rounds
    differently: its kernel blocks queries and keys by the call's shape). Returns [heads, n, hd]."""
    rows = []
    for i, (count, slots) in enumerate(row_slots):
        k = keys[:, :count] if slots is None else keys[:, slots]
        v = values[:, :count] if slots is None else values[:, slots]
        rows.append(attend_one_query(q[:, i:i + 1], k, v))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one map (a fused weight format), else None

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = project(self.gate_up_proj, x).chunk(2, dim=-1)
        else:
            gate, up = project(self.gate_proj, x), project(self.up_proj, x)
        return project(self.down_proj, F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layer: int, segments: list[Segment]):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, segments)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.pad_single_token = False  # see forward; set by calibrate_single_token_padding
        self.head: nn.Module | None = None  # a quantized LM head for full_logits (model/weight_formats.py)
        self.weight_format = "none"  # model.quantize as resolved at load
        self.weight_format_seconds: dict[str, float] = {}  # what `auto` measured per candidate
        # Decode and verify segments attend row by row (attend_row_by_row), so a verify's logits are bitwise the
        # decodes' when every linear map is row-invariant too (model/weight_formats.py sets it for such formats).
        self.row_invariant_attention = False
        # One native call per layer for short segments in format gguf (kernels/fused_step.py; set at load by
        # model/weight_formats.py, dropped when LoRA wraps the maps), else None: torch's layers.
        self.fused_step: FusedStep | None = None

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the embedding matrix when tied (Qwen3 small models), else the LM head."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache.allocate(self.cfg, max_len, p.device, p.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor,
                write_start: int | None = None) -> torch.Tensor:
        """input_ids, positions: [n]; writes K/V at slots write_start..+n (default: right after the committed
        prefix); mask: [n, write_start + n] bool over cache slots.

        Returns final-norm hidden states [n, hidden]. The caller applies a head (full or pruned) and commits slots.
        """
        write_start = cache.length if write_start is None else write_start
        return self.forward_packed([Segment(cache, input_ids, positions, mask, write_start)])

    @torch.inference_mode()
    def forward_packed(self, segments: list[Segment]) -> torch.Tensor:
        """Several sequences in one forward (continuous batching): their tokens packed into T rows, each attending
        only to its own cache through its own mask. Returns final-norm hidden states [T, hidden] in segment order."""
        if self.pad_single_token and len(segments) == 1 and segments[0].num_tokens == 1:
            seg = segments[0]
            if seg.write_start + 2 <= seg.cache.max_len:
                # One token run as two identical rows: on some CPUs a 1-row bf16 matmul takes a much slower path
                # than a 2-row one (measured: 206 vs 149 ms per Qwen2.5-1.5B forward here). Row 1 repeats row 0 and
                # sees the same slots, so row 0 is unchanged; its K/V lands in the scratch slot after the token,
                # which nothing reads before a later write replaces it.
                mask = torch.zeros(2, seg.write_start + 2, dtype=torch.bool, device=seg.mask.device)
                mask[:, : seg.write_start + 1] = seg.mask[0]
                padded = Segment(seg.cache, seg.input_ids.repeat(2), seg.positions.repeat(2), mask, seg.write_start)
                return self._packed([padded])[:1]
        return self._packed(segments)

    def _packed(self, segments: list[Segment]) -> torch.Tensor:
        device = self.embed_tokens.weight.device
        for seg in segments:
            if seg.write_start + seg.num_tokens > seg.cache.max_len:
                raise ValueError(f"KV cache overflow: {seg.write_start + seg.num_tokens} > {seg.cache.max_len} slots")
            seg.mask = seg.mask.to(device)
        short = [seg.num_tokens <= ROW_INVARIANT_MAX_ROWS for seg in segments]
        if self.fused_step is None or all(short) or not any(short):
            return self._run_layers(segments, native=self.fused_step is not None and all(short))
        # Short segments (decodes, verifies) beside a long one (a prefill chunk): the short ones run the native step,
        # the long ones torch's layers, as two forwards, so every row gets what it would get alone (a decode's
        # numerics must not depend on what it is packed with; the weights are read twice, ~1% of such a step).
        rows = {}  # native? -> each of that group's segments' rows, in order
        for native in (True, False):
            group = [seg for seg, ok in zip(segments, short) if ok == native]
            rows[native] = iter(self._run_layers(group, native).split([seg.num_tokens for seg in group]))
        return torch.cat([next(rows[ok]) for ok in short])

    def _run_layers(self, segments: list[Segment], native: bool) -> torch.Tensor:
        """The segments' final-norm hidden states [T, hidden], through the native step or torch's layers."""
        device = self.embed_tokens.weight.device
        for seg in segments:
            if native or (self.row_invariant_attention and seg.num_tokens <= ROW_INVARIANT_MAX_ROWS):
                seg.row_slots = visible_slots(seg.mask)
        input_ids = torch.cat([seg.input_ids for seg in segments]).to(device)
        positions = torch.cat([seg.positions for seg in segments]).to(device)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        if native:
            return self.norm(self.fused_step.run(x, cos, sin, segments))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, segments)
        return self.norm(x)

    def forward_train(self, input_ids: torch.Tensor, layers: nn.ModuleList | None = None, start_layer: int = 0,
                      hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Training forward of one sequence (no cache, causal mask, autograd as the caller's mode allows):
        input_ids [n] -> final-norm hidden states [n, hidden]. Positions start at 0 (RoPE is relative, so a window
        cut from a longer context attends the same way). layers: decoder layers to use instead of the model's own
        (the full-parameter learner's trainable copy, possibly in another dtype). start_layer + hidden
        [n, hidden]: resume from the input of layer `start_layer` (what `forward_layers(..., end=start_layer)`
        returned), so frozen layers below the adapted ones run once per example."""
        layers = self.layers if layers is None else layers
        return self.norm(self._causal_layers(input_ids, layers, start_layer, len(layers), hidden))

    @torch.no_grad()
    def forward_layers(self, input_ids: torch.Tensor, end: int) -> torch.Tensor:
        """The input of layer `end` for one sequence (layers 0..end-1, causal, no cache): [n] -> [n, hidden]."""
        return self._causal_layers(input_ids, self.layers, 0, end, None)

    def _causal_layers(self, input_ids: torch.Tensor, layers: nn.ModuleList, start: int, end: int,
                       hidden: torch.Tensor | None) -> torch.Tensor:
        """layers[start:end] over one sequence from position 0, causal, no cache; their input is `hidden`
        [n, hidden] or, when None, the embeddings of input_ids [n]. Runs in the layers' dtype."""
        device = self.embed_tokens.weight.device
        dtype = layers[start].input_layernorm.weight.dtype if start < end else self.embed_tokens.weight.dtype
        cos, sin = rope_cos_sin(torch.arange(input_ids.shape[0], device=device), self.cfg.head_dim,
                                self.cfg.rope_theta, dtype)
        x = self.embed_tokens(input_ids.to(device=device, dtype=torch.long)) if hidden is None else hidden.to(device)
        x = x.to(dtype)
        for i in range(start, end):
            x = layers[i](x, cos, sin, i, None)
        return x

    @torch.inference_mode()
    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab] float32 (through the quantized head when the format has one)."""
        if self.head is not None:
            return self.head(hidden).float()
        return head_product(hidden, self.head_weight).float()


def read_config(folder: str | Path) -> Qwen3Config:
    """The model's configuration from a Hugging Face folder's config.json (no weights read)."""
    config_path = Path(folder) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder: config.json missing")
    return Qwen3Config.from_hf_dict(json.loads(config_path.read_text()))


def load_qwen3(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               skip: Collection[str] = ()) -> Qwen3:
    """Load a Hugging Face Qwen3 or Qwen2 folder (config.json + one or more *.safetensors). skip: parameter names
    ("layers.3.mlp.down_proj.weight") not read: they stay on the meta device for a weight format to replace (the
    projections `gguf` takes from the source GGUF's own blocks), so their dense copies cost neither time nor memory."""
    folder = Path(folder)
    cfg = read_config(folder)
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.device("meta"):
        model = Qwen3(cfg)
    state: dict[str, torch.Tensor] = {}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    skip = set(skip)
    for shard in shards:
        with safe_open(str(shard), framework="pt", device=str(device)) as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open's handle is no mapping
                key = name.removeprefix("model.")
                if (key == "lm_head.weight" and cfg.tie_word_embeddings) or key in skip:
                    continue
                state[key] = tensors.get_tensor(name).to(dtype)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state) - skip, set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{folder}: weights missing for {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, assign=True, strict=False)
    return model.eval().requires_grad_(False)


def plain_projections(model: Qwen3) -> dict[str, tuple[nn.Module, str]]:
    """{projection name ("layers.3.mlp.down_proj"): (its parent module, attribute)} for every decoder projection
    still a plain nn.Linear (not yet fused, quantized or wrapped): what the weight formats and smoothing replace."""
    return {f"layers.{i}.{part}.{name}": (parent, name) for i, layer in enumerate(model.layers)
            for part, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp))
            for name, module in parent.named_children() if type(module) is nn.Linear}


def quantize_int8(model: Qwen3) -> Qwen3:
    """Dynamic int8 quantization of the decoder layers' linear maps (weights int8, activations float32; CPU).

    For a draft model only: its output is a proposal the target verifies, so losslessness does not depend on it, and
    on a memory-bound CPU a 4x smaller weight read makes each draft forward about 3x faster (docs/results.md). The
    embeddings and the LM head stay float32, because the pruned FR-Spec/EvoSpec heads are gathered from them.
    torch (2.13, pinned) marks its quantized-tensor API deprecated in favour of torchao; the warning is silenced here.
    """
    if model.embed_tokens.weight.dtype != torch.float32 or model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("int8 quantization needs a float32 model on the CPU (load it with dtype float32)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantize.*deprecated", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.ao.quantization.quantize_dynamic(model.layers, {nn.Linear}, dtype=torch.qint8, inplace=True)
    model.weight_format = "int8"
    return model


@torch.inference_mode()
def forward_seconds(model: Qwen3, sizes=(1, 2), context: int = 32, repeats: int = 3,
                    with_head: bool = False) -> dict[int, float]:
    """Seconds of one forward of n new tokens after a `context`-token prefix, per n in `sizes` (the kernel's own
    cost: single-token padding is off while measuring; `with_head` adds the full LM head). One untimed round first
    (first calls of a shape choose and warm kernels up), then `repeats` rounds over all sizes, interleaved, and the
    fastest of each: another process busy on the same cores only ever slows a forward down, and interleaving keeps
    a busy spell from skewing one size against another (the budget compares sizes). On a GPU each forward is
    timed to its end (the device synchronised), not to its launch."""
    import time

    padding, model.pad_single_token = model.pad_single_token, False
    try:
        vocab = model.cfg.vocab_size
        cache = model.new_cache(context + max(sizes))
        model(torch.arange(context) % vocab, torch.arange(context), cache, chain_then_tree_mask(0, context, None))
        cache.advance(context)
        cost = {n: float("inf") for n in sizes}
        device = model.embed_tokens.weight.device
        for round_ in range(repeats + 1):
            for n in sizes:
                synchronize(device)
                t0 = time.perf_counter()
                hidden = model(torch.arange(n) % vocab, torch.arange(context, context + n), cache,
                               chain_then_tree_mask(context, n, None))
                if with_head:
                    model.full_logits(hidden)
                synchronize(device)
                if round_:
                    cost[n] = min(cost[n], time.perf_counter() - t0)
        return cost
    finally:
        model.pad_single_token = padding


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing on a GPU); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate_single_token_padding(model: Qwen3) -> bool:
    """Pad single tokens to two rows when one forward of 2 new tokens is >10% faster than of 1 (CPU only: a kernel
    property of the machine and dtype, so it is measured at load, never assumed). Returns the choice."""
    model.pad_single_token = False
    if model.embed_tokens.weight.device.type != "cpu":
        return False
    cost = forward_seconds(model)
    model.pad_single_token = cost[2] < 0.9 * cost[1]
    return model.pad_single_token
