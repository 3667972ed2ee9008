"""The future-token table as a step feature.

admit: work only for a batch that assigns or releases future slots (validation checked its
references and assignments against `assigned`) -> apply: the releases, then the step's slots
marked assigned, on the host, so the next batch may reference them -> sampled: the sampled ids
stored at the step's slots on the device (the next step may be launched behind this one) ->
commit: rank 0's host mirror -> undo: the host state and the slots' device values before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor.core.features import FeatureStep
from executor.core.outputs import ForwardOutput
from executor.core.step_batch import StepBatch
from executor.future_tokens.table import FutureChange, FutureTokenTable


class FutureTokens:
    def __init__(self, table: FutureTokenTable) -> None:
        self.table = table

    def admit(self, sb: StepBatch) -> FutureTokensStep | None:
        host = sb.host
        if host.future_token_slots is None and host.released_future_slots is None:
            return None
        return FutureTokensStep(self.table)


@dataclass(eq=False)
class FutureTokensStep(FeatureStep):
    table: FutureTokenTable
    change: FutureChange | None = None
    stored: tuple[torch.Tensor, torch.Tensor] | None = None  # slots, their values before

    def apply(self, sb: StepBatch, staged: Sequence[torch.Tensor]) -> None:
        self.change = self.table.apply(sb.host)

    def sampled(self, sb: StepBatch, ids: torch.Tensor) -> None:
        slots = sb.staged_device().future_token_slots
        before = self.table.store(slots, ids)
        if slots is not None and before is not None:
            self.stored = (slots, before)

    def commit(self, sb: StepBatch, out: ForwardOutput, host: list[torch.Tensor]) -> None:
        self.table.mirror(sb.host.future_token_slots, out.next_token_ids)

    def undo(self, sb: StepBatch) -> None:
        if self.stored is not None:
            self.table.restore(*self.stored)
            self.stored = None
        if self.change is not None:
            self.table.undo(self.change)
            self.change = None
