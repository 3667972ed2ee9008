"""Load a Hugging Face-named state dict into a model's layout, by the model's own tables.

Every loader (GGUF, HF directory, tiny-random) produces tensors under Hugging Face names.
What they map onto is the family's business (`DecoderModel`): its `FUSED_LINEARS`
concatenate projections (QKV, gate/up) along the output rows; a module with a
`load_checkpoint(take, prefix)` method gathers its own tensors (grouped expert weights);
every other parameter is the tensor of its own name (`model.` + its path, `lm_head.weight`).

A tensor-parallel model (`model.plan` of size > 1) takes only its rank's part of each
tensor (`ShardPlan.take`); a loader may hand lazy slices (safetensors' `get_slice`) instead
of tensors, so that only that part is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from executor.models.decoder_model import DecoderModel
from executor.models.layers import Embedding, Linear

# Checkpoint entries that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(path: str) -> str:
    """Our parameter path -> its Hugging Face checkpoint name."""
    return path if path.startswith("lm_head.") else f"model.{path}"


def layer_submodule(layer: nn.Module, path: str) -> nn.Module | None:
    """`layer`'s module at `path` (e.g. `mlp.gate_up_proj`), None when this layer has none
    (a mixture-of-experts layer has no dense MLP)."""
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


class _Source:
    """The checkpoint's tensors (or lazy slices) as this model's shard plan cuts them."""

    def __init__(self, tensors: Mapping[str, Any], model: DecoderModel) -> None:
        self.tensors = tensors
        self.plan = model.plan
        self.used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        self.used.add(name)
        return self.plan.take(name, self.tensors[name])


def assign(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def _load_fused(
    src: _Source, linear: Linear, prefix: str, path: str, parts: tuple[str, ...]
) -> None:
    weight = [src.take(f"{prefix}{part}.weight") for part in parts]
    assign(linear.weight, torch.cat(weight, dim=0), f"{prefix}{path}.weight")
    if linear.bias is not None:
        bias = [src.take(f"{prefix}{part}.bias") for part in parts]
        assign(linear.bias, torch.cat(bias, dim=0), f"{prefix}{path}.bias")


def load_hf_weights(model: DecoderModel, tensors: Mapping[str, Any]) -> None:
    """Copy every parameter of `model` from `tensors` (tensors, or lazy slices with
    `get_shape()` and slicing); raise on a missing or mis-shaped one."""
    src = _Source(tensors, model)
    done: set[str] = set()  # module paths whose parameters are filled (or not ours to fill)
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"layers.{i}."
        for path, parts in model.FUSED_LINEARS.items():
            linear = layer_submodule(layer, path)
            if linear is None:
                continue
            done.add(prefix + path)
            # Modules that are not our float layers were quantized and filled by
            # executor.models.quantize; they take nothing from `tensors`.
            if isinstance(linear, Linear):
                _load_fused(src, linear, hf_name(prefix), path, parts)
    for path, module in model.named_modules():
        load = getattr(module, "load_checkpoint", None)
        if load is not None:
            load(src.take, hf_name(path) + ".")
            done.add(path)
    if not isinstance(model.embed_tokens, Embedding):
        done.add("embed_tokens")
    if model.lm_head is None and "lm_head.weight" in tensors:
        src.used.add("lm_head.weight")  # tied: some checkpoints store the copy anyway
    for path, param in model.named_parameters():
        owner = path.rpartition(".")[0]
        if any(owner == d or owner.startswith(d + ".") for d in done):
            continue
        assign(param, src.take(hf_name(path)), hf_name(path))
    unused = [n for n in tensors if n not in src.used and not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"checkpoint has tensors the model does not use: {sorted(unused)[:5]}")
