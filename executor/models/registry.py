"""`MODELS`: Hugging Face architecture name -> model family class; the one list of names.

`ModelConfig.architecture` holds the family's Hugging Face `model_type`; config.json's
`architectures`, its `model_type` and a GGUF file's `general.architecture` are all looked up
here, and an unknown one is refused naming the supported ones.
"""

from __future__ import annotations

import torch

from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel
from executor.models.gemma2 import Gemma2ForCausalLM
from executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from executor.models.qwen3 import Qwen3ForCausalLM
from executor.models.qwen3_moe import Qwen3MoeForCausalLM
from executor.parallel.comm import TpComm
from executor.parallel.shard import ShardPlan

MODELS: dict[str, type[DecoderModel]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported() -> str:
    return ", ".join(f"{name} ({cls.model_type})" for name, cls in MODELS.items())


def model_class(model_type: str) -> type[DecoderModel]:
    """The family of a `ModelConfig.architecture` (a Hugging Face `model_type`)."""
    for cls in MODELS.values():
        if cls.model_type == model_type:
            return cls
    raise ValueError(f"architecture {model_type!r} is not supported (supported: {supported()})")


def hf_architecture(model_type: str) -> str:
    """The Hugging Face class name config.json's `architectures` gives for `model_type`."""
    cls = model_class(model_type)
    return next(name for name, c in MODELS.items() if c is cls)


def from_hf_names(architectures: list[str], model_type: str | None) -> type[DecoderModel]:
    """The family config.json names: its `architectures` entry, else its `model_type`."""
    for name in architectures:
        if name in MODELS:
            return MODELS[name]
    if architectures:
        raise ValueError(
            f"architecture {architectures[0]!r} is not supported (supported: {supported()})"
        )
    return model_class(model_type or "llama")


def from_gguf_architecture(arch: str) -> type[DecoderModel]:
    for cls in MODELS.values():
        if cls.gguf_architecture == arch:
            return cls
    names = ", ".join(c.gguf_architecture for c in MODELS.values() if c.gguf_architecture)
    raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {names})")


def shard_plan(config: ModelConfig, size: int, rank: int) -> ShardPlan:
    """`rank`'s plan in a group of `size`, splitting the tensors the family's table names."""
    return ShardPlan.build(config, size, rank, model_class(config.architecture).TP_SPLITS)


def create_model(
    config: ModelConfig,
    max_positions: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    comm: TpComm | None = None,
) -> DecoderModel:
    """The family's model, parameters uninitialized (a loader fills them); with a `comm` of
    size > 1, that rank's shard."""
    cls = model_class(config.architecture)
    comm = comm or TpComm()
    plan = shard_plan(config, comm.size, comm.rank)
    return cls(config, max_positions, device=device, dtype=dtype, plan=plan, comm=comm)
