"""SmoothQuant smoothing (Xiao et al., 2023) for the `int8-per-token` weight format: move the activations' outlier
channels into the weights before both are quantized to int8.

Why: under W8A8 dynamic per-token, one row's int8 scale is its largest |x|; a few input channels of an LLM's
projections carry values 10-100x the rest, so the other channels keep only a few bits. Dividing input channel j by
s_j and multiplying the weight's column j by s_j computes exactly the same product in real arithmetic and balances
the two quantization errors: s_j = max|X_j|^α / max|W_j|^(1-α), α = 0.5 (the paper's choice for most models).

The division is folded into the op that produces the projection's input, so nothing is added to a forward:
- q/k/v (input: `input_layernorm`): the norm's weight / s; the three weights share one s (their max |W| together);
- gate/up (input: `post_attention_layernorm`): likewise;
- down (input: silu(gate) * up): up_proj's rows / s (the product is linear in up);
- o (input: attention's weighted sum of v): v_proj's rows and bias / s. Under grouped-query attention one v head
  feeds several query heads' slots of o's input, so s is shared across a group (max over its heads).

max|X_j| is calibrated once per model on a few texts (the dense model's projection inputs) and kept beside the model
(`calibration/smoothquant.safetensors`, keyed by α and the texts' hash); a read-only model folder calibrates again
at each load (~12 s for a 1.5B model on 2 cores). The served target is the smoothed, quantized model: `ar`
and speculation both run it, so losslessness is unchanged (greedy speculation is that model's own output).
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from evospec.model.qwen3 import Qwen3, plain_projections

log = logging.getLogger(__name__)

ALPHA = 0.5
CALIBRATION_TOKENS = 384  # per text (each text is cut to this many tokens)
CALIBRATION_TEXTS = 6  # texts in all: code stubs (always present) and PubMedQA training abstracts (when present)
SAVED = "calibration/smoothquant.safetensors"  # a subfolder: the loader reads every *.safetensors of the model's
MIN_SCALE = 1e-5


def calibration_texts() -> list[str]:
    """Texts whose activations set the scales: standard-library function stubs (signature + docstring; present on
    every machine) and, when ../shared/data is there, PubMedQA abstracts of the training split (never the held-out
    items the benchmarks and perplexity use)."""
    from evospec.datasets import code_stub, code_stubs, split_pubmedqa
    texts = [code_stub(*entry) for entry in code_stubs()[:CALIBRATION_TEXTS // 2]]
    try:
        train, _ = split_pubmedqa()
        texts += [" ".join(item["contexts"]) for item in train[:CALIBRATION_TEXTS - len(texts)]]
    except (OSError, ValueError):
        texts += [code_stub(*entry) for entry in code_stubs()[len(texts):CALIBRATION_TEXTS]]
    return texts


class _Recorder(nn.Module):
    """A projection that also keeps max |input| per input channel (`project` calls a plain nn.Linear's weight
    directly, so forward hooks on it would not fire)."""

    def __init__(self, layer: nn.Linear, maxima: dict[str, torch.Tensor], name: str):
        super().__init__()
        self.layer, self.maxima, self.name = layer, maxima, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
        previous = self.maxima.get(self.name)
        self.maxima[self.name] = seen if previous is None else torch.maximum(previous, seen)
        return self.layer(x)


@torch.inference_mode()
def activation_maxima(model: Qwen3, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """{projection name: max |input| per input channel (float32)} over every token of `sequences`, dense model."""
    maxima: dict[str, torch.Tensor] = {}
    parents = plain_projections(model)
    for name, (parent, attr) in parents.items():
        setattr(parent, attr, _Recorder(getattr(parent, attr), maxima, name))
    try:
        for ids in sequences:
            model.forward_train(torch.tensor(ids))
    finally:
        for parent, attr in parents.values():
            setattr(parent, attr, getattr(parent, attr).layer)
    return maxima


def smoothing_scale(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float = ALPHA) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α) over the columns j of the weights that read the same input."""
    weight_max = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    scale = act_max.clamp(min=MIN_SCALE).pow(alpha) / weight_max.clamp(min=MIN_SCALE).pow(1 - alpha)
    return scale.clamp(min=MIN_SCALE)


def _scale_columns(layer: nn.Linear, scale: torch.Tensor) -> None:
    layer.weight.data.mul_(scale.to(layer.weight.dtype))  # in place, in the model's dtype (quantized right after)


def _divide_rows(layer: nn.Linear, scale: torch.Tensor) -> None:
    layer.weight.data.div_(scale[:, None].to(layer.weight.dtype))
    if layer.bias is not None:
        layer.bias.data.div_(scale.to(layer.bias.dtype))


def _divide_norm(norm: nn.Module, scale: torch.Tensor) -> None:
    norm.weight.data = (norm.weight.data.float() / scale).to(norm.weight.dtype)


def smooth(model: Qwen3, maxima: dict[str, torch.Tensor], alpha: float = ALPHA) -> None:
    """Fold the smoothing scales into `model` in place (dense weights; quantize afterwards). See the module doc."""
    cfg = model.cfg
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        s = smoothing_scale(maxima[f"layers.{i}.self_attn.q_proj"], [p.weight for p in qkv], alpha)
        _divide_norm(layer.input_layernorm, s)
        for proj in qkv:
            _scale_columns(proj, s)
        s = smoothing_scale(maxima[f"layers.{i}.mlp.gate_proj"], [mlp.gate_proj.weight, mlp.up_proj.weight], alpha)
        _divide_norm(layer.post_attention_layernorm, s)
        _scale_columns(mlp.gate_proj, s)
        _scale_columns(mlp.up_proj, s)
        s = smoothing_scale(maxima[f"layers.{i}.mlp.down_proj"], [mlp.down_proj.weight], alpha)
        _divide_rows(mlp.up_proj, s)
        _scale_columns(mlp.down_proj, s)
        # o's input slot (head h, dim d) is v head h // group's dim d: one scale per (kv head, d).
        shape = (cfg.num_key_value_heads, group, cfg.head_dim)
        act = maxima[f"layers.{i}.self_attn.o_proj"].reshape(shape).amax(dim=1)
        weight = attn.o_proj.weight.detach().abs().amax(dim=0).float().reshape(shape).amax(dim=1)
        s_kv = (act.clamp(min=MIN_SCALE).pow(alpha) / weight.clamp(min=MIN_SCALE).pow(1 - alpha)).clamp(min=MIN_SCALE)
        _divide_rows(attn.v_proj, s_kv.reshape(-1))
        _scale_columns(attn.o_proj, s_kv.repeat_interleave(group, dim=0).reshape(-1))


def calibration_sequences(folder: Path) -> list[list[int]]:
    """The calibration texts as the model's token ids, each cut to CALIBRATION_TOKENS."""
    from evospec.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(str(folder))
    return [tokenizer.encode(text)[:CALIBRATION_TOKENS] for text in calibration_texts()]


def _key(sequences: list[list[int]], alpha: float) -> str:
    return hashlib.sha256(repr((alpha, sequences)).encode()).hexdigest()[:16]


def calibrated_maxima(model: Qwen3, folder: Path, alpha: float = ALPHA, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's activation maxima: kept beside it when they match the calibration texts, else measured now (and
    kept, when `keep` and the folder is writable)."""
    sequences = calibration_sequences(folder)
    key = _key(sequences, alpha)
    saved = folder / SAVED
    if saved.exists():
        from safetensors import safe_open
        with safe_open(str(saved), "pt") as f:
            if (f.metadata() or {}).get("key") == key:
                return load_file(str(saved))
    log.info("calibrating int8-per-token smoothing on %d texts (%d tokens), once per model",
             len(sequences), sum(map(len, sequences)))
    maxima = activation_maxima(model, sequences)
    if not keep:
        return maxima
    try:
        saved.parent.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in maxima.items()}, str(saved), metadata={"key": key})
    except OSError:  # a read-only model folder: calibrate again next time
        pass
    return maxima


def smooth_for_per_token(model: Qwen3, folder: Path | None, keep: bool = True) -> bool:
    """Smooth `model` for int8-per-token from its folder's calibration (its tokenizer, else the Qwen3 one); False
    (unsmoothed, logged) for a model without a folder. keep: save the calibration beside the model (not for the
    embedded tiny pair, whose folder is the package's)."""
    if folder is None:
        log.info("int8-per-token without a model folder: no calibration texts, weights not smoothed")
        return False
    smooth(model, calibrated_maxima(model, Path(folder), keep=keep))
    return True
