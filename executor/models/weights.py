"""Load a Hugging Face-named state dict into our fused layout (QKV and gate/up concatenated).

Every loader (GGUF, HF directory, tiny-random) produces tensors under Hugging Face names;
this module is the one place that knows how they map onto our modules.
"""

from __future__ import annotations

from collections.abc import Mapping

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


def _take(tensors: Mapping[str, torch.Tensor], name: str, used: set[str]) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    used.add(name)
    return tensors[name]


def _assign(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def load_hf_weights(model: LlamaForCausalLM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy every parameter of `model` from `tensors`; raise on a missing or mis-shaped one."""
    used: set[str] = set()
    # Modules that are not our float layers were quantized and filled by
    # executor.models.quantize; they take nothing from `tensors`.
    if isinstance(model.embed_tokens, Embedding):
        _assign(
            model.embed_tokens.weight,
            _take(tensors, "model.embed_tokens.weight", used),
            "model.embed_tokens.weight",
        )
    _assign(model.norm.weight, _take(tensors, "model.norm.weight", used), "model.norm.weight")
    if isinstance(model.lm_head, Linear):
        _assign(model.lm_head.weight, _take(tensors, "lm_head.weight", used), "lm_head.weight")
    elif model.lm_head is None and "lm_head.weight" in tensors:
        used.add("lm_head.weight")  # tied: some checkpoints store the copy anyway
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        for attr, sources in FUSED_LINEARS.items():
            linear = getattr(layer, attr)
            if not isinstance(linear, Linear):
                continue
            parts = [_take(tensors, p + f"{src}.weight", used) for src in sources]
            name = p + fused_name(attr)
            _assign(linear.weight, torch.cat(parts, dim=0), name + ".weight")
            if linear.bias is not None:
                bias = [_take(tensors, p + f"{src}.bias", used) for src in sources]
                _assign(linear.bias, torch.cat(bias, dim=0), name + ".bias")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            _assign(
                getattr(layer, norm).weight,
                _take(tensors, p + f"{norm}.weight", used),
                p + f"{norm}.weight",
            )
    unused = [n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"checkpoint has tensors the model does not use: {sorted(unused)[:5]}")
