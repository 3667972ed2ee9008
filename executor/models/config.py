"""Hyper-parameters of a decoder: plain data, built by the loaders.

Which architectures exist, and how a config.json maps onto a `ModelConfig` and back, is
`executor.models.registry`'s (`config_from_hf`, `hf_config`, `check_config`): this module
knows no family.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from attention.base import AttentionLayout, LayerAttention


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: a router picks `top_k` of `num_experts` per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    sparse_step: int = 1  # layer i is sparse when (i + 1) % sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not one of these (dense MLP)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.sparse_step}")

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.sparse_step == 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoeConfig | None:
        """From config.json's keys (Qwen-MoE and Mixtral names); None for a dense model."""
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if experts == 0:
            return None
        return cls(
            num_experts=int(experts),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            # Absent: transformers' default, False for Qwen-MoE; Mixtral (num_local_experts)
            # always renormalises and has no key.
            norm_topk_prob=bool(cfg.get("norm_topk_prob", "num_local_experts" in cfg)),
            sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )

    def to_hf_config(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
        }


@dataclass(frozen=True)
class AttentionConfig:
    """What a family adds to plain causal attention and its logits (Gemma 2's keys).

    `sliding_layers` attend only to their last `sliding_window` keys; q.k is scaled by
    `query_pre_attn_scalar ** -0.5` (None: head_dim); scores and final logits are soft-capped
    (x -> c * tanh(x / c)) where a cap is set.
    """

    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    query_pre_attn_scalar: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def window(self, layer_id: int) -> int | None:
        return self.sliding_window if layer_id in self.sliding_layers else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> AttentionConfig | None:
        """From config.json (after the family's defaults: `DecoderModel.hf_config_defaults`);
        None when it sets none of these."""
        types = cfg.get("layer_types")
        window = cfg.get("sliding_window")
        sliding = tuple(i for i, t in enumerate(types or ()) if t == "sliding_attention")
        found = cls(
            sliding_window=int(window) if window and sliding else None,
            sliding_layers=sliding if window else (),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )
        return None if found == cls() else found

    def to_hf_config(self, num_layers: int) -> dict[str, Any]:
        return {
            "sliding_window": self.sliding_window,
            "layer_types": [
                "sliding_attention" if self.window(i) else "full_attention"
                for i in range(num_layers)
            ],
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
        }


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to build itself; nothing about serving."""

    architecture: str  # a registered family's Hugging Face model_type ("llama", "qwen2", ...)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2's default)
    moe: MoeConfig | None = None  # None: every layer has a dense MLP
    attention: AttentionConfig | None = None  # None: plain causal attention everywhere
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def attention_scaling(self) -> float:
        scalar = self.attention.query_pre_attn_scalar if self.attention else None
        return 1.0 / math.sqrt(scalar or self.head_dim)

    def attention_layout(self, num_heads: int, num_kv_heads: int) -> AttentionLayout:
        """What the attention backend needs for this rank's heads: geometry, scaling, and
        each layer's window and soft-cap (none: plain attention everywhere, at no cost)."""
        a = self.attention
        layers = (
            ()
            if a is None
            else tuple(
                LayerAttention(a.window(i), a.attn_logit_softcapping)
                for i in range(self.num_layers)
            )
        )
        return AttentionLayout(
            num_heads, num_kv_heads, self.head_dim, self.attention_scaling, layers
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The inverse of `as_dict` after a JSON round trip (tuples came back as lists)."""
        data = {k: v for k, v in data.items() if k != "extra"}
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        moe = data.get("moe")
        if moe is not None:
            moe = {**moe, "mlp_only_layers": tuple(moe.get("mlp_only_layers", ()))}
            data["moe"] = MoeConfig(**moe)
        attention = data.get("attention")
        if attention is not None:
            attention = {**attention, "sliding_layers": tuple(attention["sliding_layers"])}
            data["attention"] = AttentionConfig(**attention)
        return cls(**data)
