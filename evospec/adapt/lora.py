"""LoRA on our own runner: adapters y = base(x) + (x Aᵀ) Bᵀ on the decoder's projections.

Why our own layer rather than `peft`: peft wraps `nn.Linear` (and a few quantization libraries' layers), but the
shipped CPU draft runs torch.ao dynamic int8 Linear modules, which peft does not know and which have no derivative
w.r.t. their input; and serving needs two adapter sets at once (the published version every draft step reads, the
trainable one the background worker updates), chosen per thread. The layer below is those three ideas in 60 lines.

`AdapterBank` holds the published table {module name: (A [r, in], B [out, r] with the scale folded in)} that serving
reads, and a per-thread override the training worker sets for its own forwards; publishing a version is one
reference assignment made between draft steps (DraftEngine holds its step lock), so a forward never mixes versions.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

AdapterTable = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])


class AdapterBank:
    def __init__(self):
        self.serving: AdapterTable | None = None
        self._local = threading.local()

    def lookup(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        table = getattr(self._local, "table", None)
        if table is None:
            table = self.serving
        return None if table is None else table.get(name)

    @contextmanager
    def training(self, table: AdapterTable) -> Iterator[None]:
        """Forwards on this thread use `table` (the trainable adapters) instead of the published version."""
        self._local.table = table
        try:
            yield
        finally:
            self._local.table = None


class _FrozenInt8Linear(torch.autograd.Function):
    """y = base(x) through a quantized Linear (dynamic int8 or weight-only), whose op has no derivative: the backward multiplies by the
    dequantized weight, built for that one call (one layer's float weight alive at a time)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: nn.Module) -> torch.Tensor:
        ctx.base = base
        with torch.no_grad():
            return base(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights = getattr(ctx.base, "dequantized", None)  # weight-only maps (kernels/quantized.py)
        weight = weights() if weights is not None else ctx.base.weight().dequantize()  # [out, in]
        return grad @ weight.to(grad.dtype), None


def frozen_linear(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(base, nn.Linear) or not (torch.is_grad_enabled() and x.requires_grad):
        return base(x)
    return _FrozenInt8Linear.apply(x, base)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, name: str, bank: AdapterBank):
        super().__init__()
        self.base, self.name, self.bank = base, name, bank
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        y = frozen_linear(self.base, x)
        pair = self.bank.lookup(self.name)
        if pair is None:
            return y
        a, b = pair
        return y + ((x.to(a.dtype) @ a.t()) @ b.t()).to(y.dtype)


def first_adapted_layer(num_layers: int, layers: int) -> int:
    """Index of the first decoder layer that gets adapters when the last `layers` do (0 = all)."""
    return 0 if layers == 0 else max(0, num_layers - layers)


def install_lora(model: nn.Module, modules: tuple[str, ...], layers: int = 0
                 ) -> tuple[AdapterBank, dict[str, LoRALinear]]:
    """Wrap the named projections (q_proj ... down_proj) of the last `layers` decoder layers (0 = all) in place;
    returns the bank and the wrapped layers by their full names (layers.3.self_attn.q_proj)."""
    bank = AdapterBank()
    wrapped: dict[str, LoRALinear] = {}
    first = first_adapted_layer(len(model.layers), layers)
    for index in range(first, len(model.layers)):
        for parent_name, parent in list(model.layers[index].named_modules(prefix=f"layers.{index}")):
            for child_name, child in list(parent.named_children()):
                if child_name in modules and not isinstance(child, LoRALinear):
                    name = f"{parent_name}.{child_name}"
                    wrapped[name] = LoRALinear(child, name, bank)
                    setattr(parent, child_name, wrapped[name])
    if not wrapped:
        raise ValueError(f"no decoder projection named {modules} to adapt")
    if getattr(model, "fused_step", None) is not None:
        model.fused_step = None  # the native step reads the maps' own weights; the adapters run in torch's layers
    return bank, wrapped
