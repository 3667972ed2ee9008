"""Model code and loaders: a Llama-family decoder written against our KV cache and backends."""

from executor.models.config import ModelConfig
from executor.models.llama import LlamaForCausalLM
from executor.models.loader import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelSource,
    load_model,
    resolve_model_spec,
)

__all__ = [
    "DEFAULT_MODEL",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelSource",
    "load_model",
    "resolve_model_spec",
]
