"""The adapter of each row, as a step feature (`executor.core.features`).

A row's adapter is row state, like its sampling controls: set by the batch that starts the
request (or any later batch naming the row: `ForwardBatch.row_adapters`), kept for every later
batch of the row, cleared when `released_req_pool_indices` frees it (a row freed and reused in
the same batch starts with the base model), and all-or-nothing per batch.

admit (host: the entries' rules; the rows' slots after the batch's releases and entries; the
batch's per-token slot index `lora_slots`, a derived field of the batch, so it travels in the
step's one upload and to the other tensor-parallel ranks with the batch) -> apply (the host
table; nothing lives on the device: the index is the batch's) -> commit (the rows that ran
an adapter, in the stats) -> undo (the table before). A batch with no adapter row and no change
gets no part and no index: the model runs no LoRA work for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor.core.errors import BatchValidationError
from executor.core.features import FeatureStep
from executor.core.outputs import ForwardOutput
from executor.core.step_batch import StepBatch


class RowSlots:
    """The host table: each row's adapter slot (0: the base model), rows 0..max_reqs."""

    def __init__(self, max_reqs: int) -> None:
        self.slot = np.zeros(max_reqs + 1, dtype=np.int32)

    def rows_using(self, slot: int) -> list[int]:
        return [int(r) for r in np.flatnonzero(self.slot == slot)]

    def running(self, slots: int) -> np.ndarray:
        """Rows per slot, [slots + 1] (index 0: the base model's rows, unreleased or not)."""
        return np.bincount(self.slot, minlength=slots + 1)


class LoraRows:
    """The step feature; `names` maps a loaded adapter's name to its slot (the adapters')."""

    def __init__(self, table: RowSlots, names: dict[str, int]) -> None:
        self.table = table
        self.names = names

    def admit(self, sb: StepBatch) -> LoraRowsStep | None:
        host = sb.host
        rows = host.req_pool_indices.numpy().astype(np.int64, copy=False)
        table = self.table.slot
        changes: dict[int, int] = {}
        if host.released_req_pool_indices is not None:
            for r in host.released_req_pool_indices.tolist():
                if table[r]:
                    changes[r] = 0
        if host.row_adapters:
            in_batch = set(rows.tolist())
            seen: set[int] = set()
            for i, entry in enumerate(host.row_adapters):
                field = f"row_adapters[{i}]"
                if entry.row not in in_batch:
                    raise BatchValidationError(
                        f"{field}.req_pool_index", f"row {entry.row} is not in this batch"
                    )
                if entry.row in seen:
                    raise BatchValidationError(
                        f"{field}.req_pool_index", f"row {entry.row} has more than one entry"
                    )
                seen.add(entry.row)
                slot = self.names.get(entry.name, -1) if entry.name else 0
                if slot < 0:
                    raise BatchValidationError(
                        f"{field}.adapter",
                        f"no adapter named {entry.name!r} is loaded (GetInfo lists the loras)",
                    )
                changes[entry.row] = slot
        slots = table[rows]
        for i, r in enumerate(rows.tolist()):
            if r in changes:
                slots[i] = changes[r]
        lora_rows = int(np.count_nonzero(slots))
        if not changes and not lora_rows:
            return None
        if lora_rows:
            if host.forward_mode.is_extend():
                assert host.extend_seq_lens_cpu is not None
                token_slots = np.repeat(slots, host.extend_seq_lens_cpu)
            else:  # DECODE: one token per row
                token_slots = slots
            sb.host = host.replace(lora_slots=torch.from_numpy(token_slots.astype(np.int32)))
        return LoraRowsStep(self.table, changes, lora_rows)


@dataclass(eq=False)
class LoraRowsStep(FeatureStep):
    table: RowSlots
    changes: dict[int, int]  # row -> its slot after this step
    lora_rows: int  # rows of the batch that run an adapter
    before: dict[int, int] | None = None

    def apply(self, sb: StepBatch, staged: Sequence[torch.Tensor]) -> None:
        table = self.table.slot
        self.before = {r: int(table[r]) for r in self.changes}
        for r, slot in self.changes.items():
            table[r] = slot

    def commit(self, sb: StepBatch, out: ForwardOutput, host: list[torch.Tensor]) -> None:
        out.stats.lora_rows = self.lora_rows

    def undo(self, sb: StepBatch) -> None:
        if self.before is not None:
            for r, slot in self.before.items():
                self.table.slot[r] = slot
            self.before = None
