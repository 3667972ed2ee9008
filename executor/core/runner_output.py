"""What one path of the model runner returns for a step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from registry import FillStats


@dataclass(frozen=True)
class GraphFallback:
    """Why a batch ran eagerly although its graph mode is on: the graph `kind` wanted
    (`decode` | `piecewise`) and a fixed `reason` token (a metric label). The wire carries it
    as `"<kind>:<reason>"` (`str()`)."""

    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.reason}"

    @classmethod
    def parse(cls, text: str) -> GraphFallback | None:
        """The inverse of `str()`; None for the wire's empty string."""
        if not text:
            return None
        kind, _, reason = text.partition(":")
        return cls(kind, reason)


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [bs, vocab] float32, on the device
    path: str  # eager | eager_no_copy | full_graph | piecewise
    padded_batch_size: int
    padded_num_tokens: int
    # eager_decode | eager_extend | graph_decode | graph_extend; None if nothing was staged
    fill_registry: str | None = None
    fill_stats: FillStats = field(default_factory=FillStats)
    # Graph mode wanted a graph path for this batch but it ran eagerly, and why.
    graph_fallback: GraphFallback | None = None
    # Final-normed hidden states of every (padded) token, on the device, valid until the next
    # step (a graph's buffer); and the named layers' streams a batch asked for (eager only).
    hidden: torch.Tensor | None = None
    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    # The batch's routed expert ids when a row asked (eager only): int32 [tokens, moe layers, k].
    routed: torch.Tensor | None = None
