"""The adapters' side of a linear layer: every slot's LoRA A and B, and each token's product
with its own slot's adapter, for a whole mixed batch at once.

A `LoraSite` sits beside one (fused) linear layer of a decoder layer (`qkv_proj`, `o_proj`,
`gate_up_proj`, `down_proj`: the block calls it on the layer's input and output). For `P`
projections fused into that layer (q, k, v: 3), `S` slots and the rank cap `R` it holds

- `a`: [P * S * R, in] - row (p, s, j) is rank j of projection p's A in slot s + 1;
- `b`: [out, S * R] - the fused layer's output columns (each projection's, in order) by
  (slot, rank), the PEFT scaling (alpha / r) folded in.

An adapter of rank r < R fills the first r rows / columns of its slot and leaves the rest
zero, as it leaves a projection it does not target. The product for a batch is two dense
matmuls per projection over every slot, with each token's columns of the other slots zeroed:

    xa = (x @ a.T).view(T, P, S * R) * mask        # mask [T, S * R]: 1 on the token's slot
    out[:, projection p] += xa[:, p] @ b[p's rows].T

The mask (`LoraBatch`) is built once per forward from the per-token slot index; slot 0 (the
base model) masks every column. Static shapes, no gather and no loop over rows or adapters:
the same code runs eagerly and inside a captured graph (which holds `a`, `b` and the index
buffer). A forward without LoRA rows sets no mask and the sites do nothing. The cost grows
with S * R, not with the adapters a batch uses (docs/performance.md).

Under tensor parallelism a site holds this rank's part, cut as its base layer is: a
column-parallel layer's B rows (its output columns), a row-parallel layer's A columns (its
input), so the delta joins the base output's partial sum before the all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class LoraBatch:
    """The running forward's adapter mask, shared by every site of a model.

    `set` is called at the start of every forward (and every piecewise piece) with the
    batch's per-token slot index, or None: no site does any work then."""

    def __init__(self, slots: int, rank: int, *, device: torch.device, dtype: torch.dtype):
        self.slots = slots
        self.rank = rank
        self.dtype = dtype
        # [S * R]: the slot each mask column belongs to (1..S)
        self.cols = torch.arange(1, slots + 1, dtype=torch.int32, device=device)
        self.cols = self.cols.repeat_interleave(rank)
        self.mask: torch.Tensor | None = None  # [T, S * R] in the activation dtype

    def set(self, token_slots: torch.Tensor | None) -> None:
        """token_slots [T] int32 (0: base) -> the mask the sites read; None: no LoRA."""
        if token_slots is None:
            self.mask = None
        else:
            self.mask = (token_slots.unsqueeze(1) == self.cols).to(self.dtype)


class LoraSite(nn.Module):
    """Every slot's adapter of one fused linear layer (see the module docstring)."""

    def __init__(
        self,
        batch: LoraBatch,
        in_features: int,
        outs: tuple[int, ...],
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        self.batch = batch
        self.in_features = in_features
        self.parts = len(outs)
        self.width = batch.slots * batch.rank  # S * R
        starts = [sum(outs[:i]) for i in range(len(outs))]
        self.spans = tuple(zip(starts, outs, strict=True))  # each projection's output columns
        # Buffers (not parameters, not saved): a weight update never touches them, and
        # dynamo lifts them as inputs, so one compiled function serves every layer.
        self.a: torch.Tensor
        self.b: torch.Tensor
        self.register_buffer("a", torch.zeros(self.parts * self.width, in_features, **dd), False)
        self.register_buffer("b", torch.zeros(sum(outs), self.width, **dd), False)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output on `x`) plus each token's adapter delta."""
        mask = self.batch.mask
        if mask is None:
            return out
        x2 = x.reshape(-1, self.in_features)
        n = x2.shape[0]
        xa = F.linear(x2, self.a).view(n, self.parts, self.width) * mask.unsqueeze(1)
        if self.parts == 1:
            delta = F.linear(xa[:, 0], self.b)
        else:
            delta = torch.cat(
                [F.linear(xa[:, p], self.b[s : s + w]) for p, (s, w) in enumerate(self.spans)],
                dim=-1,
            )
        return out + delta.view(out.shape)

    def write_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` (1..S) holds `parts`: per projection (A [r, in], B [out, r]) on this
        device in the activation dtype, scaling folded into B, or None (not adapted)."""
        s, rank = slot - 1, self.batch.rank
        a = self.a.view(self.parts, self.batch.slots, rank, self.in_features)[:, s]
        b = self.b.view(-1, self.batch.slots, rank)[:, s]
        a.zero_()
        b.zero_()
        for p, part in enumerate(parts):
            if part is None:
                continue
            pa, pb = part
            r = pa.shape[0]
            start, width = self.spans[p]
            a[p, :r].copy_(pa)
            b[start : start + width, :r].copy_(pb)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, spans={self.spans}, width={self.width}"
