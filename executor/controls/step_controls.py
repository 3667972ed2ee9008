"""`StepControls`: the sampling controls as a step feature (`executor.core.features`).

admit (host: the rules and the step's plan, against the host mirror as the steps before left
it; nothing changes) -> staged fields (in the step's one upload) -> apply (row state written
from the staged copies; undone with the step) -> launch (the step's tokens recorded at their
KV slots: always, the history of later requests; it reads the future-token table, which the
step before stored at its read) -> logits (the deferred mask awaited, the rules applied)
-> commit (the rows each control touched, in the step's stats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor.controls.admission import ControlsStep, admit_controls, with_deferred_mask
from executor.controls.rules import controlled_logits
from executor.controls.slot_tokens import SlotTokens
from executor.controls.state import DEVICE_FIELDS, RowControlState, StateUndo
from executor.core.errors import BatchValidationError
from executor.core.features import FeatureStep
from executor.core.limits import BatchLimits
from executor.core.outputs import ForwardOutput
from executor.core.step_batch import StepBatch
from ops.h2d_staging import StagedField
from ops.host_transfer import to_device

# GetInfo.sampling_controls: the proto's SamplingControls fields, and the step masks.
CONTROL_NAMES = (
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "banned_token_ids",
    "allowed_token_ids",
    "vocab_mask",
    "vocab_mask_deferred",
)


class StepControls:
    def __init__(
        self,
        limits: BatchLimits,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        *,
        deferred_mask_timeout_s: float,
        req_to_token: torch.Tensor,
        future_table: torch.Tensor,
    ) -> None:
        """`req_to_token`: the row table (the penalties' history); `future_table`: the
        future-token table (references among the recorded tokens)."""
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.deferred_mask_timeout_s = deferred_mask_timeout_s
        self.req_to_token = req_to_token
        self.future_table = future_table
        self.state = RowControlState(
            limits.max_reqs, limits.vocab_size, limits.max_logit_bias, device
        )
        self.slot_tokens = SlotTokens(limits.kv_slots, device)

    def admit(self, sb: StepBatch) -> ControlsPart:
        """Every control rule of the batch; a part for every step (each records its tokens)."""
        step = admit_controls(sb.host, self.state, self.limits, self.eos_token_ids)
        if step is not None and sb.host.forward_mode.is_verify():
            raise BatchValidationError(
                "req_pool_indices", "VERIFY rows may not have sampling controls set"
            )
        return ControlsPart(self, step)


@dataclass(frozen=True)
class StagedControls:
    """The device copies of a `ControlsStep`'s staged fields, in their order."""

    rows: torch.Tensor | None  # the rows the step writes (None: it writes none)
    values: tuple[torch.Tensor, ...]  # their values, one per `DEVICE_FIELDS` name
    positions: torch.Tensor | None  # the batch positions the rules touch
    mask: torch.Tensor | None  # their step mask

    @classmethod
    def of(cls, step: ControlsStep, staged: Sequence[torch.Tensor]) -> StagedControls:
        it = iter(staged)
        rows = next(it) if step.update is not None else None
        values = tuple(next(it) for _ in DEVICE_FIELDS) if rows is not None else ()
        positions = next(it) if step.acts else None
        mask = next(it) if step.mask_words is not None else None
        return cls(rows, values, positions, mask)


@dataclass(eq=False)
class ControlsPart(FeatureStep):
    controls: StepControls
    step: ControlsStep | None  # None: no control work this step (its tokens are recorded)
    staged: StagedControls | None = None
    state_undo: StateUndo | None = None

    def staged_fields(self) -> list[StagedField]:
        return [] if self.step is None else self.step.staged_fields()

    def apply(self, sb: StepBatch, staged: Sequence[torch.Tensor]) -> None:
        if self.step is None:
            return
        self.staged = StagedControls.of(self.step, staged)
        if self.step.update is not None:
            assert self.staged.rows is not None
            self.state_undo = self.controls.state.apply(
                self.step.update, self.staged.rows, self.staged.values
            )

    def launch(self, sb: StepBatch) -> None:
        """The step's new tokens at their KV slots (the device batch: VERIFY's drafted ids)."""
        fb = sb.staged_device()
        table = self.controls.future_table if fb.future_refs else None
        self.controls.slot_tokens.write(fb.out_cache_loc, fb.input_ids, table)

    def logits(self, sb: StepBatch, logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling draws from, after the step's final controls (with its deferred
        mask, which this waits for: DeferredMaskTimeout, or a refusal of a bad mask)."""
        c, host, step = self.controls, sb.host, self.step
        positions = None if self.staged is None else self.staged.positions
        step_mask = None if self.staged is None else self.staged.mask
        if host.deferred_mask is not None:
            mask = host.deferred_mask.wait(c.deferred_mask_timeout_s)
            step = self.step = with_deferred_mask(step, mask, host, c.state)
            # The mask came after the step's upload: its own copy (positions with it).
            positions = to_device(torch.from_numpy(step.positions), c.device, "vocab_mask")
            step_mask = (
                None
                if step.mask_words is None
                else to_device(torch.from_numpy(step.mask_words), c.device, "vocab_mask")
            )
        if step is None or not step.acts:
            return logits
        assert positions is not None
        fb = sb.staged_device()
        return controlled_logits(
            logits,
            step,
            positions=positions,
            step_mask=step_mask,
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
            state=c.state,
            slot_tokens=c.slot_tokens,
            req_to_token=c.req_to_token,
        )

    def commit(self, sb: StepBatch, out: ForwardOutput, host: list[torch.Tensor]) -> None:
        if self.step is not None:
            out.stats.control_rows = self.step.control_rows

    def undo(self, sb: StepBatch) -> None:
        if self.state_undo is not None:
            self.controls.state.undo(self.state_undo)
            self.state_undo = None
