"""One thread owns the device and runs batches in arrival order; a bounded queue fronts it.

RPC handler threads decode a request, `submit` a Job and wait on its future. When the queue
is full, `submit` raises QueueFullError at once (back-pressure, not blocking). A job whose
future was cancelled before it started (its stream failed) is skipped.

What the device thread checks before it runs a job, so that nothing is applied that no one
is waiting for:
- the job's RPC is still active (`Job.is_active`, the gRPC context's) and its deadline has
  not passed: else the job is answered `RpcEndedError` and not run;
- the job's stream (`Job.stream`) has no failed batch: once a batch of a stream is refused or
  fails on the device thread, every later batch of that stream is answered
  `StreamFailedError` without running. The flag is set on the device thread before it takes
  the next job, so which batches of a failed stream ran is never a race;
- the job's `batch_id` is not among the recently applied ones (`AppliedBatches`): a retry is
  answered with the stored output and not applied again.

`close()` is the stop marker: no job is accepted after it (`WorkerClosedError`), and the
thread ends once the jobs already accepted have run. `abandon()` answers every job still
waiting, and the one running, with `WorkerClosedError`: the end of a drain's grace period.

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
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput, StepStats
from executor.model_executor import ModelExecutor
from executor.observability.logs import debug_enabled
from executor.service.applied_batches import AppliedBatches
from executor.service.tenancy import RowTenants
from executor.service.watchdog import RunningStep, is_sticky_device_error
from executor.step.clock import StepClock

log = structlog.get_logger(__name__)


class QueueFullError(RuntimeError):
    """The device queue is full; the caller should retry later or send less."""


class WorkerClosedError(RuntimeError):
    """The worker stopped taking jobs (a drain), or gave up on one at the end of the grace."""


class RpcEndedError(RuntimeError):
    """The job's RPC ended (deadline or cancellation) before the device reached it; not run."""

    def __init__(self, message: str, *, deadline: bool) -> None:
        super().__init__(message)
        self.deadline = deadline


class StreamFailedError(RuntimeError):
    """An earlier batch of the same stream failed; this one was not run."""


@dataclass
class StreamState:
    """What the device thread knows about one ForwardStream: the batch that failed it."""

    failed_batch_id: int | None = None


@dataclass
class Job:
    batch: ForwardBatch
    batch_id: int
    future: Future[ForwardOutput] = field(default_factory=Future)
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    enqueued_wall_ns: int = field(default_factory=time.time_ns)  # the queue span's start
    trace_context: Context | None = None  # the RPC's span, for log lines during the step
    stream: StreamState | None = None  # the stream the job belongs to; None for unary
    is_active: Callable[[], bool] | None = None  # the RPC's liveness (context.is_active)
    deadline: float | None = None  # time.monotonic() after which no one waits for the answer
    fingerprint: bytes = b""  # what the batch writes, to tell a retry from a reused id
    replayed: bool = False  # answered from AppliedBatches: not applied again
    caller: str = ""  # the identity its rows are recorded under (`tenants`)


@dataclass
class ControlJob:
    """A call to run on the device thread between two batches (a runtime-config change)."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


def _resolve(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless someone (`abandon`) already did."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class DeviceWorker:
    def __init__(
        self,
        executor: ModelExecutor,
        queue_size: int,
        *,
        on_step: Callable[[StepStats], None] | None = None,
        applied: AppliedBatches | None = None,
        on_device_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.executor = executor
        self.queue_size = queue_size
        self.on_step = on_step
        # Called (on the device thread) with a step's error that poisons the device context.
        self.on_device_error = on_device_error
        self.applied = applied if applied is not None else AppliedBatches(0)
        # Which caller owns each row (set when callers differ in identity): checked before a
        # batch runs, recorded after it applied.
        self.tenants: RowTenants | None = None
        # Unbounded underneath: `_put` enforces queue_size, so the stop marker never blocks.
        self._queue: queue.Queue[Job | ControlJob | None] = queue.Queue()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._running: Job | ControlJob | None = None
        # The step on the device now, for the watchdog: (batch_id, start, its clock).
        self._on_device: tuple[int, float, StepClock] | None = None
        self._thread = threading.Thread(target=self._run, name="device-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._queue.qsize()

    def running_step(self) -> RunningStep | None:
        """The batch on the device now, how long it has run and its phase (None: idle)."""
        step = self._on_device  # one read: the device thread replaces the tuple, never mutates it
        if step is None:
            return None
        batch_id, start, clock = step
        return RunningStep(batch_id, time.monotonic() - start, clock.current or "queue")

    def submit(
        self,
        batch: ForwardBatch,
        batch_id: int,
        *,
        trace_context: Context | None = None,
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

    def run_on_device(self, fn: Callable[[], Any]) -> Future[Any]:
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
        """Answer every accepted job not yet finished (waiting, or running: its handler stops
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
            running = self._running
        for job in pending:  # out of the queue: they never run
            if not job.future.done():
                _resolve(job.future, exc=WorkerClosedError(reason))
                answered += 1
        if running is not None and not running.future.done():
            _resolve(running.future, exc=WorkerClosedError(f"{reason}; it may have been applied"))
            answered += 1
        return answered

    def stop(self, timeout: float | None = None) -> bool:
        """Close, then wait for the thread to end; False if it is still running after `timeout`."""
        self.close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._idle:
                self._running = job
            try:
                if job.future.set_running_or_notify_cancel():
                    if isinstance(job, ControlJob):
                        self._control(job)
                    else:
                        self._step(job)
            finally:
                with self._idle:
                    self._running = None
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _control(self, job: ControlJob) -> None:
        try:
            result = job.fn()
        except BaseException as exc:  # handed to the RPC thread, which maps it to a status
            _resolve(job.future, exc=exc)
        else:
            _resolve(job.future, result)

    def _refusal(self, job: Job) -> BaseException | None:
        """Why the job must not run now, or None. Checked on the device thread just before it."""
        stream = job.stream
        if stream is not None and stream.failed_batch_id is not None:
            return StreamFailedError(
                f"batch_id {job.batch_id} was not applied: batch_id {stream.failed_batch_id} "
                "before it on this stream failed"
            )
        if job.deadline is not None and time.monotonic() >= job.deadline:
            return RpcEndedError(
                f"batch_id {job.batch_id} was not applied: its deadline passed before the "
                "device reached it",
                deadline=True,
            )
        if job.is_active is not None and not job.is_active():
            return RpcEndedError(
                f"batch_id {job.batch_id} was not applied: its RPC ended (cancelled or past "
                "its deadline) before the device reached it",
                deadline=False,
            )
        return None

    def _step(self, job: Job) -> None:
        refusal = self._refusal(job)
        if refusal is None:
            try:
                stored = self.applied.lookup(job.batch_id, job.fingerprint)
            except BaseException as exc:
                refusal = exc
            else:
                if stored is not None:
                    job.replayed = True
                    _resolve(job.future, stored)
                    return
        if refusal is not None:
            if job.stream is not None and job.stream.failed_batch_id is None:
                job.stream.failed_batch_id = job.batch_id
            _resolve(job.future, exc=refusal)
            return
        self._execute(job)

    def _execute(self, job: Job) -> None:
        clock = StepClock()
        clock.record("queue", job.enqueued_wall_ns, time.perf_counter_ns() - job.enqueued_ns)
        structlog.contextvars.bind_contextvars(batch_id=job.batch_id)
        token = otel_context.attach(job.trace_context) if job.trace_context is not None else None
        self._on_device = (job.batch_id, time.monotonic(), clock)
        tenants = self.tenants
        try:
            if tenants is not None:
                tenants.check_batch(job.batch, job.caller)
            out = self.executor.forward(job.batch, clock=clock)
        except BaseException as exc:  # handed to the RPC thread, which maps it to a status
            self._on_device = None
            if job.stream is not None and job.stream.failed_batch_id is None:
                job.stream.failed_batch_id = job.batch_id  # before the next job is taken
            _resolve(job.future, exc=exc)
            self._detach(token)
            if self.on_device_error is not None and is_sticky_device_error(exc):
                self.on_device_error(exc)
            return
        self._on_device = None
        if tenants is not None:
            tenants.record_batch(job.batch, job.caller)
        # Applied: from here on the batch is remembered, whatever the bookkeeping does.
        self.applied.store(job.batch_id, job.fingerprint, out)
        try:
            self._report(out.stats)
        except BaseException:  # a hook's failure must not report an applied batch as failed
            log.error("post-step hook failed", batch_id=job.batch_id, exc_info=True)
        _resolve(job.future, out)
        self._detach(token)

    @staticmethod
    def _detach(token: object) -> None:
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
        structlog.contextvars.unbind_contextvars("batch_id")

    def _report(self, stats: StepStats) -> None:
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
