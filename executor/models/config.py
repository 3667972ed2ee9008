"""Hyper-parameters of a decoder, from a Hugging Face config or GGUF metadata.

Which architectures exist is `executor.models.registry`'s table (imported where it is used:
the registry imports the model code, which imports this module).
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
        """From config.json; None when it sets none of these. Without `layer_types` a Gemma 2
        config windows its even layers (transformers' Gemma2Config default)."""
        types = cfg.get("layer_types")
        if types is None and cfg.get("model_type") == "gemma2":
            types = [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(cfg["num_hidden_layers"])
            ]
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
        from executor.models.registry import model_class

        # Refuses an unknown architecture (naming the supported) or what its code lacks.
        model_class(self.architecture).check_config(self)
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

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        from executor.models.registry import from_hf_names

        family = from_hf_names(list(cfg.get("architectures") or []), cfg.get("model_type"))
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
        return cls(
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

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json that Hugging Face transformers loads into the same model."""
        from executor.models.registry import hf_architecture

        cfg: dict[str, Any] = {
            "architectures": [hf_architecture(self.architecture)],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
        }
        if self.moe is not None:
            cfg.update(self.moe.to_hf_config())
        if self.attention is not None:
            cfg.update(self.attention.to_hf_config(self.num_layers))
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            cfg["eos_token_id"] = (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
            )
        return cfg

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
