"""The controls applied to a step's logits on the device, in the proto's order.

Only the batch positions a control touches are read and rewritten (`ControlsStep.positions`);
rules no position uses are skipped (decided on the host at admission). A position that runs
with some rules but not others carries neutral values for the others, which change no bit.
"""

from __future__ import annotations

import torch

from executor.controls.admission import ControlsStep
from executor.controls.slot_tokens import SlotTokens
from executor.controls.state import RowControlState
from ops.logit_controls import (
    apply_bitmask,
    apply_logit_bias,
    apply_penalties,
    suppress,
    token_counts,
)


def controlled_logits(
    logits: torch.Tensor,
    step: ControlsStep,
    *,
    positions: torch.Tensor,
    step_mask: torch.Tensor | None,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    state: RowControlState,
    slot_tokens: SlotTokens,
    req_to_token: torch.Tensor,
) -> torch.Tensor:
    """A new [bs, V] tensor: `logits` with the controls applied (`logits` is kept, for the
    raw logprobs). `positions` [c] and `step_mask` [c, W] are the step's device copies."""
    vocab = logits.shape[1]
    sub = logits.index_select(0, positions)
    rows = req_pool_indices.index_select(0, positions).long()
    seq = seq_lens.index_select(0, positions).long()
    d = state.device
    if step.any_penalties:
        length = step.history_len
        history = slot_tokens.history(req_to_token, rows, length)
        at = torch.arange(length, device=logits.device).unsqueeze(0)
        in_row = at < seq.unsqueeze(1)
        output = in_row & (at >= d["prompt_len"].index_select(0, rows).unsqueeze(1))
        sub = apply_penalties(
            sub,
            token_counts(history, in_row, vocab) > 0,
            token_counts(history, output, vocab),
            d["repetition"].index_select(0, rows),
            d["frequency"].index_select(0, rows),
            d["presence"].index_select(0, rows),
        )
    if step.any_bias:
        apply_logit_bias(
            sub, d["bias_ids"].index_select(0, rows), d["bias_values"].index_select(0, rows)
        )
    if step.any_min_tokens:
        suppress(
            sub,
            d["suppress_words"].index_select(0, rows),
            seq < d["min_len"].index_select(0, rows),
        )
    if step.any_token_mask:
        apply_bitmask(sub, d["token_words"].index_select(0, rows))
    if step_mask is not None:
        apply_bitmask(sub, step_mask)
    return logits.index_copy(0, positions, sub)
