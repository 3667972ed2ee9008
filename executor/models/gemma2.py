"""Gemma 2: the shared decoder with sandwich norms, a GeGLU MLP and Gemma's own RMSNorm.

What differs from Llama, all in this file except the attention it asks for:
- RMSNorm scales by `1 + weight`, in float32 (`GemmaRMSNorm`); llama.cpp's converter stores
  `weight + 1` in GGUF, which the loader undoes (`GGUF_NORM_SHIFT`).
- Sandwich norms: the attention output is normed (`post_attention_layernorm`) before the
  residual add, the MLP input by `pre_feedforward_layernorm`, its output by
  `post_feedforward_layernorm`.
- The MLP gates with GELU's tanh approximation; embeddings are scaled by sqrt(hidden_size)
  in the activation dtype; the head is tied to the embedding.
- Attention (`ModelConfig.attention`): the layers `layer_types` marks `sliding_attention`
  (the even ones by default) see only their last `sliding_window` keys, scores are
  soft-capped, q.k is scaled by `query_pre_attn_scalar ** -0.5`; the final logits are
  soft-capped too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

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
from executor.models.layers import RMSNorm
from executor.parallel.comm import TpComm

GEMMA2_GGUF_NAMES = {
    **{k: v for k, v in GGUF_DENSE_NAMES.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _even_sliding(layer_id: int) -> str:
    return "sliding_attention" if layer_id % 2 == 0 else "full_attention"


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(gate) * up` for `gate_up = cat([gate, up], -1)`: [..., 2 * I] -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GemmaRMSNorm(RMSNorm):
    """`x / rms(x) * (1 + weight)` computed in float32, cast back to x's dtype (transformers'
    Gemma2RMSNorm); the residual add fused in front, as `RMSNorm`."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x if residual is None else x + residual
        xf = summed.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), summed


class Gemma2DecoderLayer(DecoderLayer):
    """`h = x + post_attn_norm(attn(norm(x)))`, then `h + post_ffw_norm(mlp(pre_ffw_norm(h)))`."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        self_attn: RotaryAttention,
        mlp: GatedMLP,
        *,
        comm: TpComm,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(config, layer_id, self_attn, mlp, comm=comm, device=device, dtype=dtype)
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, **dd)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, **dd)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, **dd)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, **dd)

    def _mlp(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: the (summed) attention projection; normed before it joins the residual.
        attn = self.post_attention_layernorm(hidden, None)[0]
        normed, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.mlp(normed), residual

    def _mlp_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(hidden, None)[0]


class Gemma2ForCausalLM(DecoderModel):
    model_type: ClassVar[str] = "gemma2"
    gguf_architecture: ClassVar[str | None] = "gemma2"
    FUSED_LINEARS = DENSE_LINEARS
    TP_SPLITS = DENSE_SPLITS  # the four norms span the hidden size: replicated
    GGUF_NAMES = GEMMA2_GGUF_NAMES
    GGUF_NORM_SHIFT = 1.0
    NORM_CLASS = GemmaRMSNorm
    SCALE_EMBEDDINGS = True

    @classmethod
    def hf_config_defaults(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Without `layer_types` a Gemma 2 config windows its even layers (transformers'
        Gemma2Config default)."""
        if cfg.get("layer_types") is not None:
            return cfg
        types = [_even_sliding(i) for i in range(cfg["num_hidden_layers"])]
        return {**cfg, "layer_types": types}

    @classmethod
    def gguf_config_defaults(cls, config: ModelConfig) -> ModelConfig:
        """GGUF names no windowed layers and no query scalar: as llama.cpp, Gemma 2 windows its
        even layers and scales q.k by head_dim ** -0.5, hidden / heads for its 46-layer (27B)
        model."""
        a = config.attention
        if a is None:
            return config
        layers = config.num_layers
        return replace(
            config,
            attention=replace(
                a,
                sliding_layers=tuple(range(0, layers, 2)) if a.sliding_window else (),
                query_pre_attn_scalar=(
                    config.hidden_size // config.num_heads if layers == 46 else None
                ),
            ),
        )

    def make_layer(self, layer_id: int, build: LayerBuild) -> DecoderLayer:
        c, p = build.config, build.plan
        attn = RotaryAttention(c, p, qk_norm=False, **build.dd)
        mlp = GatedMLP(
            c.hidden_size, p.intermediate_size, act_and_mul=gelu_tanh_and_mul, **build.dd
        )
        return Gemma2DecoderLayer(c, layer_id, attn, mlp, comm=build.comm, **build.dd)
