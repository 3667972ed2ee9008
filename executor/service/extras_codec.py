"""The extra outputs on the wire: `RowOutputs` asks in, `Ragged` results out.

The byte caps are checked twice: a bound from the header here (token count, entry counts;
nothing decoded), refused before anything is built, and the exact sizes at admission.
"""

from __future__ import annotations

from typing import Any

import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.extras_types import ExtraOutputs, HiddenAsk, Pooling, Ragged, RowOutputs
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits, routed_expert_bytes_per_token
from executor.validation import check_request_count

_BF16 = 4  # pb.BFLOAT16


def check_output_claims(msg: Any, limits: BatchLimits, num_tokens: int) -> None:
    """Bounds of what a `pb.ForwardBatch`'s asks would return, from its header alone."""
    asks = msg.row_outputs
    if not asks:
        return
    check_request_count("row_outputs", len(asks), limits)
    scores = 0
    for i, a in enumerate(asks):
        n = len(a.score_token_ids)
        if n > limits.max_score_token_ids:
            raise BatchTooLargeError(
                f"row_outputs[{i}].score_token_ids",
                f"has {n} entries; must be <= max_score_token_ids ({limits.max_score_token_ids})",
            )
        scores += n
    prompt = (
        num_tokens * (4 + 12 * max(msg.prompt_top_logprobs_num, 0))
        if any(a.prompt_logprobs for a in asks)
        else 0
    )
    hidden = sum(1 for a in asks if a.HasField("hidden")) * limits.hidden_size * 4
    routed = (
        num_tokens * routed_expert_bytes_per_token(limits)
        if any(a.routed_experts for a in asks)
        else 0
    )
    if routed == 0 and any(a.routed_experts for a in asks) and not limits.routed_expert_layers:
        raise BatchValidationError(
            "row_outputs.routed_experts", "the model has no mixture-of-experts layers"
        )
    total = prompt + hidden + routed + 4 * scores
    for field, size, cap, name in (
        (
            "row_outputs.prompt_logprobs",
            prompt,
            limits.max_prompt_logprob_bytes,
            "max_prompt_logprob_bytes",
        ),
        ("row_outputs.hidden", hidden, limits.max_hidden_bytes, "max_hidden_bytes"),
        (
            "row_outputs.routed_experts",
            routed,
            limits.max_routed_expert_bytes,
            "max_routed_expert_bytes",
        ),
        ("row_outputs", total, limits.max_output_bytes, "max_output_bytes"),
    ):
        if size > cap:
            raise BatchTooLargeError(field, f"may return {size} bytes; must be <= {name} ({cap})")


def outputs_from_proto(msg: Any) -> dict[str, Any]:
    """The ForwardBatch keyword arguments of `msg`'s extra-output fields."""
    out: dict[str, Any] = {}
    if msg.row_outputs:
        out["row_outputs"] = tuple(_ask(a) for a in msg.row_outputs)
    if msg.prompt_top_logprobs_num:
        out["prompt_top_logprobs_num"] = msg.prompt_top_logprobs_num
    return out


def _ask(a: Any) -> RowOutputs:
    hidden = None
    if a.HasField("hidden"):
        h = a.hidden
        hidden = HiddenAsk(
            pooling=Pooling(h.pooling) if h.pooling in (0, 1) else Pooling.LAST,
            layer=h.layer if h.HasField("layer") else None,
            bfloat16=h.dtype == _BF16,
        )
    return RowOutputs(
        row=a.req_pool_index,
        prompt_logprobs=a.prompt_logprobs,
        logprob_start_len=a.logprob_start_len or 1,
        next_prompt_token=a.next_prompt_token if a.HasField("next_prompt_token") else None,
        score_token_ids=tuple(a.score_token_ids),
        hidden=hidden,
        routed_experts=a.routed_experts,
    )


def add_outputs_to_proto(fb: ForwardBatch, msg: Any) -> None:
    for r in fb.row_outputs:
        e = msg.row_outputs.add(
            req_pool_index=r.row,
            prompt_logprobs=r.prompt_logprobs,
            logprob_start_len=r.logprob_start_len,
            routed_experts=r.routed_experts,
        )
        if r.next_prompt_token is not None:
            e.next_prompt_token = r.next_prompt_token
        e.score_token_ids.extend(r.score_token_ids)
        if r.hidden is not None:
            e.hidden.pooling = int(r.hidden.pooling)
            if r.hidden.layer is not None:
                e.hidden.layer = r.hidden.layer
            e.hidden.dtype = _BF16 if r.hidden.bfloat16 else 3
    msg.prompt_top_logprobs_num = fb.prompt_top_logprobs_num


_RESULTS = (
    "prompt_logprobs",
    "prompt_top_logprobs",
    "prompt_top_logprob_ids",
    "token_scores",
    "hidden_states",
    "routed_experts",
)


def extras_to_proto(extras: ExtraOutputs, msg: Any, tensor_to_proto: Any) -> None:
    """Fill a `pb.ForwardResponse`'s Ragged results."""
    for name in _RESULTS:
        r: Ragged | None = getattr(extras, name)
        if r is not None:
            field = getattr(msg, name)
            field.values.CopyFrom(tensor_to_proto(r.values))
            field.lengths.CopyFrom(tensor_to_proto(r.lengths.to(torch.int32)))


def extras_from_proto(msg: Any, tensor_from_proto: Any) -> ExtraOutputs | None:
    if not any(msg.HasField(name) for name in _RESULTS):
        return None
    out = ExtraOutputs()
    for name in _RESULTS:
        if msg.HasField(name):
            field = getattr(msg, name)
            setattr(
                out,
                name,
                Ragged(
                    tensor_from_proto(field.values, name + ".values"),
                    tensor_from_proto(field.lengths, name + ".lengths"),
                ),
            )
    return out
