"""`StepControls`: what the step calls for the sampling controls, in the step's order.

admit (host: rules and the step's plan; nothing changes) -> staged fields (in the step's one
upload) -> apply (row state written; undone with the step) -> record the step's tokens at
their KV slots (always: the history of later requests) -> at sampling, the deferred mask
awaited and the rules applied to the logits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from executor.controls.admission import ControlsStep, admit_controls, with_deferred_mask
from executor.controls.rules import controlled_logits
from executor.controls.slot_tokens import SlotTokens
from executor.controls.state import PREFIX, RowControlState, StateUndo
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
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
    ) -> None:
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.deferred_mask_timeout_s = deferred_mask_timeout_s
        self.state = RowControlState(
            limits.max_reqs, limits.vocab_size, limits.max_logit_bias, device
        )
        self.slot_tokens = SlotTokens(limits.kv_slots, device)

    def admit(self, batch: ForwardBatch) -> ControlsStep | None:
        """Every control rule of a validated batch; None when the step has no control work."""
        return admit_controls(batch, self.state, self.limits, self.eos_token_ids)

    @staticmethod
    def staged_fields(step: ControlsStep | None) -> list[StagedField]:
        return [] if step is None else step.staged_fields()

    def apply(
        self, step: ControlsStep | None, views: Mapping[str, torch.Tensor]
    ) -> StateUndo | None:
        if step is None or step.update is None:
            return None
        return self.state.apply(step.update, views)

    def undo(self, undo: StateUndo | None) -> None:
        if undo is not None:
            self.state.undo(undo)

    def record_tokens(self, fb: ForwardBatch, future_table: torch.Tensor | None) -> None:
        """The step's new tokens at their KV slots (device batch `fb`)."""
        self.slot_tokens.write(
            fb.out_cache_loc, fb.input_ids, future_table if fb.future_refs else None
        )

    def logits(
        self,
        logits: torch.Tensor,
        step: ControlsStep | None,
        host: ForwardBatch,
        fb: ForwardBatch,
        views: Mapping[str, torch.Tensor],
        req_to_token: torch.Tensor,
    ) -> tuple[torch.Tensor, ControlsStep | None]:
        """The logits sampling draws from, and the step's final controls (with its deferred
        mask, which this waits for: DeferredMaskTimeout, or a refusal of a bad mask)."""
        positions = views.get(PREFIX + "positions")
        step_mask = views.get(PREFIX + "mask")
        if host.deferred_mask is not None:
            mask = host.deferred_mask.wait(self.deferred_mask_timeout_s)
            step = with_deferred_mask(step, mask, host, self.state)
            # The mask came after the step's upload: its own copy (positions with it).
            positions = to_device(torch.from_numpy(step.positions), self.device, "vocab_mask")
            step_mask = (
                None
                if step.mask_words is None
                else to_device(torch.from_numpy(step.mask_words), self.device, "vocab_mask")
            )
        if step is None or not step.acts:
            return logits, step
        assert positions is not None
        out = controlled_logits(
            logits,
            step,
            positions=positions,
            step_mask=step_mask,
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
            state=self.state,
            slot_tokens=self.slot_tokens,
            req_to_token=req_to_token,
        )
        return out, step
