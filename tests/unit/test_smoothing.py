"""SmoothQuant smoothing for int8-per-token (evospec/model/smoothing.py): folding the scales leaves the dense model's
function unchanged, it moves activation outliers into the weights, and it lowers the W8A8 error they cause."""
from __future__ import annotations

import torch

from evospec.model.smoothing import activation_maxima, smooth, smoothing_scale
from evospec.model.weight_formats import quantize_weights
from evospec.testing import random_qwen3, tiny_config

SEQUENCES = [list(range(3, 40)), [5, 9, 11, 2, 7, 7, 30, 41, 60, 12, 8]]


def _model_with_outlier_channels(seed: int = 0):
    """The tiny model with a few hidden channels 30x larger in every norm's output (LLMs' outlier channels)."""
    model = random_qwen3(tiny_config(hidden=64), seed)
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17]] *= 30
    return model


@torch.inference_mode()
def _logits(model, ids):
    return model.full_logits(model.forward_train(torch.tensor(ids)))


def test_recording_maxima_leaves_the_model_as_it_was():
    model = _model_with_outlier_channels()
    before = _logits(model, SEQUENCES[0])
    maxima = activation_maxima(model, SEQUENCES)
    assert set(maxima) == {f"layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    assert maxima["layers.0.self_attn.q_proj"].shape == (64,)
    assert maxima["layers.0.mlp.down_proj"].shape == (128,)
    assert int(maxima["layers.0.self_attn.q_proj"].argmax()) in (3, 17)
    assert all(type(m).__name__ == "Linear" for layer in model.layers for m in layer.mlp.children())
    assert torch.equal(_logits(model, SEQUENCES[0]), before)


def test_smoothing_keeps_the_dense_model_function():
    model = _model_with_outlier_channels()
    before = _logits(model, SEQUENCES[1])
    maxima = activation_maxima(model, SEQUENCES)
    smooth(model, maxima)
    after = _logits(model, SEQUENCES[1])
    assert torch.allclose(after, before, atol=1e-4, rtol=1e-4)
    # the outlier channels left the activations (30x the median -> about its square root, alpha 0.5)
    name = "layers.1.self_attn.q_proj"
    after, before = activation_maxima(model, SEQUENCES)[name], maxima[name]
    assert float(after.max() / after.median()) < float(before.max() / before.median()) / 3


def test_scale_balances_activation_and_weight_maxima():
    act = torch.tensor([100.0, 1.0, 4.0])
    weight = torch.tensor([[1.0, 1.0, 0.25], [0.5, -1.0, 0.0]])
    s = smoothing_scale(act, [weight])
    # after smoothing, max|X_j| / s_j == max|W_j| * s_j (alpha 0.5): both operands share the range
    assert torch.allclose(act / s, weight.abs().amax(dim=0) * s)


def test_smoothing_lowers_the_per_token_error_of_outlier_channels():
    reference = _model_with_outlier_channels()
    ids = SEQUENCES[0]
    exact = _logits(reference, ids)

    def error(smoothed: bool) -> float:
        model = _model_with_outlier_channels()
        if smoothed:
            smooth(model, activation_maxima(model, SEQUENCES))
        quantize_weights(model, "int8-per-token")
        return float((_logits(model, ids) - exact).norm() / exact.norm())

    assert error(smoothed=True) < 0.7 * error(smoothed=False)
