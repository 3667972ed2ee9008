"""One thread owns the device and runs batches in arrival order; a bounded queue fronts it.

RPC handler threads decode a request, `submit` a Job and wait on its future. When the queue
is full, `submit` raises QueueFullError at once (back-pressure, not blocking). A job whose
future was cancelled before it started (its stream failed) is skipped.

`run_on_device(fn)` queues a control job (a runtime-config change) behind the batches already
accepted, so it runs between two batches on the device thread. Each finished step is handed
to `on_step` (the server's metrics) before its future resolves, and runs under the OTel
context of its RPC so that log lines written during the step carry its trace ids.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from executor.forward_batch import ForwardBatch
from executor.model_executor import ForwardOutput, ModelExecutor, StepStats
from executor.observability.logs import debug_enabled

log = structlog.get_logger(__name__)


class QueueFullError(RuntimeError):
    """The device queue is full; the caller should retry later or send less."""


@dataclass
class Job:
    batch: ForwardBatch
    batch_id: int
    future: Future[ForwardOutput] = field(default_factory=Future)
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    trace_context: Context | None = None  # the RPC's span, for log lines during the step


@dataclass
class ControlJob:
    """A call to run on the device thread between two batches (a runtime-config change)."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


class DeviceWorker:
    def __init__(
        self,
        executor: ModelExecutor,
        queue_size: int,
        *,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        self.executor = executor
        self.queue_size = queue_size
        self.on_step = on_step
        self._queue: queue.Queue[Job | ControlJob | None] = queue.Queue(maxsize=queue_size)
        self._idle = threading.Condition()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="device-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._queue.qsize()

    def submit(
        self, batch: ForwardBatch, batch_id: int, *, trace_context: Context | None = None
    ) -> Job:
        job = Job(batch=batch, batch_id=batch_id, trace_context=trace_context)
        self._put(job)
        return job

    def run_on_device(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the device thread after the batches already queued; its future."""
        job = ControlJob(fn)
        self._put(job)
        return job.future

    def _put(self, job: Job | ControlJob) -> None:
        with self._idle:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise QueueFullError(
                    f"the device queue is full ({self.queue_size} batches waiting); retry later or send fewer batches at once"
                ) from None
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
                    if isinstance(job, ControlJob):
                        self._control(job)
                    else:
                        self._execute(job)
            finally:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _control(self, job: ControlJob) -> None:
        try:
            result = job.fn()
        except BaseException as exc:  # handed to the RPC thread, which maps it to a status
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _execute(self, job: Job) -> None:
        started = time.perf_counter_ns()
        structlog.contextvars.bind_contextvars(batch_id=job.batch_id)
        token = otel_context.attach(job.trace_context) if job.trace_context is not None else None
        try:
            out = self.executor.forward(job.batch)
            stats = out.stats
            queued = started - job.enqueued_ns
            stats.timings_ns["queue"] = queued
            if "validate" in stats.started_ns:
                stats.started_ns["queue"] = stats.started_ns["validate"] - queued
            if self.on_step is not None:
                self.on_step(stats)  # before the answer is released: a scrape after it sees it
            if debug_enabled():
                log.debug(
                    "step",
                    mode=stats.mode,
                    path=stats.path,
                    batch_size=stats.batch_size,
                    num_tokens=stats.num_tokens,
                    total_us=stats.timings_ns["total"] // 1000,
                )
        except BaseException as exc:  # handed to the RPC thread, which maps it to a status
            job.future.set_exception(exc)
        else:
            job.future.set_result(out)
        finally:
            if token is not None:
                otel_context.detach(token)
            structlog.contextvars.unbind_contextvars("batch_id")
