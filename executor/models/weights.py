"""Load a Hugging Face-named state dict into a model's layout, by the model's own tables.

Every loader (GGUF, HF directory, tiny-random) produces tensors under Hugging Face names.
What they map onto is the family's business (`DecoderModel`): its `FUSED_LINEARS`
concatenate projections (QKV, gate/up) along the output rows; a module with a
`checkpoint_targets(path, prefix)` method lists its own tensors (grouped expert weights);
every other parameter is the tensor of its own name (`model.` + its path, `lm_head.weight`).
`checkpoint_targets` is that map, made once: the loader fills it, and a weight update while
serving (`executor.weights`) writes into it.

A tensor-parallel model (`model.plan` of size > 1) takes only its rank's part of each
tensor (`ShardPlan.take`); a loader may hand lazy slices (safetensors' `get_slice`) instead
of tensors, so that only that part is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor.models.decoder_model import DecoderModel
from executor.models.layers import Embedding

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


@dataclass(frozen=True)
class CheckpointTarget:
    """One tensor of the model and the checkpoint tensors that fill it: `parts` (Hugging Face
    names, each as this rank's shard plan cuts it) concatenated along the first axis."""

    module: str  # the owning module's path in the model, e.g. layers.0.self_attn.qkv_proj
    attr: str  # the tensor's attribute on it: weight, bias, gate_up, ...
    index: int | None  # an entry of a stacked tensor (one expert's), None: the whole tensor
    parts: tuple[str, ...]

    @property
    def name(self) -> str:
        """What messages call it: the module path, attribute and entry."""
        entry = "" if self.index is None else f"[{self.index}]"
        return f"{hf_name(self.module)}.{self.attr}{entry}"

    def tensor(self, model: nn.Module) -> torch.Tensor:
        """The destination in `model` (a float model: every target is a tensor there)."""
        value = getattr(model.get_submodule(self.module), self.attr)
        return value if self.index is None else value[self.index]


def checkpoint_targets(model: DecoderModel) -> list[CheckpointTarget]:
    """Every tensor the checkpoint fills, in load order: each layer's fused linears (by the
    family's `FUSED_LINEARS`, whatever module sits there now), the tensors of modules that
    list their own (`checkpoint_targets(path, prefix)`: grouped experts), then every other
    parameter under its own name."""
    targets: list[CheckpointTarget] = []
    done: set[str] = set()  # module paths whose tensors are listed (or not the checkpoint's)
    for i, layer in enumerate(model.decoder_layers):
        for path, parts in model.FUSED_LINEARS.items():
            linear = layer_submodule(layer, path)
            if linear is None:
                continue
            full = f"layers.{i}.{path}"
            done.add(full)
            prefix = hf_name(f"layers.{i}.")
            targets.append(
                CheckpointTarget(full, "weight", None, tuple(f"{prefix}{p}.weight" for p in parts))
            )
            if getattr(linear, "bias", None) is not None:
                targets.append(
                    CheckpointTarget(full, "bias", None, tuple(f"{prefix}{p}.bias" for p in parts))
                )
    for path, module in model.named_modules():
        own = getattr(module, "checkpoint_targets", None)
        if own is not None and path:
            targets.extend(own(path, hf_name(path) + "."))
            done.add(path)
    if not isinstance(model.embed_tokens, Embedding):
        done.add("embed_tokens")
    for path, _ in model.named_parameters():
        owner, _, attr = path.rpartition(".")
        if any(owner == d or owner.startswith(d + ".") for d in done):
            continue
        targets.append(CheckpointTarget(owner, attr, None, (hf_name(path),)))
    return targets


def assign(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def load_hf_weights(model: DecoderModel, tensors: Mapping[str, Any]) -> None:
    """Copy every parameter of `model` from `tensors` (tensors, or lazy slices with
    `get_shape()` and slicing); raise on a missing or mis-shaped one."""
    src = _Source(tensors, model)
    for target in checkpoint_targets(model):
        # A fused linear that is no float `Linear` was quantized and filled by
        # executor.models.quantize (its tensors are buffers, not parameters): it takes
        # nothing from `tensors`.
        module = model.get_submodule(target.module)
        if target.index is None and not isinstance(
            getattr(module, target.attr, None), nn.Parameter
        ):
            continue
        value = [src.take(part) for part in target.parts]
        assign(
            target.tensor(model),
            value[0] if len(value) == 1 else torch.cat(value, dim=0),
            target.parts[0] if len(value) == 1 else target.name,
        )
    if model.lm_head is None and "lm_head.weight" in tensors:
        src.used.add("lm_head.weight")  # tied: some checkpoints store the copy anyway
    unused = [n for n in tensors if n not in src.used and not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"checkpoint has tensors the model does not use: {sorted(unused)[:5]}")
