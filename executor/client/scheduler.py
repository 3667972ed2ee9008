"""A reference continuous-batching scheduler: the proof that ForwardBatch is enough.

It admits prompts, allocates a row and KV slots per request from free lists sized by the
executor's limits, prefills (in chunks when a prompt exceeds the per-batch token budget),
decodes the running requests together, stops on a stop token or max tokens, and frees
what a finished request held. It talks to an executor only through a `forward` callable
(`ForwardBatch -> ForwardOutput`), so the same code drives an in-process `ModelExecutor`
or a remote one through the gRPC client. Remotely, give it `ExecutorClient.retrying()`: each
batch keeps one batch_id across its retries, so a step whose answer was lost (deadline,
UNAVAILABLE) is answered from the executor's retry memory and never applied twice.

Policy: prefill first (one EXTEND batch of waiting chunks), otherwise one DECODE batch of
every running request. Slots for a request's whole budget (prompt + max_new_tokens) are
reserved at admission, so a running request never runs out of cache. A finished request's
row is released to the executor on the next batch (`released_req_pool_indices`).

Speculation (`add_request(speculate=K)`): a drafting request decodes in VERIFY steps (the
executor's prompt-lookup drafts; when it drafts: `client/speculation.py`). Not with overlap.

Overlap (`overlap=True`): steps in flight. Steps N+1 and N+2 (`overlap_depth` 3, the default;
2: N+1 only) are sent before step N's tokens are read; each request's token goes to a future
slot and comes back as input id `-slot`. A request that stopped in step N was already in the
steps after it: those tokens are discarded, and its row and slots are freed once no step in
flight holds them. Outputs equal the plain run's. Drive it with a pipe
(`ExecutorClient.open_stream()`) or a `forward` callable. Two steps ahead hide the client's
round trip: while the host reads N and sends N+3, the executor runs N+1 and has N+2 queued
(the stand-in accelerator's figures for 2 and 3: docs/performance.md); the price is one more
step computed for a request past its stop.

Sampling controls go to the executor once, with the batch that starts the request
(`prompt_len` set for chunked prefill). A JSON-schema request is masked in every step that
keeps its token: the step is sent with a deferred mask, and the mask (`send_mask`) follows
once the previous token is read, computed while the forward runs (`client/grammar.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from executor.batch_prep import make_idle_batch
from executor.client import step_batches as sb
from executor.client.allocator import FutureSlotAllocator, KVAllocator
from executor.client.grammar import Grammars, masked_positions, step_mask
from executor.client.pipes import ForwardFn, InlinePipe, MaskPipe, StepPipe, StepResult
from executor.client.requests import Request, _Flight, append_token, check_request
from executor.client.speculation import (
    DEFAULT_NGRAM,
    DraftState,
    SpeculationPolicy,
    check_speculate,
    plan_verify,
    token_runs,
)
from executor.client.step_batches import asking_logprobs, decode_batch, extend_batch
from executor.core.controls_types import DeferredMask, SamplingControls, VocabMask
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.core.limits import BatchLimits

# The flag a batch is sent with when its mask follows (`vocab_mask_deferred` on the wire).
_DEFERRED = DeferredMask(0)


class ReferenceScheduler:
    def __init__(
        self,
        forward: ForwardFn,
        limits: BatchLimits,
        eos_token_ids: Sequence[int] = (),
        *,
        max_prefill_tokens: int | None = None,
        overlap: bool = False,
        pipe: StepPipe | None = None,
        speculation: SpeculationPolicy | None = None,
        grammars: Grammars | None = None,
        overlap_depth: int = 3,
    ) -> None:
        """`overlap`: keep steps in flight on `pipe` (default: `forward` run at send), at most
        `overlap_depth` sent and not yet read (2: step N+1 sent before N is read; 3: N+2 too).
        `speculation`: when requests added with `speculate` keep drafting. `grammars`: the
        model's grammar compiler, for requests with a `json_schema`; their steps go through
        `pipe` when it takes deferred masks (a `MaskPipe`), else through an `InlinePipe` of
        `forward`."""
        self.speculation = speculation or SpeculationPolicy()
        self.forward = forward
        self.overlap = overlap
        self.pipe: StepPipe = pipe if pipe is not None else InlinePipe(forward)
        self.grammars = grammars
        self.mask_pipe: MaskPipe = (
            self.pipe if isinstance(self.pipe, MaskPipe) else InlinePipe(forward)
        )
        if overlap and self.mask_pipe is not self.pipe and grammars is not None:
            raise ValueError("grammars with overlap need a pipe that takes deferred masks")
        if overlap_depth < 2:
            raise ValueError(f"overlap_depth must be >= 2, got {overlap_depth}")
        self.overlap_depth = overlap_depth
        self.in_flight: deque[_Flight] = deque()
        self.future = FutureSlotAllocator(limits.future_slots) if overlap else None
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = KVAllocator(limits.max_reqs, limits.kv_slots)
        self.max_prefill_tokens = min(
            max_prefill_tokens or limits.max_tokens_per_batch, limits.max_tokens_per_batch
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Rows freed since the last batch: the next batch tells the executor (it then counts
        # only live rows and refuses a stale prefix in a reused row).
        self.released_rows: list[int] = []
        self._ids = itertools.count(1)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 32,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        on_token: Callable[[Request, int], None] | None = None,
        speculate: int = 0,
        ngram: int = DEFAULT_NGRAM,
        controls: SamplingControls | None = None,
        json_schema: str | dict[str, Any] | None = None,
        lora: str = "",
        logprobs: bool = False,
        routed_experts: bool = False,
    ) -> Request:
        """`speculate=K`: VERIFY steps of K prompt-lookup drafts (n-gram `ngram`) while they
        pay. `controls`: for the request's life (`prompt_len` set here; min_tokens also
        suppresses its stop ids). `json_schema`: JSON output (needs `grammars`). Controls and
        schemas do not combine with `speculate` yet (VERIFY takes no controls). `lora`: a
        loaded adapter's name ("" = the base model), set with the batch that starts it.
        `logprobs`: each step asks for the request's logprobs (`sampling.logprobs_mode`):
        `output_logprobs`. `routed_experts`: `output_routed_experts` (no VERIFY, no overlap)."""
        check_speculate(speculate, ngram, self.limits, self.overlap)
        if routed_experts and (speculate or self.overlap):
            raise ValueError("routed_experts does not combine with speculate or overlap yet")
        if speculate and (controls is not None or json_schema is not None):
            raise ValueError("speculate does not combine with controls or json_schema yet")
        check_request(prompt_ids, max_new_tokens, self.limits)
        stops = set(stop_token_ids or ())
        if not ignore_eos:
            stops |= self.eos_token_ids
        if controls is not None:
            controls = dataclasses.replace(
                controls,
                prompt_len=len(prompt_ids),
                stop_token_ids=controls.stop_token_ids or tuple(sorted(stops)),
            )
        grammar = None
        if json_schema is not None:
            if self.grammars is None:
                raise ValueError("json_schema needs a scheduler built with grammars")
            grammar = self.grammars.json_schema(json_schema)
        req = Request(
            rid=next(self._ids),
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=sampling or SamplingParams(),
            stop_token_ids=frozenset(stops),
            on_token=on_token,
            draft=DraftState(speculate, ngram, self.speculation) if speculate else None,
            controls=controls,
            grammar=grammar,
            lora=lora,
            logprobs=logprobs,
            routed_experts=routed_experts,
        )
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    def run(self) -> None:
        """Step until every request has finished, then tell the executor which rows are free."""
        while self.has_work():
            self.step()
        self.flush_releases()

    def flush_releases(self) -> None:
        """Send pending row (and future-slot) releases now, on an IDLE step (no device work)."""
        if self.future is not None:
            if self.released_rows or self.future.has_released:
                self.pipe.send(self._with_releases(make_idle_batch(), self.future.take_released()))
                self.pipe.recv()
            return
        if self.released_rows:
            self._forward(make_idle_batch())

    def _with_releases(self, batch: ForwardBatch, future_slots: list[int]) -> ForwardBatch:
        """The batch with the rows freed since the last one (forgotten here: the batch is
        about to be sent) and the future slots it releases."""
        changes: dict[str, Any] = {}
        if self.released_rows:
            changes["released_req_pool_indices"] = torch.tensor(
                self.released_rows, dtype=torch.int64
            )
            self.released_rows = []
        if future_slots:
            changes["released_future_slots"] = torch.tensor(future_slots, dtype=torch.int64)
        return dataclasses.replace(batch, **changes) if changes else batch

    def _forward(
        self, batch: ForwardBatch, members: Sequence[Request] = (), masked: Sequence[int] = ()
    ) -> StepResult:
        """Run one step; with `masked` positions, under their grammars' mask, computed while
        the forward runs where the pipe allows it."""
        if self.released_rows:
            released = torch.tensor(self.released_rows, dtype=torch.int64)
            batch = dataclasses.replace(batch, released_req_pool_indices=released)
        if masked:
            batch_id = self.mask_pipe.send(dataclasses.replace(batch, deferred_mask=_DEFERRED))
            self.mask_pipe.send_mask(batch_id, self._mask(members, masked))
            out = self.mask_pipe.recv()
        else:
            out = self.forward(batch)
        self.released_rows.clear()  # only once the executor took them (a refused batch keeps them)
        return out

    def _mask(self, members: Sequence[Request], masked: Sequence[int]) -> VocabMask:
        """The vocab mask of a step's `masked` positions (the grammars fill it)."""
        return step_mask(self.grammars, members, masked)

    def step(self) -> list[Request]:
        """Admit, run one batch, and return the requests that finished in it (overlap: send
        one batch and read the oldest in flight; the requests that finished in it)."""
        if self.overlap:
            return self._step_overlap()
        self._admit()
        batch, members, chunk_ends = self._next_batch()
        if batch is None:
            if self.waiting:
                raise RuntimeError("the next waiting request does not fit in the executor's cache")
            return []
        produces = [end >= len(r.prompt_ids) for r, end in zip(members, chunk_ends, strict=True)]
        batch = sb.asking_routed_experts(asking_logprobs(batch, members), members)
        out = self._forward(batch, members, masked_positions(members, produces))
        sb.record_routed_experts(out, members)
        runs = token_runs(out, len(members))  # VERIFY: accepted drafts and bonus per row
        finished = []
        for req, run, end in zip(members, runs, chunk_ends, strict=True):
            req.num_computed = end + len(run) - 1  # VERIFY: the accepted drafts are held too
            if not req.prefilled:
                continue  # an intermediate prefill chunk: its sampled token is meaningless
            if req.draft is not None:
                req.draft.record(req.draft.sent, len(run) - 1)
                req.draft.sent = 0
            for token, logprob in run:  # tokens after a stop or past the budget are dropped
                append_token(req, token, logprob)
                if req.finished:
                    break
            if req.finished:
                finished.append(req)
        for req in finished:
            self.running.remove(req)
            self.allocator.free(req.row, req.slots)
            self.released_rows.append(req.row)
        return finished

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_batch_size:
            req = self.waiting[0]
            budget = len(req.prompt_ids) + req.max_new_tokens - 1
            if not self.allocator.can_admit(budget):
                return
            self.waiting.popleft()
            req.row = self.allocator.alloc_row()
            req.slots = self.allocator.alloc_slots(budget)
            self.running.append(req)

    def _next_batch(self) -> tuple[ForwardBatch | None, list[Request], list[int]]:
        prefill = [r for r in self.running if not r.prefilled]
        if prefill:
            return extend_batch(prefill, self.max_prefill_tokens)
        decode = self.running
        if not decode:
            return None, [], []
        verify = plan_verify(decode, self.limits.max_tokens_per_batch)
        if verify is not None:  # one VERIFY step for all (k = 0 for those not drafting)
            return verify, list(decode), [r.num_computed + 1 for r in decode]
        batch = decode_batch(decode, [r.output_ids[-1] for r in decode])
        return batch, list(decode), [r.num_computed + 1 for r in decode]

    # --- overlap ---------------------------------------------------------------------------
    def _step_overlap(self) -> list[Request]:
        self._admit()
        sent = self._send_next()
        if not self.in_flight:
            if self.waiting:
                raise RuntimeError("the next waiting request does not fit in the executor's cache")
            return []
        if sent and len(self.in_flight) < self.overlap_depth:
            return []  # the pipeline fills: read step N once the steps after it are sent
        return self._receive()

    def _send_next(self) -> bool:
        """Build the next step from what is known and in flight, and send it."""
        assert self.future is not None
        # Slots released now are free for this very batch: the executor releases them first.
        released_future = self.future.take_released()
        prefill = [r for r in self.running if not r.prefilled]
        built: tuple[ForwardBatch, list[Request], list[bool]] | None = None
        if prefill:
            built = self._prefill_batch(prefill)
        else:
            decode = [r for r in self.running if not r.finished and r.scheduled < r.max_new_tokens]
            if decode:
                built = self._decode_batch_overlap(decode)
        if built is None:
            self.future.release(released_future)  # nothing sent: they go with the next one
            return False
        batch, members, produces = built
        batch = asking_logprobs(batch, members)
        slots = self.future.alloc(len(members))
        for req, slot, produced in zip(members, slots, produces, strict=True):
            req.in_flight += 1
            if produced:
                req.scheduled += 1
                req.future_slot = slot
            else:  # an inner prefill chunk: its token is never read
                self.future.release([slot])
        batch = dataclasses.replace(
            self._with_releases(batch, released_future),
            future_token_slots=torch.tensor(slots, dtype=torch.int64),
        )
        masked = masked_positions(members, produces)
        if masked:
            batch_id = self.mask_pipe.send(dataclasses.replace(batch, deferred_mask=_DEFERRED))
        else:
            self.pipe.send(batch)
            batch_id = 0
        self.in_flight.append(_Flight(members, produces, masked, batch_id))
        self._send_masks()
        return True

    def _send_masks(self) -> None:
        """Send the deferred mask of every step in flight whose grammar requests have no
        token left unread in an earlier step (their matchers are where the step samples)."""
        unread: set[int] = set()
        for flight in self.in_flight:
            if flight.masked:
                if any(flight.members[i].rid in unread for i in flight.masked):
                    return
                self.mask_pipe.send_mask(flight.batch_id, self._mask(flight.members, flight.masked))
                flight.masked = []
            unread.update(r.rid for r, p in zip(flight.members, flight.produces, strict=True) if p)

    def _prefill_batch(
        self, prefill: list[Request]
    ) -> tuple[ForwardBatch, list[Request], list[bool]]:
        batch, members, ends = extend_batch(prefill, self.max_prefill_tokens)
        produces = []
        for req, end in zip(members, ends, strict=True):
            req.num_computed = end
            produces.append(req.prefilled)
        return batch, members, produces

    def _decode_batch_overlap(
        self, decode: list[Request]
    ) -> tuple[ForwardBatch, list[Request], list[bool]]:
        """Each request feeds its newest token by reference: `-future_slot`."""
        assert self.future is not None
        batch = decode_batch(decode, [-r.future_slot for r in decode])
        # Read by this batch: released with the next one.
        self.future.release([r.future_slot for r in decode])
        for req in decode:
            req.num_computed += 1
        return batch, list(decode), [True] * len(decode)

    def _receive(self) -> list[Request]:
        """Read the oldest step in flight; free what no step in flight holds any more."""
        assert self.future is not None
        self._send_masks()  # the step read now must have its mask (an InlinePipe runs it then)
        flight = self.in_flight.popleft()
        out = self.pipe.recv()
        runs = token_runs(out, len(flight.members))
        finished: list[Request] = []
        for req, run, produced in zip(flight.members, runs, flight.produces, strict=True):
            req.in_flight -= 1
            if produced and not req.finished:  # a stopped request's extra token is dropped
                append_token(req, *run[0])
                if req.finished:
                    finished.append(req)
        self._send_masks()  # first: the step in flight may wait for them at sampling
        for req in [r for r in self.running if r.finished and r.in_flight == 0]:
            self.running.remove(req)
            self.allocator.free(req.row, req.slots)
            self.released_rows.append(req.row)
            if req.future_slot:
                self.future.release([req.future_slot])  # its last token, never read
                req.future_slot = 0
        return finished


def generate(
    forward: ForwardFn,
    limits: BatchLimits,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    sampling: SamplingParams | None = None,
    eos_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    overlap: bool = False,
    pipe: StepPipe | None = None,
    speculate: int = 0,
    ngram: int = DEFAULT_NGRAM,
    speculation: SpeculationPolicy | None = None,
    lora: str | Sequence[str] = "",
    overlap_depth: int = 3,
) -> list[list[int]]:
    """Generate for every prompt concurrently; the new token ids of each, in prompt order.
    `overlap`: steps in flight (`overlap_depth`), tokens fed back by future-token reference.
    `speculate`: K prompt-lookup drafts per step (`ngram`), while `speculation` keeps them on.
    `lora`: one adapter name for every prompt, or one per prompt ("" = the base model)."""
    loras = [lora] * len(prompts) if isinstance(lora, str) else list(lora)
    if len(loras) != len(prompts):
        raise ValueError(f"lora: {len(loras)} names for {len(prompts)} prompts")
    scheduler = ReferenceScheduler(
        forward,
        limits,
        eos_token_ids,
        overlap=overlap,
        pipe=pipe,
        speculation=speculation,
        overlap_depth=overlap_depth,
    )
    reqs = [
        scheduler.add_request(
            p,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            ignore_eos=ignore_eos,
            speculate=speculate,
            ngram=ngram,
            lora=name,
        )
        for p, name in zip(prompts, loras, strict=True)
    ]
    scheduler.run()
    return [r.output_ids for r in reqs]
