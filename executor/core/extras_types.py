"""The host shapes of the extra outputs: what a request asks (`RowOutputs`) and what comes
back (`ExtraOutputs`, Ragged: flat values in batch order plus per-row lengths)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class Pooling(IntEnum):
    """Values match the wire enum `model_executor.v1.Pooling`."""

    LAST = 0
    MEAN = 1


@dataclass(frozen=True)
class HiddenAsk:
    pooling: Pooling = Pooling.LAST
    layer: int | None = None  # output_hidden_states index; None: the final, normed one
    bfloat16: bool = False


@dataclass(frozen=True)
class RowOutputs:
    """What the request in `row` (a row of the batch) wants this step; the proto's rules."""

    row: int
    prompt_logprobs: bool = False
    logprob_start_len: int = 1
    next_prompt_token: int | None = None
    score_token_ids: tuple[int, ...] = ()
    hidden: HiddenAsk | None = None
    routed_experts: bool = False  # the top-k expert ids of the row's tokens, every MoE layer


def asks_routed_experts(asks: tuple[RowOutputs, ...]) -> bool:
    """Whether a batch asks for routed experts (they are recorded on the eager path)."""
    return any(a.routed_experts for a in asks)


def hidden_layers(asks: tuple[RowOutputs, ...], num_layers: int) -> tuple[int, ...]:
    """The non-final hidden states a batch asks for (they need the eager path)."""
    layers = {
        a.hidden.layer
        for a in asks
        if a.hidden is not None and a.hidden.layer is not None and a.hidden.layer != num_layers
    }
    return tuple(sorted(layers))


@dataclass
class Ragged:
    """`values` [n, ...] of every row in batch order; `lengths` [bs] int32."""

    values: torch.Tensor
    lengths: torch.Tensor

    def rows(self) -> list[torch.Tensor]:
        return list(torch.split(self.values, self.lengths.tolist()))


@dataclass
class ExtraOutputs:
    prompt_logprobs: Ragged | None = None
    prompt_top_logprobs: Ragged | None = None
    prompt_top_logprob_ids: Ragged | None = None
    token_scores: Ragged | None = None
    hidden_states: Ragged | None = None
    routed_experts: Ragged | None = None  # int32 [tokens, moe layers, top_k]
