"""The sampling controls on the wire: `RowControls`, the vocab mask and its deferred form.

Size claims (entry counts, list lengths, mask bytes) are refused from the header before
anything is built, like the batch's own (`check_control_claims`); every value rule is
validation's, on the device thread.
"""

from __future__ import annotations

from typing import Any

import torch

from executor.core.controls_types import (
    DeferredMask,
    RowControl,
    SamplingControls,
    VocabMask,
    mask_words,
)
from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
from executor.validation import check_request_count

_ID_LISTS = ("stop_token_ids", "banned_token_ids", "allowed_token_ids")


def check_control_claims(msg: Any, limits: BatchLimits) -> None:
    """Refuse over-long control lists and oversized masks from their lengths alone
    (BatchTooLargeError). `msg` is a `pb.ForwardBatch`."""
    check_request_count("row_controls", len(msg.row_controls), limits)
    for i, entry in enumerate(msg.row_controls):
        c = entry.controls
        if len(c.logit_bias) > limits.max_logit_bias:
            raise BatchTooLargeError(
                f"row_controls[{i}].controls.logit_bias",
                f"has {len(c.logit_bias)} entries; must be <= max_logit_bias "
                f"({limits.max_logit_bias})",
            )
        for name in _ID_LISTS:
            n = len(getattr(c, name))
            if n > limits.max_control_token_ids:
                raise BatchTooLargeError(
                    f"row_controls[{i}].controls.{name}",
                    f"has {n} entries; must be <= max_control_token_ids "
                    f"({limits.max_control_token_ids})",
                )
    if msg.HasField("vocab_mask"):
        check_mask_claim("vocab_mask", msg.vocab_mask, limits)


def check_mask_claim(field: str, words: Any, limits: BatchLimits) -> None:
    """A mask's bytes may not exceed max_batch_size rows of vocab_mask_words int32 words."""
    cap = limits.max_batch_size * mask_words(limits.vocab_size) * 4
    if len(words.data) > cap:
        raise BatchTooLargeError(
            field,
            f"has {len(words.data)} bytes; must be <= max_batch_size rows of "
            f"vocab_mask_words int32 ({cap} bytes)",
        )


def controls_from_proto(c: Any) -> SamplingControls:
    return SamplingControls(
        repetition_penalty=c.repetition_penalty if c.repetition_penalty != 0 else 1.0,
        frequency_penalty=c.frequency_penalty,
        presence_penalty=c.presence_penalty,
        logit_bias=tuple(sorted(c.logit_bias.items())),
        min_tokens=c.min_tokens,
        stop_token_ids=tuple(c.stop_token_ids),
        banned_token_ids=tuple(c.banned_token_ids),
        allowed_token_ids=tuple(c.allowed_token_ids),
        prompt_len=c.prompt_len,
    )


def controls_to_proto(c: SamplingControls, out: Any) -> None:
    """Fill `out` (a `pb.SamplingControls`) from `c`."""
    out.repetition_penalty = c.repetition_penalty
    out.frequency_penalty = c.frequency_penalty
    out.presence_penalty = c.presence_penalty
    for token, bias in c.logit_bias:
        out.logit_bias[token] = bias
    out.min_tokens = c.min_tokens
    out.stop_token_ids.extend(c.stop_token_ids)
    out.banned_token_ids.extend(c.banned_token_ids)
    out.allowed_token_ids.extend(c.allowed_token_ids)
    out.prompt_len = c.prompt_len


def mask_from_proto(words: Any, rows: Any | None, field: str, tensor_from_proto: Any) -> VocabMask:
    return VocabMask(
        words=tensor_from_proto(words, field),
        rows=tensor_from_proto(rows, field + "_rows") if rows is not None else None,
    )


def controls_fields(msg: Any, batch_id: int, tensor_from_proto: Any) -> dict[str, Any]:
    """The ForwardBatch keyword arguments of `msg`'s control fields."""
    out: dict[str, Any] = {}
    if msg.row_controls:
        out["row_controls"] = tuple(
            RowControl(row=e.req_pool_index, controls=controls_from_proto(e.controls))
            for e in msg.row_controls
        )
    rows = msg.vocab_mask_rows if msg.HasField("vocab_mask_rows") else None
    if msg.HasField("vocab_mask"):
        out["vocab_mask"] = mask_from_proto(msg.vocab_mask, rows, "vocab_mask", tensor_from_proto)
    elif rows is not None:
        raise BatchValidationError("vocab_mask_rows", "is set without vocab_mask")
    if msg.vocab_mask_deferred:
        if msg.HasField("vocab_mask"):
            raise BatchValidationError(
                "vocab_mask_deferred", "must not be set together with vocab_mask"
            )
        if batch_id == 0:
            raise BatchValidationError("vocab_mask_deferred", "needs a nonzero batch_id")
        out["deferred_mask"] = DeferredMask(batch_id)
    return out


def add_controls_to_proto(fb: ForwardBatch, msg: Any, tensor_to_proto: Any) -> None:
    """Write `fb`'s control fields into `msg` (a `pb.ForwardBatch`)."""
    for rc in fb.row_controls:
        entry = msg.row_controls.add(req_pool_index=rc.row)
        controls_to_proto(rc.controls, entry.controls)
    if fb.vocab_mask is not None:
        msg.vocab_mask.CopyFrom(tensor_to_proto(fb.vocab_mask.words.to(torch.int32)))
        if fb.vocab_mask.rows is not None:
            msg.vocab_mask_rows.CopyFrom(tensor_to_proto(fb.vocab_mask.rows))
    if fb.deferred_mask is not None:
        msg.vocab_mask_deferred = True
