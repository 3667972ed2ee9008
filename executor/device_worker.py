"""One thread owns the device and runs batches in arrival order; a bounded queue fronts it.

RPC handler threads decode a request, `submit` a Job and wait on its future. When the queue
is full, `submit` raises QueueFullError at once (back-pressure, not blocking). A job whose
future was cancelled before it started (its stream failed) is skipped.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog

from executor.forward_batch import ForwardBatch
from executor.model_executor import ForwardOutput, ModelExecutor

log = structlog.get_logger(__name__)


class QueueFullError(RuntimeError):
    """The device queue is full; the caller should retry later or send less."""


@dataclass
class Job:
    batch: ForwardBatch
    batch_id: int
    future: Future[ForwardOutput] = field(default_factory=Future)
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


class DeviceWorker:
    def __init__(self, executor: ModelExecutor, queue_size: int) -> None:
        self.executor = executor
        self.queue_size = queue_size
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._idle = threading.Condition()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="device-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._queue.qsize()

    def submit(self, batch: ForwardBatch, batch_id: int) -> Job:
        job = Job(batch=batch, batch_id=batch_id)
        with self._idle:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise QueueFullError(
                    f"the device queue is full ({self.queue_size} batches waiting); retry later or send fewer batches at once"
                ) from None
            self._in_flight += 1
        return job

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

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.future.set_running_or_notify_cancel():
                    self._execute(job)
            finally:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _execute(self, job: Job) -> None:
        started = time.perf_counter_ns()
        structlog.contextvars.bind_contextvars(batch_id=job.batch_id)
        try:
            out = self.executor.forward(job.batch)
        except BaseException as exc:  # handed to the RPC thread, which maps it to a status
            job.future.set_exception(exc)
        else:
            out.stats.timings_ns["queue"] = started - job.enqueued_ns
            job.future.set_result(out)
        finally:
            structlog.contextvars.unbind_contextvars("batch_id")
