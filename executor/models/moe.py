"""A sparse mixture-of-experts MLP: a router picks the top k experts of each token, and the
experts run grouped, each once over the tokens routed to it.

Routing (Qwen-MoE, Mixtral): softmax over every expert in float32, the top k, optionally
renormalised to sum to 1 (`norm_topk_prob`). The experts' SiLU-gated MLPs are stacked
([E, 2I, H] gate-up, [E, H, I] down) and run as grouped matmuls over the token-expert
assignments sorted by expert (`F.grouped_mm` with device-side offsets), then each output,
times its routing weight, is added back to its token. Every shape is fixed by the token
count, and nothing reads a device value on the host, so the block runs inside a captured
graph. Where the grouped kernel does not take the dtype (CUDA, and torch.compile, want
bfloat16), every expert runs densely over every token, weighted by the routing weights (zero
where not chosen): the same values at E / k times the arithmetic.

Tensor parallelism shards every expert alike (gate-up column-parallel, down row-parallel,
on `ShardPlan.expert_intermediate_size`): the block's output is a partial sum, all-reduced
where a dense MLP's is (`DecoderLayer`), and every rank does the same work whatever the
routing. The router is replicated, so the ranks route identically.

Routed experts (`RowOutputs.routed_experts`): while a batch asks, the runner hands the blocks a
`RouteRecorder` buffer and each sparse block copies its top-k ids into its column; a batch that
asks nothing leaves `ids` None and the blocks record nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.models.config import MoeConfig
from executor.models.layers import Linear
from executor.models.weights import CheckpointTarget
from ops.activation import silu_and_mul

# `F.grouped_mm` is newer than the oldest torch the project runs on (>= 2.5): dense without it.
HAS_GROUPED_MM = hasattr(F, "grouped_mm")


class GroupedExperts(nn.Module):
    """This rank's part of every expert's weights, stacked; loads them itself from the
    per-expert checkpoint tensors (`checkpoint_targets`)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts = e
        self.gate_up = nn.Parameter(
            torch.empty(e, 2 * i, h, device=device, dtype=dtype), requires_grad=False
        )
        self.down = nn.Parameter(
            torch.empty(e, h, i, device=device, dtype=dtype), requires_grad=False
        )

    def checkpoint_targets(self, path: str, prefix: str) -> list[CheckpointTarget]:
        """Each expert's entries of `gate_up` (Hugging Face's `{prefix}{e}.gate_proj.weight`
        then `up_proj`) and `down` (`down_proj`); `path` is this module's."""
        targets = []
        for e in range(self.num_experts):
            gate_up = (f"{prefix}{e}.gate_proj.weight", f"{prefix}{e}.up_proj.weight")
            targets.append(CheckpointTarget(path, "gate_up", e, gate_up))
            targets.append(CheckpointTarget(path, "down", e, (f"{prefix}{e}.down_proj.weight",)))
        return targets

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] -> sum over k of weight * expert(x): [T, H]."""
        # The grouped kernel takes bfloat16 (on CUDA too), and float32 only eagerly on the
        # CPU: its meta kernel, which torch.compile traces with, wants bfloat16.
        if HAS_GROUPED_MM and (
            x.dtype == torch.bfloat16
            or (x.device.type == "cpu" and not torch.compiler.is_compiling())
        ):
            return self.grouped(x, ids, weights)
        return self.dense(x, ids, weights)

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)  # [T*k] the expert of each assignment
        order = flat.argsort(stable=True)  # assignments grouped by expert
        token = order // k  # [T*k] the token of each sorted assignment
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)  # end of each expert's rows
        gate_up = F.grouped_mm(x[token], self.gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
        out = F.grouped_mm(silu_and_mul(gate_up), self.down.transpose(1, 2), offs=offs)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)  # [T*k, H]
        return torch.zeros_like(x).index_add_(0, token, out)

    def dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        per_expert = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        per_expert.scatter_(1, ids, weights.to(x.dtype))  # [T, E], zero where not routed
        gate_up = torch.einsum("th,eoh->eto", x, self.gate_up)  # [E, T, 2I]
        out = torch.einsum("eti,ehi->eth", silu_and_mul(gate_up), self.down)  # [E, T, H]
        return torch.einsum("eth,te->th", out, per_expert)


class RouteRecorder:
    """The top-k expert ids of every token of the running step, in every sparse MoE layer:
    `ids` [tokens, len(layers), top_k] int32 while a batch asks (the runner sets and clears
    it), else None. One per model, shared by its sparse blocks (`attach_route_recorder`)."""

    def __init__(self, layers: tuple[int, ...], top_k: int) -> None:
        self.layers = layers  # the decoder layers with a sparse block, in column order
        self.top_k = top_k
        self.ids: torch.Tensor | None = None

    def start(self, num_tokens: int, device: torch.device) -> None:
        self.ids = torch.zeros(
            (num_tokens, len(self.layers), self.top_k), dtype=torch.int32, device=device
        )

    def take(self) -> torch.Tensor | None:
        ids, self.ids = self.ids, None
        return ids


def routed_expert_layout(model: nn.Module) -> tuple[tuple[int, ...], int]:
    """(the decoder layers with a sparse MoE block, top_k); ((), 0) for a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return tuple(b.layer_id for b in blocks), (blocks[0].top_k if blocks else 0)


def attach_route_recorder(model: nn.Module) -> RouteRecorder | None:
    """One recorder shared by `model`'s sparse MoE blocks (in layer order); None without any."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    layers = tuple(b.layer_id for b in blocks)
    recorder = RouteRecorder(layers, blocks[0].top_k)
    for column, block in enumerate(blocks):
        block.recorder, block.column = recorder, column
    return recorder


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) plus `experts`: [T, H] -> [T, H], a partial sum over the
    ranks under tensor parallelism."""

    def __init__(
        self,
        moe: MoeConfig,
        hidden_size: int,
        expert_intermediate_size: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        layer_id: int = 0,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.recorder: RouteRecorder | None = None  # attach_route_recorder
        self.column = 0  # this block's column of the recorder's ids
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts, False, device=device, dtype=dtype)
        self.experts = GroupedExperts(
            moe.num_experts, hidden_size, expert_intermediate_size, device=device, dtype=dtype
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], routing weights [T, k] in x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        rec = self.recorder
        if rec is not None and rec.ids is not None:  # a batch asks for its routed experts
            n = min(rec.ids.shape[0], ids.shape[0])
            rec.ids[:n, self.column].copy_(ids[:n])
        return self.experts(x, ids, weights)
