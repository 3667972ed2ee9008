"""Deferred vocab masks on a ForwardStream: a batch that set `vocab_mask_deferred` gets its
mask from a later `ForwardRequest.deferred_mask` on the same stream.

The mask is routed when the stream reader reads it, never queued behind the batches: the
device thread is blocked in sampling waiting for it, and the batches behind it in the queue
cannot run before it. `StreamMasks` is one stream's table of the batches that wait for a
mask (at most the stream's window, plus answered ones until the next lookup):

- a mask for a waiting batch is decoded (size claim from the header first), then handed over
  (`DeferredMask.fulfill`); it gets no response of its own;
- a mask for no waiting batch (unknown, already answered, a retried batch answered from the
  executor's memory, a second mask) is ignored, counted in a debug line;
- a mask that is refused (oversized, undecodable) fails the batch that waits for it with the
  same error, so the device stops waiting at once and the stream ends with that status;
- when the stream ends or fails, every batch still waiting is failed (`fail_waiting`), so a
  device thread never waits out the timeout for a mask that can no longer come.

Unary `Forward` refuses both halves (`refuse_on_unary`): a mask can only follow its batch on
the stream that carries it.

While a batch waits for its mask it holds the device: every other caller's batches wait too.
So each caller has a budget of device time its streams may spend waiting (`MaskWaitBudget`,
a token bucket of `deferred_mask_budget_s` refilled at that much per 5 s: at most a fifth of
the device; shared by the caller's streams, so a new stream brings no new budget): a wait is
cut when the budget runs out (DEADLINE_EXCEEDED, nothing applied), and every wait is counted
(`model_executor_deferred_mask_wait_seconds`, `..._waits_cut_total`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog

from executor.core.errors import BatchValidationError
from executor.core.limits import BatchLimits
from executor.service.codec import tensor_from_proto
from executor.service.controls_codec import check_mask_claim, mask_from_proto
from executor.service.jobs import Job, StreamFailedError

log = structlog.get_logger(__name__)


def refuse_on_unary(request: Any) -> None:
    """Refuse, on unary Forward, what only a ForwardStream carries. `request`: ForwardRequest."""
    if request.HasField("deferred_mask"):
        raise BatchValidationError(
            "deferred_mask",
            "is for ForwardStream only (it completes an earlier batch on the same stream); "
            "on unary Forward send the mask in the batch as vocab_mask",
        )
    if request.batch.vocab_mask_deferred:
        raise BatchValidationError(
            "vocab_mask_deferred",
            "is for ForwardStream only (the mask follows on the same stream); on unary "
            "Forward send the mask in the batch as vocab_mask",
        )


def stream_over(batch_id: int) -> BaseException:
    return StreamFailedError(
        f"batch_id {batch_id} was not applied: its stream failed or ended while it waited "
        "for its deferred_mask"
    )


def mask_never_came(failed: bool, refused: BaseException | None) -> Callable[[int], BaseException]:
    """Why a batch still waiting for its deferred mask when the reader stops fails."""
    if failed:
        return stream_over
    if refused is not None:
        return lambda batch_id: StreamFailedError(
            f"batch_id {batch_id} was not applied: the stream stopped reading before its "
            f"deferred_mask came, at a refused request ({refused})"
        )
    return lambda batch_id: BatchValidationError(
        "vocab_mask_deferred",
        "the request stream ended before this batch's deferred_mask came; send the mask "
        "before closing the stream",
    )


REFILL_WINDOW_S = 5.0  # a stream's mask-wait budget refills in full over this long


def _not_observed(seconds: float, cut: bool) -> None:
    return None


class MaskWaitBudget:
    """One stream's device time for waiting on its masks: a token bucket holding at most
    `budget_s`, refilled at `budget_s` per REFILL_WINDOW_S. `on_wait(seconds, cut)` counts
    every wait (the server's metrics). Thread-safe (the device thread spends it)."""

    def __init__(
        self,
        budget_s: float,
        on_wait: Callable[[float, bool], None] = _not_observed,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_s = budget_s
        self._on_wait = on_wait
        self._clock = clock
        self._lock = threading.Lock()
        self._left = budget_s
        self._at = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._left = min(
            self.budget_s, self._left + (now - self._at) * self.budget_s / REFILL_WINDOW_S
        )
        self._at = now
        return self._left

    def grant(self, timeout_s: float) -> float:
        with self._lock:
            return max(0.0, min(timeout_s, self._refill()))

    def spend(self, seconds: float, cut: bool) -> None:
        with self._lock:
            self._refill()
            self._left = max(0.0, self._left - seconds)
        self._on_wait(seconds, cut)


class MaskBudgets:
    """Each caller identity's `MaskWaitBudget` (its streams share it), the most recently used
    `capacity` kept; `budget_s` 0: none (only deferred_mask_timeout_s bounds a wait)."""

    def __init__(
        self,
        budget_s: float,
        on_wait: Callable[[float, bool], None] = _not_observed,
        capacity: int = 1024,
    ) -> None:
        self.budget_s = budget_s
        self._on_wait = on_wait
        self._capacity = capacity
        self._lock = threading.Lock()
        self._budgets: OrderedDict[str, MaskWaitBudget] = OrderedDict()

    def get(self, caller: str) -> MaskWaitBudget | None:
        if not self.budget_s:
            return None
        with self._lock:
            budget = self._budgets.get(caller)
            if budget is None:
                budget = self._budgets[caller] = MaskWaitBudget(self.budget_s, self._on_wait)
                while len(self._budgets) > self._capacity:
                    self._budgets.popitem(last=False)
            self._budgets.move_to_end(caller)
            return budget


class StreamMasks:
    """The batches of one stream that wait for their deferred mask, by batch_id. The stream
    reader adds and routes; the RPC's end callback may fail them from another thread.
    `budget`: the stream's mask-wait budget (None: only deferred_mask_timeout_s bounds a wait)."""

    def __init__(self, budget: MaskWaitBudget | None = None) -> None:
        self._waiting: dict[int, Job] = {}
        self._lock = threading.Lock()
        self.ignored = 0  # masks that named no waiting batch
        self.budget = budget

    def expect(self, job: Job) -> None:
        """Remember `job` if its batch waits for a deferred mask."""
        if job.batch.deferred_mask is None:
            return
        with self._lock:
            # Answered without their mask (a retry replayed from memory): forget them here,
            # so the table stays as small as the window.
            for batch_id in [b for b, j in self._waiting.items() if j.future.done()]:
                del self._waiting[batch_id]
            self._waiting[job.batch_id] = job

    def deliver(self, request: Any, limits: BatchLimits) -> None:
        """Route `request.deferred_mask` (a ForwardRequest that carries one) to its batch.
        Raises what refuses the mask, after failing the batch that waits for it."""
        msg = request.deferred_mask
        batch_id = msg.batch_id
        with self._lock:
            job = self._waiting.pop(batch_id, None)
        try:
            if request.HasField("batch"):
                raise BatchValidationError(
                    "deferred_mask",
                    "must come alone: a ForwardRequest carries a batch or a deferred_mask, "
                    "not both",
                )
            if not msg.HasField("vocab_mask"):
                raise BatchValidationError("deferred_mask.vocab_mask", "is required")
            check_mask_claim("deferred_mask.vocab_mask", msg.vocab_mask, limits)
            rows = msg.vocab_mask_rows if msg.HasField("vocab_mask_rows") else None
            mask = mask_from_proto(
                msg.vocab_mask, rows, "deferred_mask.vocab_mask", tensor_from_proto
            )
        except BaseException as exc:
            if job is not None and job.batch.deferred_mask is not None:
                job.batch.deferred_mask.fail(exc)
            raise
        if job is None or job.batch.deferred_mask is None or job.future.done():
            self._ignore(batch_id, "no batch of this stream waits for it")
        elif not job.batch.deferred_mask.fulfill(mask):
            self._ignore(batch_id, "its batch already stopped waiting")

    def fail_waiting(self, error_for: Callable[[int], BaseException]) -> None:
        """Fail every batch still waiting, with `error_for(batch_id)`."""
        with self._lock:
            jobs = list(self._waiting.values())
            self._waiting.clear()
        for job in jobs:
            if job.batch.deferred_mask is not None:
                job.batch.deferred_mask.fail(error_for(job.batch_id))

    def _ignore(self, batch_id: int, why: str) -> None:
        self.ignored += 1
        log.debug("deferred mask ignored", mask_batch_id=batch_id, why=why, ignored=self.ignored)
