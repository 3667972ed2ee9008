"""Llama and Qwen2: the shared pre-norm decoder (`blocks.py`) with a SiLU-gated MLP.

Qwen2 differs only in its defaults: biased q/k/v projections, and GGUF files whose Q/K rows
llama.cpp's converter left in Hugging Face's order (it interleaves them for Llama).
"""

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
from executor.models.decoder_model import DecoderModel


class LlamaForCausalLM(DecoderModel):
    model_type: ClassVar[str] = "llama"
    gguf_architecture: ClassVar[str | None] = "llama"
    FUSED_LINEARS = DENSE_LINEARS
    TP_SPLITS = DENSE_SPLITS
    GGUF_NAMES = GGUF_DENSE_NAMES
    GGUF_PERMUTED_QK = True

    def make_layer(self, layer_id: int, build: LayerBuild) -> DecoderLayer:
        c, p = build.config, build.plan
        attn = RotaryAttention(c, p, qk_norm=False, **build.dd)
        mlp = GatedMLP(c.hidden_size, p.intermediate_size, **build.dd)
        return DecoderLayer(c, layer_id, attn, mlp, comm=build.comm, **build.dd)


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_type: ClassVar[str] = "qwen2"
    gguf_architecture: ClassVar[str | None] = "qwen2"
    default_attention_bias: ClassVar[bool] = True
    GGUF_PERMUTED_QK = False
