"""What the device thread runs: batch jobs and control jobs, their errors, their streams.

What the device thread checks before it runs a job, so that nothing is applied that no one
is waiting for:
- the job's RPC is still active (`Job.is_active`, the gRPC context's) and its deadline has
  not passed: else the job is answered `RpcEndedError` and not run (checked again just
  before the launch of a batch prepared ahead);
- the job's stream (`Job.stream`) has no failed batch: once a batch of a stream is refused or
  fails on the device thread, every later batch of that stream is answered
  `StreamFailedError` without running. The flag is set on the device thread before it takes
  the next job's turn, so which batches of a failed stream ran is never a race;
- the job's `batch_id` is not among the recently applied ones (`AppliedBatches`): a retry is
  answered with the stored output and not applied again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput
from executor.core.step_batch import StepBatch


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

    def refusal(self) -> BaseException | None:
        """Why the job must not run now, or None. Checked on the device thread just before it."""
        stream = self.stream
        if stream is not None and stream.failed_batch_id is not None:
            return StreamFailedError(
                f"batch_id {self.batch_id} was not applied: batch_id {stream.failed_batch_id} "
                "before it on this stream failed"
            )
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return RpcEndedError(
                f"batch_id {self.batch_id} was not applied: its deadline passed before the "
                "device reached it",
                deadline=True,
            )
        if self.is_active is not None and not self.is_active():
            return RpcEndedError(
                f"batch_id {self.batch_id} was not applied: its RPC ended (cancelled or past "
                "its deadline) before the device reached it",
                deadline=False,
            )
        return None


@dataclass
class ControlJob:
    """A call to run on the device thread between two batches (a runtime-config change)."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


def resolve(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless someone (`abandon`) already did."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


@dataclass(eq=False)
class Turn:
    """A batch job taken from the queue, and what preparing it gave (when it was prepared)."""

    job: Job
    prepared: bool = False
    ahead: bool = False  # prepared while the step before ran: its RPC is checked again
    sb: StepBatch | None = None  # admitted and staged: it launches next
    launched: bool = False  # launched behind the step before it, before that one's read
    answer: ForwardOutput | None = None  # a retry, answered from memory
    error: BaseException | None = None  # refused, or failed before its launch

    def forget(self) -> None:
        """Back to taken-but-not-prepared (its staging was undone)."""
        self.prepared, self.ahead, self.launched = False, False, False
        self.sb, self.answer, self.error = None, None, None


@dataclass(eq=False)
class HeldAnswer:
    """A read step's answer, sent after the launch of the batch prepared while it ran."""

    job: Job
    out: ForwardOutput
    sent: bool = False


class JobScope:
    """The device thread's log context (batch_id) and trace context: the job whose phase runs
    now, so that log lines written during it carry its ids. `enter` at each phase: the job
    already in scope costs one comparison (a step's phases follow each other), another job
    replaces it; `clear` before the thread waits for work or runs a control job."""

    def __init__(self) -> None:
        self._job: Job | None = None
        self._token: object = None

    def enter(self, job: Job) -> None:
        if job is self._job:
            return
        self.clear()
        structlog.contextvars.bind_contextvars(batch_id=job.batch_id)
        if job.trace_context is not None:
            self._token = otel_context.attach(job.trace_context)
        self._job = job

    def clear(self) -> None:
        if self._job is None:
            return
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None
        structlog.contextvars.unbind_contextvars("batch_id")
        self._job = None
