"""Qwen3: the Llama layer with an RMSNorm over each q and k head before rotary, no QKV bias,
and a head_dim that need not be hidden / heads."""

from __future__ import annotations

from typing import ClassVar

from executor.models.blocks import (
    DENSE_LINEARS,
    DENSE_SPLITS,
    GGUF_DENSE_NAMES,
    DecoderLayer,
    GatedMLP,
    LayerBuild,
    RotaryAttention,
)
from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel

QWEN3_GGUF_NAMES = {
    **GGUF_DENSE_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


class Qwen3ForCausalLM(DecoderModel):
    model_type: ClassVar[str] = "qwen3"
    gguf_architecture: ClassVar[str | None] = "qwen3"
    FUSED_LINEARS = DENSE_LINEARS
    TP_SPLITS = DENSE_SPLITS  # q_norm / k_norm span one head: replicated
    GGUF_NAMES = QWEN3_GGUF_NAMES

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        if config.attention_bias:
            raise ValueError(f"{cls.model_type}: attention_bias=true is not supported")

    def make_layer(self, layer_id: int, build: LayerBuild) -> DecoderLayer:
        c, p = build.config, build.plan
        attn = RotaryAttention(c, p, qk_norm=True, **build.dd)
        mlp = GatedMLP(c.hidden_size, p.intermediate_size, **build.dd)
        return DecoderLayer(c, layer_id, attn, mlp, comm=build.comm, **build.dd)
