"""`JobQueue`: the bounded queue in front of the device thread, and its life cycle.

RPC handler threads decode a request, `submit` a Job and wait on its future. When the queue
is full, `submit` raises QueueFullError at once (back-pressure, not blocking). `close()` is the
stop marker: no job is accepted after it (`WorkerClosedError`), and the consumer ends once
the jobs already accepted have run. `abandon()` answers every job still waiting, and the ones
running, with `WorkerClosedError`: the end of a drain's grace period. `wait_idle` waits for
every accepted job to finish. The consumer (`executor.service.device_worker`) takes jobs with
`_take` and ends each with `_finish`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context

from executor.core.forward_batch import ForwardBatch
from executor.service.jobs import (
    ControlJob,
    Job,
    QueueFullError,
    StreamState,
    WorkerClosedError,
    resolve,
)


class JobQueue:
    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        # Unbounded underneath: `_put` enforces queue_size, so the stop marker never blocks.
        self._queue: queue.Queue[Job | ControlJob | None] = queue.Queue()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._running: list[Job | ControlJob] = []  # taken from the queue, not finished

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the ones taken)."""
        return self._queue.qsize()

    def submit(
        self,
        batch: ForwardBatch,
        batch_id: int,
        *,
        trace_context: otel_context.Context | None = None,
        stream: StreamState | None = None,
        is_active: Callable[[], bool] | None = None,
        deadline: float | None = None,
        fingerprint: bytes = b"",
        caller: str = "",
    ) -> Job:
        job = Job(
            batch=batch,
            batch_id=batch_id,
            trace_context=trace_context,
            stream=stream,
            is_active=is_active,
            deadline=deadline,
            fingerprint=fingerprint,
            caller=caller,
        )
        self._put(job)
        return job

    def run_on_device(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the device thread after the batches already queued; its future."""
        job = ControlJob(fn)
        self._put(job)
        return job.future

    def _put(self, job: Job | ControlJob) -> None:
        with self._idle:
            if self._closed:
                raise WorkerClosedError(
                    "the executor is draining for shutdown; send new batches elsewhere"
                )
            if self._queue.qsize() >= self.queue_size:
                raise QueueFullError(
                    f"the device queue is full ({self.queue_size} batches waiting); retry later or send fewer batches at once"
                )
            self._queue.put_nowait(job)
            self._in_flight += 1

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until every submitted job has finished; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self) -> None:
        """The stop marker: refuse every job from now on; the thread ends after the accepted ones."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            self._queue.put_nowait(None)

    def abandon(self, reason: str) -> int:
        """Answer every accepted job not yet finished (waiting, or taken: its handler stops
        waiting) with WorkerClosedError(reason). The number answered."""
        self.close()
        answered = 0
        with self._idle:
            pending: list[Job | ControlJob] = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item)
            self._queue.put_nowait(None)  # the marker goes back: the thread still ends
            self._in_flight -= len(pending)
            self._idle.notify_all()
            running = list(self._running)
        for job in pending:  # out of the queue: they never run
            if not job.future.done():
                resolve(job.future, exc=WorkerClosedError(reason))
                answered += 1
        for job in running:
            if not job.future.done():
                resolve(job.future, exc=WorkerClosedError(f"{reason}; it may have been applied"))
                answered += 1
        return answered

    def _take(self, job: Job | ControlJob) -> bool:
        """Count the job as running; False (and finished) when it was cancelled first."""
        with self._idle:
            self._running.append(job)
        if job.future.set_running_or_notify_cancel():
            return True
        self._finish(job)
        return False

    def _finish(self, job: Job | ControlJob) -> None:
        with self._idle:
            self._running.remove(job)
            self._in_flight -= 1
            self._idle.notify_all()
