"""Llama and Qwen2: the shared pre-norm decoder (`blocks.py`) with a SiLU-gated MLP.

Qwen2 differs only in its defaults: biased q/k/v projections, and GGUF files whose Q/K rows
llama.cpp's converter left in Hugging Face's order (it interleaves them for Llama).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from executor.models.blocks import (
    DENSE_LINEARS,
    DENSE_SPLITS,
    GGUF_DENSE_NAMES,
    DecoderLayer,
    GatedMLP,
    RotaryAttention,
)
from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel
from executor.parallel.comm import TpComm
from executor.parallel.shard import ShardPlan


class LlamaForCausalLM(DecoderModel):
    model_type: ClassVar[str] = "llama"
    gguf_architecture: ClassVar[str | None] = "llama"
    FUSED_LINEARS = DENSE_LINEARS
    TP_SPLITS = DENSE_SPLITS
    GGUF_NAMES = GGUF_DENSE_NAMES
    GGUF_PERMUTED_QK = True

    def make_layer(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        plan: ShardPlan,
        comm: TpComm,
        device: torch.device,
        dtype: torch.dtype,
    ) -> DecoderLayer:
        attn = RotaryAttention(config, plan, qk_norm=False, device=device, dtype=dtype)
        mlp = GatedMLP(config.hidden_size, plan.intermediate_size, device=device, dtype=dtype)
        return DecoderLayer(config, layer_id, attn, mlp, comm=comm, device=device, dtype=dtype)


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_type: ClassVar[str] = "qwen2"
    gguf_architecture: ClassVar[str | None] = "qwen2"
    default_attention_bias: ClassVar[bool] = True
    GGUF_PERMUTED_QK = False
