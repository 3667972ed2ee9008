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
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.allocator import KVAllocator
from executor.forward_batch import ForwardBatch, SamplingParams
from executor.validation import BatchLimits


class StepResult(Protocol):
    @property
    def next_token_ids(self) -> object: ...


ForwardFn = Callable[[ForwardBatch], StepResult]


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    on_token: Callable[[Request, int], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    row: int = 0
    slots: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None  # "stop" | "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= len(self.prompt_ids)


class ReferenceScheduler:
    def __init__(
        self,
        forward: ForwardFn,
        limits: BatchLimits,
        eos_token_ids: Sequence[int] = (),
        *,
        max_prefill_tokens: int | None = None,
    ) -> None:
        self.forward = forward
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
    ) -> Request:
        if not prompt_ids:
            raise ValueError("prompt must have at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        budget = len(prompt_ids) + max_new_tokens - 1  # the last new token is never fed back
        if budget > self.limits.max_context_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds max_context_len "
                f"({self.limits.max_context_len})"
            )
        if budget > self.limits.kv_slots:
            raise ValueError(
                f"request needs {budget} KV slots, the executor has {self.limits.kv_slots}"
            )
        stops = set(stop_token_ids or ())
        if not ignore_eos:
            stops |= self.eos_token_ids
        req = Request(
            rid=next(self._ids),
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            sampling=sampling or SamplingParams(),
            stop_token_ids=frozenset(stops),
            on_token=on_token,
        )
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> None:
        """Step until every request has finished, then tell the executor which rows are free."""
        while self.has_work():
            self.step()
        self.flush_releases()

    def flush_releases(self) -> None:
        """Send pending row releases now, on an IDLE step (no device work)."""
        if self.released_rows:
            self._forward(make_idle_batch())

    def _forward(self, batch: ForwardBatch) -> StepResult:
        if self.released_rows:
            released = torch.tensor(self.released_rows, dtype=torch.int64)
            batch = dataclasses.replace(batch, released_req_pool_indices=released)
        out = self.forward(batch)
        self.released_rows.clear()  # only once the executor took them (a refused batch keeps them)
        return out

    def step(self) -> list[Request]:
        """Admit, run one batch, and return the requests that finished in it."""
        self._admit()
        batch, members, chunk_ends = self._next_batch()
        if batch is None:
            if self.waiting:
                raise RuntimeError("the next waiting request does not fit in the executor's cache")
            return []
        out = self._forward(batch)
        tokens = [int(t) for t in out.next_token_ids]  # type: ignore[attr-defined]
        finished = []
        for req, token, end in zip(members, tokens, chunk_ends, strict=True):
            req.num_computed = end
            if not req.prefilled:
                continue  # an intermediate prefill chunk: its sampled token is meaningless
            self._append(req, token)
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
            budget = self.max_prefill_tokens
            members, ids, locs, prefix, ends = [], [], [], [], []
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
            return batch, members, ends
        decode = self.running
        if not decode:
            return None, [], []
        batch = make_decode_batch(
            input_ids=[r.output_ids[-1] for r in decode],
            req_pool_indices=[r.row for r in decode],
            seq_lens=[r.num_computed + 1 for r in decode],
            out_cache_loc=[r.slots[r.num_computed] for r in decode],
            sampling=[r.sampling for r in decode],
        )
        return batch, list(decode), [r.num_computed + 1 for r in decode]

    @staticmethod
    def _append(req: Request, token: int) -> None:
        if token in req.stop_token_ids:
            req.finish_reason = "stop"
            return
        req.output_ids.append(token)
        if req.on_token is not None:
            req.on_token(req, token)
        if len(req.output_ids) >= req.max_new_tokens:
            req.finish_reason = "length"


def generate(
    forward: ForwardFn,
    limits: BatchLimits,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    sampling: SamplingParams | None = None,
    eos_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> list[list[int]]:
    """Generate for every prompt concurrently; the new token ids of each, in prompt order."""
    scheduler = ReferenceScheduler(forward, limits, eos_token_ids)
    reqs = [
        scheduler.add_request(
            p, max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=ignore_eos
        )
        for p in prompts
    ]
    scheduler.run()
    return [r.output_ids for r in reqs]
