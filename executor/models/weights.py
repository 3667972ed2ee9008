"""Load a Hugging Face-named state dict into our fused layout (QKV and gate/up concatenated).

Every loader (GGUF, HF directory, tiny-random) produces tensors under Hugging Face names;
this module is the one place that knows how they map onto our modules.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from executor.models.llama import LlamaForCausalLM

# Checkpoint entries that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    _assign(
        model.embed_tokens.weight,
        _take(tensors, "model.embed_tokens.weight", used),
        "model.embed_tokens.weight",
    )
    _assign(model.norm.weight, _take(tensors, "model.norm.weight", used), "model.norm.weight")
    if model.lm_head is not None:
        _assign(model.lm_head.weight, _take(tensors, "lm_head.weight", used), "lm_head.weight")
    elif "lm_head.weight" in tensors:
        used.add("lm_head.weight")  # tied: some checkpoints store the copy anyway
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        qkv = [_take(tensors, p + f"self_attn.{n}_proj.weight", used) for n in "qkv"]
        _assign(layer.qkv_proj.weight, torch.cat(qkv, dim=0), p + "self_attn.qkv_proj.weight")
        if layer.qkv_proj.bias is not None:
            bias = [_take(tensors, p + f"self_attn.{n}_proj.bias", used) for n in "qkv"]
            _assign(layer.qkv_proj.bias, torch.cat(bias, dim=0), p + "self_attn.qkv_proj.bias")
        _assign(
            layer.o_proj.weight,
            _take(tensors, p + "self_attn.o_proj.weight", used),
            p + "self_attn.o_proj.weight",
        )
        gate_up = [_take(tensors, p + f"mlp.{n}_proj.weight", used) for n in ("gate", "up")]
        _assign(layer.gate_up_proj.weight, torch.cat(gate_up, dim=0), p + "mlp.gate_up_proj.weight")
        _assign(
            layer.down_proj.weight,
            _take(tensors, p + "mlp.down_proj.weight", used),
            p + "mlp.down_proj.weight",
        )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            _assign(
                getattr(layer, norm).weight,
                _take(tensors, p + f"{norm}.weight", used),
                p + f"{norm}.weight",
            )
    unused = [n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"checkpoint has tensors the model does not use: {sorted(unused)[:5]}")
