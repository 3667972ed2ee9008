"""A request as the reference scheduler tracks it, and a step it sent and has not read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from executor.client.grammar import RequestGrammar
from executor.client.speculation import DraftState
from executor.core.controls_types import SamplingControls
from executor.core.forward_batch import SamplingParams
from executor.core.limits import BatchLimits


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
    # Whether each step asks for the routed experts of the request's tokens, and those of
    # every token the model computed for it (the prompt, then each generated token fed
    # back: all but the last), each [moe layer][k].
    routed_experts: bool = False
    output_routed_experts: list[list[list[int]]] = field(default_factory=list)
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


def append_token(req: Request, token: int, logprob: float | None = None) -> None:
    """A generated token read back: a stop id finishes the request (not kept); otherwise the
    grammar takes it, it is kept (with its logprob when asked) and streamed, and the grammar's
    end or the budget finishes the request."""
    if token in req.stop_token_ids:
        req.finish_reason = "stop"
        return
    if req.grammar is not None:
        req.grammar.accept(token)
    req.output_ids.append(token)
    if req.logprobs:
        assert logprob is not None, "the step asked for logprobs"
        req.output_logprobs.append(logprob)
    if req.on_token is not None:
        req.on_token(req, token)
    if req.grammar is not None and req.grammar.terminated:
        req.finish_reason = "stop"  # the JSON is complete
    elif len(req.output_ids) >= req.max_new_tokens:
        req.finish_reason = "length"


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
