"""The pieces decoder families share: rotary attention projections, the gated MLP, and the
pre-norm decoder layer that strings them together.

A layer runs in two halves around attention (the backend runs attention itself, between
them): `pre_attention` (norm, fused QKV projection, optional per-head q/k norm, rotary) and
`post_attention` (output projection, norm, MLP). The residual stream travels as a pair
`(hidden, residual)` whose sum is the layer input, so each RMSNorm fuses the residual add in
front of it (the same arithmetic as Hugging Face's "residual + x, then norm").

Each half runs through the layer's `compiled_fns`: plain functions, or the same functions
through `torch.compile` (the compiled graph backend swaps them in with
`DecoderModel.using_compiled_fns`). Tensor parallelism: the post half splits in two around
the all-reduces (the output projection's partial sums, then the MLP's), so a compiled
function never contains a collective (torch.compile's full-graph mode and gloo need that).
A family subclasses `DecoderLayer` and overrides the `_`-prefixed steps it does differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor.core.names import INDUCTOR
from executor.models.config import ModelConfig
from executor.models.layers import Linear, RMSNorm
from executor.models.lora_layers import LoraSite
from executor.models.sharding import ShardPlan
from executor.parallel.comm import TpComm
from ops.activation import silu_and_mul
from ops.rotary import RotaryEmbedding

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# Checkpoint names of these blocks (a family's tables start from them; see DecoderModel).
ATTENTION_LINEARS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
}
MLP_LINEARS: dict[str, tuple[str, ...]] = {
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
DENSE_LINEARS = {**ATTENTION_LINEARS, **MLP_LINEARS}
DENSE_SPLITS: dict[str, tuple[int, str]] = {
    "*.self_attn.q_proj.weight": (0, "q"),
    "*.self_attn.q_proj.bias": (0, "q"),
    "*.self_attn.k_proj.weight": (0, "kv"),
    "*.self_attn.k_proj.bias": (0, "kv"),
    "*.self_attn.v_proj.weight": (0, "kv"),
    "*.self_attn.v_proj.bias": (0, "kv"),
    "*.self_attn.o_proj.weight": (1, "q"),
    "*.mlp.gate_proj.weight": (0, "mlp"),
    "*.mlp.up_proj.weight": (0, "mlp"),
    "*.mlp.down_proj.weight": (1, "mlp"),
    "model.embed_tokens.weight": (0, "vocab"),
    "lm_head.weight": (0, "vocab"),
}
GGUF_DENSE_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class LayerBuild:
    """What every layer of a model is built from: the config, this rank's part of it, the
    group that sums the partial outputs, and where the weights live."""

    config: ModelConfig
    plan: ShardPlan
    comm: TpComm
    device: torch.device
    dtype: torch.dtype

    @property
    def dd(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype}


@dataclass(frozen=True)
class LayerFns:
    """The functions a decoder layer runs around attention: plain, or compiled.

    Every layer calls the same functions with itself as the first argument, so a compiled
    set is compiled once per input shape and shared by all layers (dynamo inlines the layer
    and lifts its weights as inputs: regional compilation), not once per layer.
    """

    pre: Callable[..., QKV]
    post: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # Tensor parallel: the post half's two pieces between the all-reduces.
    attn_proj: Callable[..., torch.Tensor]
    mlp: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _pre(
    layer: DecoderLayer,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rotary: RotaryEmbedding,
) -> QKV:
    return layer._pre_attention(positions, hidden, residual, rotary)


def _post(
    layer: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return layer._post_attention(attn_out, residual)


def _attn_proj(layer: DecoderLayer, attn_out: torch.Tensor) -> torch.Tensor:
    return layer._attn_proj(attn_out)


def _mlp(
    layer: DecoderLayer, hidden: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return layer._mlp(hidden, residual)


EAGER_FNS = LayerFns(pre=_pre, post=_post, attn_proj=_attn_proj, mlp=_mlp)


def compile_layer_fns(compiler: str = INDUCTOR) -> LayerFns:
    """The layer functions through `torch.compile` (`compiler`: inductor, or `eager` for the
    eager kernels; `executor.core.names.GRAPH_COMPILERS`), no graph breaks allowed.

    Shapes are dynamic: one compiled kernel set serves every token count (dynamo still
    specializes size 1), so capturing N buckets costs a few compiles, not N. Compilation
    happens on the first call per new shape class (and per layer class).
    """
    options: dict[str, Any] = {"backend": compiler, "fullgraph": True, "dynamic": True}
    return LayerFns(
        pre=torch.compile(_pre, **options),
        post=torch.compile(_post, **options),
        attn_proj=torch.compile(_attn_proj, **options),
        mlp=torch.compile(_mlp, **options),
    )


class RotaryAttention(nn.Module):
    """This rank's attention projections: fused QKV (optionally biased), per-head q/k
    RMSNorm when `qk_norm` (Qwen3), rotary, and the output projection (no bias)."""

    def __init__(
        self,
        config: ModelConfig,
        plan: ShardPlan,
        *,
        qk_norm: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        self.num_heads = plan.num_heads
        self.num_kv_heads = plan.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = plan.num_heads * config.head_dim
        self.kv_size = plan.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, **dd
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, False, **dd)
        # The adapters of each linear (`<linear>_lora`), attached when LoRA is on.
        self.qkv_proj_lora: LoraSite | None = None
        self.o_proj_lora: LoraSite | None = None
        # Over head_dim, so every rank holds them whole.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **dd) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **dd) if qk_norm else None

    def qkv(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], rotated."""
        qkv = self.qkv_proj(x)
        if self.qkv_proj_lora is not None:
            qkv = self.qkv_proj_lora(x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q, None)[0]
            k = self.k_norm(k, None)[0]
        q, k = rotary(positions, q, k)
        return q, k, v

    def out(self, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out [T, Hq, D] -> [T, hidden] (this rank's partial sum under tensor parallelism)."""
        x = attn_out.reshape(-1, self.q_size)
        out = self.o_proj(x)
        return out if self.o_proj_lora is None else self.o_proj_lora(x, out)


class GatedMLP(nn.Module):
    """`down(act(gate) * up)` with gate and up fused into one column-parallel projection."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        act_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, False, device=device, dtype=dtype
        )
        self.down_proj = Linear(intermediate_size, hidden_size, False, device=device, dtype=dtype)
        self.act_and_mul = act_and_mul
        self.gate_up_proj_lora: LoraSite | None = None  # attached when LoRA is on
        self.down_proj_lora: LoraSite | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_up_proj_lora is not None:
            gate_up = self.gate_up_proj_lora(x, gate_up)
        h = self.act_and_mul(gate_up)
        out = self.down_proj(h)
        return out if self.down_proj_lora is None else self.down_proj_lora(h, out)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: `h = x + attn(norm(x))`, then `h + mlp(norm(h))`.

    `mlp` is any module from [T, hidden] to [T, hidden] whose output is a partial sum over
    the ranks under tensor parallelism (`GatedMLP`, a mixture of experts).
    """

    # The attention window of this layer, None: global. The attention backend reads it.
    sliding_window: int | None = None

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        self_attn: RotaryAttention,
        mlp: nn.Module,
        *,
        comm: TpComm,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        self.layer_id = layer_id
        self.comm = comm
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.mlp = mlp
        self.compiled_fns = EAGER_FNS

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
    ) -> QKV:
        """-> q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], residual [T, hidden]."""
        return self.compiled_fns.pre(self, positions, hidden, residual, rotary)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn_out [T, Hq, D] -> (hidden, residual), both [T, hidden]."""
        fns = self.compiled_fns
        if not self.comm.enabled:
            return fns.post(self, attn_out, residual)
        hidden = self.comm.all_reduce_(fns.attn_proj(self, attn_out))
        hidden, residual = fns.mlp(self, hidden, residual)
        return self._mlp_output(self.comm.all_reduce_(hidden)), residual

    # --- the steps a family may override --------------------------------------------------
    def _pre_attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
    ) -> QKV:
        normed, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.self_attn.qkv(positions, normed, rotary)
        return q, k, v, residual

    def _attn_proj(self, attn_out: torch.Tensor) -> torch.Tensor:
        """This rank's partial output projection (summed over the ranks next)."""
        return self.self_attn.out(attn_out)

    def _mlp(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, then this rank's partial MLP output, and the residual."""
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual

    def _mlp_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The summed MLP output's last step before the residual add (a sandwich-norm
        family's post-feedforward norm); nothing here."""
        return hidden

    def _post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self._mlp(self._attn_proj(attn_out), residual)
        return self._mlp_output(hidden), residual
