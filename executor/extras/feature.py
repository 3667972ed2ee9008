"""The extra outputs as a step feature (`executor.core.features`).

admit: every rule and byte cap (`plan_outputs`, against the pooled counts as the steps before
left them) -> staged fields: the plan's index arrays -> apply: the pooled counts, on the host
(released rows drop to 0, MEAN rows hold this step's tokens), so the next batch's admission
sees them -> outputs: the asked values computed on the device after the forward, read back in
the step's one transfer -> commit: the Ragged results, and the MEAN rows' device sums ->
undo: the counts before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor.core.features import FeatureStep
from executor.core.limits import BatchLimits
from executor.core.outputs import ForwardOutput
from executor.core.step_batch import StepBatch
from executor.extras.compute import Computed, PooledSums, assemble, compute, finish
from executor.extras.plan import OutputsPlan, StagedOutputs, plan_outputs
from executor.models.decoder_model import DecoderModel
from ops.future_tokens import resolve_future_tokens
from ops.h2d_staging import StagedField

NO_ROWS = np.zeros(0, dtype=np.int64)  # one shared empty array (read-only), not one a step
NO_ROWS.flags.writeable = False


class Extras:
    def __init__(
        self,
        limits: BatchLimits,
        model: DecoderModel,
        pooled: PooledSums,
        *,
        future_table: torch.Tensor,
        tp_size: int,
    ) -> None:
        self.limits = limits
        self.model = model
        self.pooled = pooled
        self.future_table = future_table
        self.tp_size = tp_size

    def admit(self, sb: StepBatch) -> ExtrasPart | None:
        host = sb.host
        plan = plan_outputs(
            host,
            self.limits,
            num_layers=self.model.config.num_layers,
            pooled=self.pooled.counts,
            tp_size=self.tp_size,
        )
        released = NO_ROWS
        if host.released_req_pool_indices is not None:
            rows = host.released_req_pool_indices.numpy().astype(np.int64)
            released = rows[self.pooled.counts[rows] > 0]  # rows that pooled something
        if plan is None and not released.size:
            return None
        return ExtrasPart(self, plan, released)


@dataclass(eq=False)
class ExtrasPart(FeatureStep):
    extras: Extras
    plan: OutputsPlan | None  # None: the step only releases pooled rows
    released: np.ndarray  # released rows whose pooled count drops to 0
    staged: StagedOutputs | None = None
    computed: Computed | None = None
    old_counts: tuple[np.ndarray, np.ndarray] | None = None  # (rows, counts) before apply

    def staged_fields(self) -> list[StagedField]:
        return [] if self.plan is None else self.plan.staged_fields()

    def apply(self, sb: StepBatch, staged: Sequence[torch.Tensor]) -> None:
        counts = self.extras.pooled.counts
        mean_rows = np.zeros(0, dtype=np.int64)
        if self.plan is not None:
            self.staged = StagedOutputs.of(self.plan, staged)
            h = self.plan.hidden
            if h is not None:
                mean_rows = self.plan.rows[h.positions][h.mean]
        rows = np.concatenate([self.released, mean_rows])
        self.old_counts = (rows, counts[rows].copy())
        counts[self.released] = 0
        if mean_rows.size:
            assert self.plan is not None and self.plan.hidden is not None
            counts[mean_rows] = self.plan.hidden.new_counts[self.plan.hidden.mean]

    def outputs(self, sb: StepBatch) -> list[torch.Tensor]:
        if self.plan is None:
            return []
        assert self.staged is not None and sb.ran is not None
        fb = sb.staged_device()
        ids = fb.input_ids
        if ids is not None and fb.future_refs:
            ids = resolve_future_tokens(ids, self.extras.future_table)
        e = self.extras
        self.computed = compute(
            self.plan, sb.ran, e.model, self.staged, ids, fb.req_pool_indices, e.pooled
        )
        return self.computed.tensors

    def commit(self, sb: StepBatch, out: ForwardOutput, host: list[torch.Tensor]) -> None:
        if self.plan is None:
            return
        assert self.computed is not None
        out.extras = assemble(self.plan, host)
        finish(self.computed, self.extras.pooled)

    def undo(self, sb: StepBatch) -> None:
        if self.old_counts is not None:
            rows, before = self.old_counts
            self.extras.pooled.counts[rows] = before
            self.old_counts = None
