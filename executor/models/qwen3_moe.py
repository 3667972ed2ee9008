"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a sparse mixture-of-experts MLP
(`moe.py`) on the layers `MoeConfig.is_sparse` names, a dense gated MLP on the others."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from executor.models.blocks import (
    DENSE_LINEARS,
    DENSE_SPLITS,
    DecoderLayer,
    GatedMLP,
    LayerBuild,
    RotaryAttention,
)
from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel
from executor.models.moe import SparseMoeBlock
from executor.models.qwen3 import QWEN3_GGUF_NAMES

QWEN3_MOE_SPLITS = {
    **DENSE_SPLITS,
    "*.mlp.experts.*.gate_proj.weight": (0, "experts"),
    "*.mlp.experts.*.up_proj.weight": (0, "experts"),
    "*.mlp.experts.*.down_proj.weight": (1, "experts"),
}
QWEN3_MOE_GGUF_NAMES = {
    **QWEN3_GGUF_NAMES,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


class Qwen3MoeForCausalLM(DecoderModel):
    model_type: ClassVar[str] = "qwen3_moe"
    gguf_architecture: ClassVar[str | None] = "qwen3moe"
    FUSED_LINEARS = DENSE_LINEARS  # the experts load themselves (GroupedExperts)
    TP_SPLITS = QWEN3_MOE_SPLITS
    GGUF_NAMES = QWEN3_MOE_GGUF_NAMES

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        if config.moe is None:
            raise ValueError(f"{cls.model_type}: the config names no experts (num_experts)")
        if config.attention_bias:
            raise ValueError(f"{cls.model_type}: attention_bias=true is not supported")

    def make_layer(self, layer_id: int, build: LayerBuild) -> DecoderLayer:
        c, p = build.config, build.plan
        assert c.moe is not None  # check_config
        attn = RotaryAttention(c, p, qk_norm=True, **build.dd)
        mlp: nn.Module
        if c.moe.is_sparse(layer_id):
            mlp = SparseMoeBlock(
                c.moe, c.hidden_size, p.expert_intermediate_size, layer_id=layer_id, **build.dd
            )
        else:
            mlp = GatedMLP(c.hidden_size, p.intermediate_size, **build.dd)
        return DecoderLayer(c, layer_id, attn, mlp, comm=build.comm, **build.dd)
