"""`tiny-random`: small built-in configs with seeded random weights, for fast tests.

Weights are scaled so activations stay O(1) and logits are well separated, which keeps
greedy decoding away from near-ties when comparing against a reference implementation.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from executor.models.config import AttentionConfig, ModelConfig, MoeConfig
from executor.models.registry import create_model

# What every tiny config shares; each family's entry says only how it differs.
_TINY = ModelConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
    name="tiny-random",
)
_QWEN = replace(_TINY, rms_norm_eps=1e-6, rope_theta=1000000.0)

TINY_CONFIGS: dict[str, ModelConfig] = {
    "tiny-random": _TINY,
    "tiny-random-qwen2": replace(
        _QWEN,
        architecture="qwen2",
        tie_word_embeddings=True,
        attention_bias=True,
        name="tiny-random-qwen2",
    ),
    "tiny-random-qwen3": replace(
        _QWEN,
        architecture="qwen3",
        head_dim=32,  # not hidden / heads, as Qwen3 allows
        name="tiny-random-qwen3",
    ),
    "tiny-random-qwen3-moe": replace(
        _QWEN,
        architecture="qwen3_moe",
        num_layers=3,  # intermediate_size is the dense layer's (layer 1: mlp_only_layers)
        moe=MoeConfig(
            num_experts=4,
            top_k=2,
            intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=(1,),
        ),
        name="tiny-random-qwen3-moe",
    ),
    "tiny-random-gemma2": replace(
        _TINY,
        architecture="gemma2",
        num_layers=4,
        head_dim=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention=AttentionConfig(
            sliding_window=8,  # shorter than most prompts, so windowing matters
            sliding_layers=(0, 2),
            query_pre_attn_scalar=24,  # not head_dim
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        bos_token_id=2,
        eos_token_ids=(1,),
        name="tiny-random-gemma2",
    ),
}


def tiny_random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 tensors drawn from a generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    h, d = config.hidden_size, config.head_dim
    # What the family's layers hold, read from a parameter-less (meta) build.
    shape = create_model(config, 1, device=torch.device("meta"), dtype=torch.float32)
    qk_norm = shape.decoder_layers[0].self_attn.q_norm is not None
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(config.vocab_size, h, generator=g)
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = linear(config.num_heads * d, h)
        t[p + "self_attn.k_proj.weight"] = linear(config.num_kv_heads * d, h)
        t[p + "self_attn.v_proj.weight"] = linear(config.num_kv_heads * d, h)
        if config.attention_bias:
            t[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(config.num_heads * d, generator=g)
            t[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(config.num_kv_heads * d, generator=g)
            t[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(config.num_kv_heads * d, generator=g)
        t[p + "self_attn.o_proj.weight"] = linear(h, config.num_heads * d)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"] = norm(d)
            t[p + "self_attn.k_norm.weight"] = norm(d)
        if config.moe is not None and config.moe.is_sparse(i):
            inter = config.moe.intermediate_size
            t[p + "mlp.gate.weight"] = linear(config.moe.num_experts, h)
            for e in range(config.moe.num_experts):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(inter, h)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = linear(inter, h)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = linear(h, inter)
        else:
            t[p + "mlp.gate_proj.weight"] = linear(config.intermediate_size, h)
            t[p + "mlp.up_proj.weight"] = linear(config.intermediate_size, h)
            t[p + "mlp.down_proj.weight"] = linear(h, config.intermediate_size)
        # Every hidden-size norm the layer holds (two; four with Gemma 2's sandwich norms).
        for path, _ in shape.decoder_layers[i].named_parameters():
            if path.endswith("layernorm.weight"):
                t[p + path] = norm(h)
    t["model.norm.weight"] = norm(h)
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = linear(config.vocab_size, h) * 4.0
    return t
