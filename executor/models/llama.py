"""Llama-family decoder (Llama, Qwen2) over our paged KV cache and attention backends.

Each decoder layer is two halves around attention: `pre_attention` (norm, fused QKV
projection, rotary) and `post_attention` (output projection, norm, SiLU-gated MLP). The
model's `forward` strings them together with the backend's attention in between; the
piecewise graph runner captures the halves and runs attention eagerly between them.

The residual stream travels as a pair `(hidden, residual)` whose sum is the layer input,
so each RMSNorm fuses the residual add in front of it (same arithmetic as Hugging Face's
"residual + x then norm").

Tensor parallelism (`executor.parallel`): with a `ShardPlan` of size > 1 each layer holds
its heads and its part of the MLP, and the post-attention half splits in two around the
all-reduces (`o_proj` partial sums, then `down_proj` partial sums), so a compiled half never
contains a collective: the collectives run eagerly between compiled functions, which is
what torch.compile's full-graph mode and gloo require.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from executor.models.config import ModelConfig
from executor.models.layers import Embedding, Linear, RMSNorm
from executor.parallel.comm import TpComm
from executor.parallel.shard import ShardPlan
from ops.activation import silu_and_mul
from ops.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from attention.base import AttentionBackend
    from executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class LayerHalves:
    """The two functions a decoder layer runs around attention: plain (eager) or compiled.

    Every layer runs the same two functions with itself as the first argument, so a compiled
    pair is compiled once per input shape and shared by all layers (dynamo inlines the layer
    and lifts its weights as inputs: regional compilation), not once per layer.
    """

    pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    post: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # Tensor parallel: the post half's two pieces between the all-reduces.
    attn_proj: Callable[..., torch.Tensor]
    mlp: Callable[..., tuple[torch.Tensor, torch.Tensor]]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        plan: ShardPlan | None = None,
        comm: TpComm | None = None,
    ) -> None:
        """`plan` (default: the whole model) says which heads and MLP columns this rank holds;
        `comm` sums the row-parallel partial outputs."""
        super().__init__()
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        plan = plan or ShardPlan.single(config)
        self.comm = comm or TpComm()
        self.layer_id = layer_id
        self.num_heads = plan.num_heads
        self.num_kv_heads = plan.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = plan.num_heads * config.head_dim
        self.kv_size = plan.num_kv_heads * config.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, **dd
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, False, **dd)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.gate_up_proj = Linear(config.hidden_size, 2 * plan.intermediate_size, False, **dd)
        self.down_proj = Linear(plan.intermediate_size, config.hidden_size, False, **dd)
        self.halves = EAGER_HALVES

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], residual [T, hidden]."""
        return self.halves.pre(self, positions, hidden, residual, rotary)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn_out [T, Hq, D] -> (hidden, residual), both [T, hidden]."""
        if not self.comm.enabled:
            return self.halves.post(self, attn_out, residual)
        hidden = self.comm.all_reduce_(self.halves.attn_proj(self, attn_out))
        hidden, residual = self.halves.mlp(self, hidden, residual)
        return self.comm.all_reduce_(hidden), residual

    def pre_attention_eager(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm(hidden, residual)
        qkv = self.qkv_proj(normed)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        return q, k, v, residual

    def post_attention_eager(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.o_proj(attn_out.reshape(-1, self.q_size))
        normed, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.down_proj(silu_and_mul(self.gate_up_proj(normed)))
        return hidden, residual

    def attn_proj_eager(self, attn_out: torch.Tensor) -> torch.Tensor:
        """Tensor parallel: this rank's partial o_proj output (summed over the ranks next)."""
        return self.o_proj(attn_out.reshape(-1, self.q_size))

    def mlp_eager(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor parallel: norm, then this rank's partial MLP output, and the residual."""
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.down_proj(silu_and_mul(self.gate_up_proj(normed))), residual


EAGER_HALVES = LayerHalves(
    pre=LlamaDecoderLayer.pre_attention_eager,
    post=LlamaDecoderLayer.post_attention_eager,
    attn_proj=LlamaDecoderLayer.attn_proj_eager,
    mlp=LlamaDecoderLayer.mlp_eager,
)


def compile_halves() -> LayerHalves:
    """The layer halves through `torch.compile` (inductor, no graph breaks allowed).

    Shapes are dynamic: one compiled kernel set serves every token count (dynamo still
    specializes size 1), so capturing N buckets costs a few compiles, not N (on a 2-core
    EPYC: 6 decode buckets of tiny-random captured in 38 s dynamic vs 97 s static, 11 s
    from inductor's warm cache). Compilation happens on the first call per new shape class.
    """
    options: dict[str, Any] = {"backend": "inductor", "fullgraph": True, "dynamic": True}
    return LayerHalves(
        pre=torch.compile(LlamaDecoderLayer.pre_attention_eager, **options),
        post=torch.compile(LlamaDecoderLayer.post_attention_eager, **options),
        attn_proj=torch.compile(LlamaDecoderLayer.attn_proj_eager, **options),
        mlp=torch.compile(LlamaDecoderLayer.mlp_eager, **options),
    )


class LlamaForCausalLM(nn.Module):
    """Token ids (or embeddings) in, final hidden states out; `compute_logits` for the head."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        plan: ShardPlan | None = None,
        comm: TpComm | None = None,
    ) -> None:
        """Parameters are allocated uninitialized; a loader fills every one of them. With a
        `plan` of size > 1 this is one rank's shard and `comm` its group."""
        super().__init__()
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        self.config = config
        self.plan = plan or ShardPlan.single(config)
        self.comm = comm or TpComm()
        if self.plan.size != self.comm.size:
            raise ValueError(
                f"shard plan of size {self.plan.size} with a group of size {self.comm.size}"
            )
        self.max_positions = max_positions
        self.activation_dtype = dtype  # of the residual stream, attention and the KV cache
        vocab_rows = self.plan.vocab_per_rank
        # A loader may install a quantized embedding (any module with Embedding's interface).
        self.embed_tokens: nn.Module = Embedding(vocab_rows, config.hidden_size, **dd)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, plan=self.plan, comm=self.comm, **dd)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        # None when tied to the embedding; a loader may install a quantized or packed head
        # (any module with Linear's interface; a packed one also when tied).
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, vocab_rows, False, **dd)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, device=device
        )

    @contextmanager
    def using_halves(self, halves: LayerHalves) -> Iterator[None]:
        """Run every layer's halves through `halves` (e.g. compiled) inside the block."""
        previous = [layer.halves for layer in self.decoder_layers]
        for layer in self.decoder_layers:
            layer.halves = halves
        try:
            yield
        finally:
            for layer, old in zip(self.decoder_layers, previous, strict=True):
                layer.halves = old

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast(list[LlamaDecoderLayer], list(self.layers))

    def embed(
        self, input_ids: torch.Tensor | None, input_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        if input_embeds is not None:
            return input_embeds.to(self.activation_dtype)
        assert input_ids is not None
        if not self.comm.enabled:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: rows outside this rank's range read row 0 and are zeroed, then the
        # ranks' partial embeddings are summed (exactly one rank holds each id).
        local = input_ids - self.plan.vocab_start
        mine = (local >= 0) & (local < self.plan.vocab_per_rank)
        hidden = self.embed_tokens(local * mine) * mine.unsqueeze(-1).to(self.activation_dtype)
        return self.comm.all_reduce_(hidden)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        fb: ForwardBatch,
        attn: AttentionBackend,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] for every token of the batch."""
        hidden = self.embed(input_ids, input_embeds)
        residual: torch.Tensor | None = None
        for layer in self.decoder_layers:
            q, k, v, residual = layer.pre_attention(positions, hidden, residual, self.rotary)
            attn_out = attn.forward(q, k, v, layer.layer_id, fb)
            hidden, residual = layer.post_attention(attn_out, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last token: [bs, vocab] float32."""
        if fb.forward_mode.is_extend():
            assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
            hidden = hidden[fb.extend_start_loc + fb.extend_seq_lens - 1]
        if self.lm_head is None:  # tied to a float embedding
            assert isinstance(self.embed_tokens, Embedding)
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if not self.comm.enabled:
            return logits
        # Vocab-parallel head: every rank's columns, in rank order, minus the padding.
        return self.comm.all_gather_last(logits)[:, : self.config.vocab_size]
