"""The row table as a step feature: each batch's write into `req_to_token` and the resident
lengths, checked at admission and written from the step's staged cells.

admit: the write against the slot owners (`ReqToTokenPool.check_write`; a new token in a slot
a live row holds is refused) -> staged fields: the cells -> apply: released rows first, then
the cells and the lengths (`write_batch`) -> undo: exactly the table before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor.core.features import FeatureStep
from executor.core.step_batch import StepBatch
from executor.kv_cache import ReqToTokenPool, RowWrite, WritePlan
from ops.h2d_staging import StagedField


class RowTable:
    def __init__(self, pool: ReqToTokenPool) -> None:
        self.pool = pool

    def admit(self, sb: StepBatch) -> RowTableStep:
        # IDLE too: it may release rows.
        return RowTableStep(self.pool, self.pool.check_write(sb.host))


@dataclass(eq=False)
class RowTableStep(FeatureStep):
    pool: ReqToTokenPool
    plan: WritePlan
    write: RowWrite | None = None

    def staged_fields(self) -> list[StagedField]:
        return self.plan.cells.staged_fields()

    def apply(self, sb: StepBatch, staged: Sequence[torch.Tensor]) -> None:
        cells = self.plan.cells.on_device(staged)
        self.write = self.pool.write_batch(sb.host, device_cells=cells, plan=self.plan)

    def undo(self, sb: StepBatch) -> None:
        if self.write is not None:
            self.pool.undo(self.write)
            self.write = None
