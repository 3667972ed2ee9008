"""Which kernel the model's float linears run on, and the swap to packed weights at load.

`linear_kernel` (a setting): `aten` is `F.linear` on the plain weight; `onednn` packs every
float linear once at load (`executor.models.onednn_linear`, `layers.PackedLinear`), the LM head included
(a tied head gets a packed copy of the embedding's rows: the embedding lookup keeps its plain
table, so a tied model holds that matrix twice); `auto` is `onednn` wherever it can run (CPU,
float32, torch with mkldnn) and `aten` elsewhere. Quantized layers keep their own kernels;
only the float linears left beside them (int8/int4's float head) are packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor.config import LINEAR_KERNELS
from executor.models.layers import Embedding, Linear, PackedLinear
from executor.models.onednn_linear import packing_refusal


@dataclass(frozen=True)
class LinearKernelChoice:
    kernel: str  # onednn | aten
    reason: str  # why (what `auto` saw, or "configured")


def choose_linear_kernel(
    requested: str, device: torch.device, dtype: torch.dtype
) -> LinearKernelChoice:
    """Resolve `requested` for weights of `dtype` on `device`; `onednn` where it cannot run
    is refused with the reason."""
    if requested not in LINEAR_KERNELS:
        raise ValueError(
            f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {requested!r}"
        )
    refusal = packing_refusal(device, dtype)
    if requested == "onednn" and refusal is not None:
        raise ValueError(f"linear_kernel=onednn: {refusal}")
    if requested == "auto":
        if refusal is None:
            return LinearKernelChoice("onednn", "auto: float32 weights on a CPU with oneDNN")
        return LinearKernelChoice("aten", f"auto: {refusal}")
    return LinearKernelChoice(requested, "configured")


def pack_float_linears(model: nn.Module) -> int:
    """Swap every float `Linear` under `model` for a `PackedLinear`, and give a tied head
    (`lm_head` None beside a float `Embedding`) a packed copy; -> how many were packed."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear.from_linear(child))
    packed = len(swaps)
    embed = getattr(model, "embed_tokens", None)
    if hasattr(model, "lm_head") and model.lm_head is None and isinstance(embed, Embedding):
        model.lm_head = PackedLinear(embed.weight, None)
        packed += 1
    return packed
