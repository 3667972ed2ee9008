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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from executor.core.errors import BatchValidationError
from executor.core.limits import BatchLimits
from executor.service.codec import tensor_from_proto
from executor.service.controls_codec import check_mask_claim, mask_from_proto
from executor.service.device_worker import Job

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


class StreamMasks:
    """The batches of one stream that wait for their deferred mask, by batch_id. The stream
    reader adds and routes; the RPC's end callback may fail them from another thread."""

    def __init__(self) -> None:
        self._waiting: dict[int, Job] = {}
        self._lock = threading.Lock()
        self.ignored = 0  # masks that named no waiting batch

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
