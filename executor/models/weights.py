"""Load a Hugging Face-named state dict into our fused layout (QKV and gate/up concatenated).

Every loader (GGUF, HF directory, tiny-random) produces tensors under Hugging Face names;
this module is the one place that knows how they map onto our modules.

A tensor-parallel model (`model.plan` of size > 1) takes only its rank's part of each
tensor (`ShardPlan.take`); a loader may hand lazy slices (safetensors' `get_slice`) instead
of tensors, so that only that part is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from executor.models.layers import Embedding, Linear
from executor.models.llama import LlamaForCausalLM

# Each fused linear of a decoder layer and the Hugging Face projections it concatenates
# (along the output rows), in order.
FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
# Checkpoint entries that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def fused_name(attr: str) -> str:
    """`qkv_proj` -> `self_attn.qkv_proj`: the fused module's HF-style name in a layer."""
    return f"{FUSED_LINEARS[attr][0].split('.')[0]}.{attr}"


class _Source:
    """The checkpoint's tensors (or lazy slices) as this model's shard plan cuts them."""

    def __init__(self, tensors: Mapping[str, Any], model: LlamaForCausalLM) -> None:
        self.tensors = tensors
        self.plan = model.plan
        self.used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        self.used.add(name)
        return self.plan.take(name, self.tensors[name])


def _assign(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def load_hf_weights(model: LlamaForCausalLM, tensors: Mapping[str, Any]) -> None:
    """Copy every parameter of `model` from `tensors` (tensors, or lazy slices with
    `get_shape()` and slicing); raise on a missing or mis-shaped one."""
    src = _Source(tensors, model)
    used = src.used
    # Modules that are not our float layers were quantized and filled by
    # executor.models.quantize; they take nothing from `tensors`.
    if isinstance(model.embed_tokens, Embedding):
        _assign(
            model.embed_tokens.weight,
            src.take("model.embed_tokens.weight"),
            "model.embed_tokens.weight",
        )
    _assign(model.norm.weight, src.take("model.norm.weight"), "model.norm.weight")
    if isinstance(model.lm_head, Linear):
        _assign(model.lm_head.weight, src.take("lm_head.weight"), "lm_head.weight")
    elif model.lm_head is None and "lm_head.weight" in tensors:
        used.add("lm_head.weight")  # tied: some checkpoints store the copy anyway
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        for attr, sources in FUSED_LINEARS.items():
            linear = getattr(layer, attr)
            if not isinstance(linear, Linear):
                continue
            parts = [src.take(p + f"{part}.weight") for part in sources]
            name = p + fused_name(attr)
            _assign(linear.weight, torch.cat(parts, dim=0), name + ".weight")
            if linear.bias is not None:
                bias = [src.take(p + f"{part}.bias") for part in sources]
                _assign(linear.bias, torch.cat(bias, dim=0), name + ".bias")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            _assign(
                getattr(layer, norm).weight,
                src.take(p + f"{norm}.weight"),
                p + f"{norm}.weight",
            )
    unused = [n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"checkpoint has tensors the model does not use: {sorted(unused)[:5]}")
