"""Write a small model as GGUF the way llama.cpp's converter does (Llama's Q/K rows permuted,
Gemma 2's norm weights stored plus one)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from executor.models.config import ModelConfig

_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
# Gemma 2's sandwich norms (its pre-feedforward norm takes Llama's `ffn_norm`).
_GEMMA2_TO_GGUF = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Experts: llama.cpp stacks each layer's per-expert matrices into one [E, rows, cols] tensor.
_EXPERT_STACKS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name.startswith("blk."):  # already a stacked expert tensor
        return hf_name
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)
    names = {**_TO_GGUF, **_GEMMA2_TO_GGUF} if arch == "gemma2" else _TO_GGUF
    return f"blk.{idx}.{names[rest]}"


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model.layers.i.mlp.experts.e.gate_proj.weight` ... -> `blk.i.ffn_gate_exps.weight`."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = t
            continue
        _, _, idx, _, _, e, proj, _ = name.split(".")
        stacks.setdefault(f"blk.{idx}.{_EXPERT_STACKS[proj]}.weight", {})[int(e)] = t
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `permute` in convert_hf_to_gguf.py (the loader must undo it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    qtype_2d: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
) -> None:
    arch = {"qwen3_moe": "qwen3moe"}.get(config.architecture, config.architecture)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(config.name)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    if config.eos_token_ids:
        w.add_eos_token_id(config.eos_token_ids[0])
    if config.bos_token_id is not None:
        w.add_bos_token_id(config.bos_token_id)
    if config.moe is not None:
        w.add_expert_count(config.moe.num_experts)
        w.add_expert_used_count(config.moe.top_k)
        w.add_expert_feed_forward_length(config.moe.intermediate_size)
        w.add_expert_weights_norm(config.moe.norm_topk_prob)
    attention = config.attention
    if attention is not None and attention.sliding_window is not None:
        w.add_sliding_window(attention.sliding_window)
    if attention is not None and attention.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(attention.attn_logit_softcapping)
    if attention is not None and attention.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(attention.final_logit_softcapping)
    for name, t in _stack_experts(tensors).items():
        data = t.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = permute_qk(data, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        if arch == "gemma2" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if data.ndim == 2 and qtype_2d != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(data, qtype_2d)
            w.add_tensor(gguf_name(name, arch), q, raw_shape=q.shape, raw_dtype=qtype_2d)
        else:
            w.add_tensor(gguf_name(name, arch), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
