"""A request as the reference scheduler tracks it, and a step it sent and has not read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from executor.client.grammar import RequestGrammar
from executor.client.speculation import DraftState
from executor.core.controls_types import RowControl, SamplingControls
from executor.core.forward_batch import SamplingParams
from executor.core.limits import BatchLimits
from executor.core.lora_types import RowAdapter


@dataclass
class _Flight:
    """A sent step whose tokens were not read yet."""

    members: list[Request]
    produces: list[bool]  # the member's token is a generated one (not an inner prefill chunk)
    masked: list[int] = field(default_factory=list)  # positions whose grammar masks the step
    batch_id: int = 0  # the pipe's id of the step, for its deferred mask


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    on_token: Callable[[Request, int], None] | None = None
    controls: SamplingControls | None = None  # sent with the batch that starts the request
    grammar: RequestGrammar | None = None  # constrains every token it generates
    lora: str = ""  # its LoRA adapter's name ("" = the base model), set when it starts
    output_ids: list[int] = field(default_factory=list)
    # Whether each step asks for the request's logprobs (of the mode in `sampling`), and
    # those of output_ids, in order.
    logprobs: bool = False
    output_logprobs: list[float] = field(default_factory=list)
    row: int = 0
    slots: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (overlap: or in a step in flight)
    finish_reason: str | None = None  # "stop" | "length"
    # Overlap only: tokens generated or in flight, the future slot of the newest one, and
    # how many sent steps hold this request.
    scheduled: int = 0
    future_slot: int = 0
    in_flight: int = 0
    draft: DraftState | None = None  # speculate > 0: its drafting (client/speculation.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= len(self.prompt_ids)


def check_request(prompt_ids: Sequence[int], max_new_tokens: int, limits: BatchLimits) -> None:
    """ValueError when a request cannot fit the executor (prompt plus budget)."""
    if not prompt_ids:
        raise ValueError("prompt must have at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    budget = len(prompt_ids) + max_new_tokens - 1  # the last new token is never fed back
    if budget > limits.max_context_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_context_len ({limits.max_context_len})"
        )
    if budget > limits.kv_slots:
        raise ValueError(f"request needs {budget} KV slots, the executor has {limits.kv_slots}")


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
