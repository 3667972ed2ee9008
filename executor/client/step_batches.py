"""The batches the reference scheduler sends, built from its requests: an EXTEND batch of
prompt chunks within a token budget (with the row state of the requests it starts), a DECODE
batch of running requests, and the logprobs ask."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.requests import Request
from executor.core.controls_types import RowControl
from executor.core.extras_types import RowOutputs
from executor.core.forward_batch import ForwardBatch
from executor.core.lora_types import RowAdapter


def extend_batch(
    prefill: Sequence[Request], budget: int
) -> tuple[ForwardBatch, list[Request], list[int]]:
    """One EXTEND batch of waiting chunks within `budget` tokens, and each chunk's end."""
    members: list[Request] = []
    ids: list[list[int]] = []
    locs: list[list[int]] = []
    prefix: list[int] = []
    ends: list[int] = []
    for req in prefill:
        if budget == 0:
            break
        start = req.num_computed
        end = min(len(req.prompt_ids), start + budget)
        budget -= end - start
        members.append(req)
        ids.append(req.prompt_ids[start:end])
        locs.append(req.slots[start:end])
        prefix.append(start)
        ends.append(end)
    batch = make_extend_batch(
        input_ids=ids,
        req_pool_indices=[r.row for r in members],
        out_cache_loc=locs,
        prefix_lens=prefix,
        sampling=[r.sampling for r in members],
    )
    state = starting_row_state(members, prefix)  # controls and adapters, once
    return (dataclasses.replace(batch, **state) if state else batch), members, ends


def decode_batch(decode: Sequence[Request], input_ids: list[int]) -> ForwardBatch:
    """One DECODE step of every request in `decode`, feeding `input_ids` (tokens, or future
    references `-slot` under overlap)."""
    return make_decode_batch(
        input_ids=input_ids,
        req_pool_indices=[r.row for r in decode],
        seq_lens=[r.num_computed + 1 for r in decode],
        out_cache_loc=[r.slots[r.num_computed] for r in decode],
        sampling=[r.sampling for r in decode],
    )


def asking_logprobs(batch: ForwardBatch, members: Sequence[Request]) -> ForwardBatch:
    """The batch asking for logprobs when any member wants them (the others' are ignored)."""
    if any(r.logprobs for r in members):
        return dataclasses.replace(batch, return_logprob=True)
    return batch


def asking_routed_experts(batch: ForwardBatch, members: Sequence[Request]) -> ForwardBatch:
    """The batch asking for the routed experts of the members that want them."""
    asks = tuple(RowOutputs(r.row, routed_experts=True) for r in members if r.routed_experts)
    if asks:
        return dataclasses.replace(batch, row_outputs=batch.row_outputs + asks)
    return batch


def record_routed_experts(out: object, members: Sequence[Request]) -> None:
    """Each asking member's routed experts of this step (`out`: a `ForwardOutput`), in its
    token order."""
    extras = getattr(out, "extras", None)
    routed = extras.routed_experts if extras is not None else None
    if routed is None:
        return
    for req, ids in zip(members, routed.rows(), strict=True):
        if req.routed_experts:
            req.output_routed_experts.extend(ids.tolist())


def starting_row_state(members: Sequence[Request], prefix: Sequence[int]) -> dict[str, Any]:
    """The row state an EXTEND batch sets for the requests it starts (prefix 0): their
    sampling controls and LoRA adapter, sent once (they stay with the row until released);
    as `ForwardBatch` fields, none when there is nothing to set."""
    starting = [r for r, start in zip(members, prefix, strict=True) if start == 0]
    controls = tuple(
        RowControl(r.row, r.controls)
        for r in starting
        if r.controls is not None and not r.controls.neutral
    )
    adapters = tuple(RowAdapter(r.row, r.lora) for r in starting if r.lora)
    state: dict[str, Any] = {}
    if controls:
        state["row_controls"] = controls
    if adapters:
        state["row_adapters"] = adapters
    return state
