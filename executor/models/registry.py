"""`MODELS`: Hugging Face architecture name -> model family class; the one list of names.

`ModelConfig.architecture` holds the family's Hugging Face `model_type`; config.json's
`architectures`, its `model_type` and a GGUF file's `general.architecture` are all looked up
here, and an unknown one is refused naming the supported ones. A config.json becomes a
`ModelConfig` here too (`config_from_hf`, and back: `hf_config`), with the family's defaults
and checks, so that `ModelConfig` stays plain data. A new family is one file and one row.
"""

from __future__ import annotations

from typing import Any

import torch

from executor.models.config import AttentionConfig, ModelConfig, MoeConfig
from executor.models.decoder_model import DecoderModel
from executor.models.gemma2 import Gemma2ForCausalLM
from executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from executor.models.qwen3 import Qwen3ForCausalLM
from executor.models.qwen3_moe import Qwen3MoeForCausalLM
from executor.models.sharding import ShardPlan
from executor.parallel.comm import TpComm

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


def check_config(config: ModelConfig) -> ModelConfig:
    """`config`, if its architecture is supported and its family's code implements it
    (ValueError naming what is not); the loaders call it, so a model is refused at start-up."""
    model_class(config.architecture).check_config(config)
    return config


def config_from_hf(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    """A config.json's hyper-parameters, with the family's defaults for what it leaves out."""
    family = from_hf_names(list(cfg.get("architectures") or []), cfg.get("model_type"))
    cfg = family.hf_config_defaults(cfg)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (only the default rotary embedding)"
        )
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return check_config(
        ModelConfig(
            architecture=family.model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", family.default_attention_bias),
            moe=MoeConfig.from_hf_config(cfg),
            attention=AttentionConfig.from_hf_config(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or cfg.get("_name_or_path", "") or family.model_type,
        )
    )


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """A config.json that Hugging Face transformers loads into the same model."""
    cfg: dict[str, Any] = {
        "architectures": [hf_architecture(config.architecture)],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
    }
    if config.moe is not None:
        cfg.update(config.moe.to_hf_config())
    if config.attention is not None:
        cfg.update(config.attention.to_hf_config(config.num_layers))
    if config.bos_token_id is not None:
        cfg["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        eos = config.eos_token_ids
        cfg["eos_token_id"] = list(eos) if len(eos) > 1 else eos[0]
    return cfg


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
    cls = model_class(check_config(config).architecture)
    comm = comm or TpComm()
    plan = shard_plan(config, comm.size, comm.rank)
    return cls(config, max_positions, device=device, dtype=dtype, plan=plan, comm=comm)
