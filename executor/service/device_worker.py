"""One thread owns the device and runs batches in arrival order; a bounded queue fronts it.

RPC handler threads decode a request, `submit` a Job and wait on its future. When the queue
is full, `submit` raises QueueFullError at once (back-pressure, not blocking). A job whose
future was cancelled before it started (its stream failed) is skipped.

The pipeline: the device thread launches step N (its device work enqueued, the copy of its
results to the host with it), then takes the next queued batch and admits and stages it
while N runs on the device, then reads N, launches N+1 and only then answers N (the
device does not wait for N's answer and metrics). N+1 is admitted against the state N
leaves (N's host-side effects are applied when N is staged; a part whose read changes what
admission reads, VERIFY's truncation, stops the pipeline for one step: `admits_next_early`).
Where the forward is synchronous (a CPU device) the next batch is taken after N's answer, as
one step at a time (`ModelExecutor.pipelines`). The rules hold across the two:
- a refused batch changes nothing, and its refusal is answered after the step before it;
- if N fails, nothing prepared for N+1 survives: its staging is undone and it is taken again
  from the start, against the restored state (on N's stream: refused, see below);
- a batch taken ahead is not prepared early when it may depend on N's answer being stored
  (the same `batch_id`: a retry of N) or recorded (another caller's, with tenancy on).

What the device thread checks before it runs a job (its RPC alive, its stream not failed,
not a retry): `executor.service.jobs`.

`close()` is the stop marker: no job is accepted after it (`WorkerClosedError`), and the
thread ends once the jobs already accepted have run. `abandon()` answers every job still
waiting, and the ones running, with `WorkerClosedError`: the end of a drain's grace period.

`run_on_device(fn)` queues a control job (a runtime-config change) behind the batches already
accepted, so it runs between two batches on the device thread (never between a batch's
launch and its read). Each finished step is handed to `on_step` (the server's metrics)
before its future resolves, and runs under the OTel context of its RPC so that log lines
written during the step carry its trace ids.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import context as otel_context

from executor.core.clock import StepClock
from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput, StepStats
from executor.core.step_batch import StepBatch
from executor.model_executor import ModelExecutor
from executor.observability.logs import debug_enabled
from executor.service.applied_batches import AppliedBatches
from executor.service.jobs import (
    ControlJob,
    HeldAnswer,
    Job,
    QueueFullError,
    StreamState,
    Turn,
    WorkerClosedError,
    resolve,
)
from executor.service.tenancy import RowTenants
from executor.service.watchdog import RunningStep, is_sticky_device_error

log = structlog.get_logger(__name__)


_NOTHING = object()  # no job came while the step ran


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
        self._running: list[Job | ControlJob] = []  # taken from the queue, not finished
        # The step on the device now, for the watchdog: (batch_id, start, its clock).
        self._on_device: tuple[int, float, StepClock] | None = None
        self._thread = threading.Thread(target=self._run, name="device-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the ones taken)."""
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

    def stop(self, timeout: float | None = None) -> bool:
        """Close, then wait for the thread to end; False if it is still running after `timeout`."""
        self.close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- the device thread ---------------------------------------------------------------
    def _run(self) -> None:
        ahead: object = _NOTHING  # what was taken from the queue while a step ran
        answer: HeldAnswer | None = None  # the step before `ahead`'s, sent after its launch
        while True:
            item = self._queue.get() if ahead is _NOTHING else ahead
            ahead = _NOTHING
            if item is None:
                return
            if isinstance(item, ControlJob):
                if self._take(item):
                    self._control(item)
                continue
            assert isinstance(item, Turn | Job)
            turn = item if isinstance(item, Turn) else self._turn(item)
            if turn is not None:
                ahead, answer = self._serve(turn, answer)

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

    def _turn(self, job: Job) -> Turn | None:
        return Turn(job) if self._take(job) else None

    def _control(self, job: ControlJob) -> None:
        try:
            result = job.fn()
        except BaseException as exc:  # handed to the RPC thread, which maps it to a status
            resolve(job.future, exc=exc)
        else:
            resolve(job.future, result)
        finally:
            self._finish(job)

    def _serve(self, turn: Turn, before: HeldAnswer | None) -> tuple[object, HeldAnswer | None]:
        """Run one batch's turn: prepare it (unless it was, ahead), launch it, send `before`
        (the answer of the step before it), take the next job ahead and prepare it while this
        one runs, read this one. Returns what was taken ahead (`_NOTHING`: nothing) and this
        one's answer when it waits for the launch of the batch prepared ahead (so that the
        device starts that one before the host answers this one). Never raises."""
        job, answer = turn.job, None
        try:
            with self.executor.step_lock:  # one turn between two background-capture buckets
                ahead, answer = self._serve_locked(turn, before)
                return ahead, answer
        finally:
            self._send(before)  # (sent already, unless this turn ended early)
            if answer is None:
                self._finish(job)

    def _serve_locked(
        self, turn: Turn, before: HeldAnswer | None
    ) -> tuple[object, HeldAnswer | None]:
        job = turn.job
        if not turn.prepared:
            self._prepare(turn, on_device=True)
        sb = turn.sb
        if sb is None:  # refused, failed before its launch, or answered from memory
            self._send(before)
            self._answer_unrun(turn)
            return _NOTHING, None
        refusal = job.refusal() if turn.ahead else None  # it waited, prepared ahead
        if refusal is not None:
            self._send(before)
            self.executor.undo(sb)
            self._fail(job, refusal)
            return _NOTHING, None
        self._on_device = (job.batch_id, time.monotonic(), sb.clock)
        with self._scope(job):
            try:
                self.executor.launch(sb)
            except BaseException as exc:  # undone by the step
                self._send(before)
                self._fail(job, exc)
                return _NOTHING, None
        self._send(before)  # the device has this step: the host answers the one before
        ahead = self._take_ahead(job, sb)
        with self._scope(job):
            try:
                out = self.executor.finish(sb)
            except BaseException as exc:  # undone by the step, what came ahead first
                if isinstance(ahead, Turn):
                    self._forget(ahead)
                self._fail(job, exc)
                return ahead, None
        if isinstance(ahead, Turn) and ahead.sb is not None:
            return ahead, HeldAnswer(job, out)  # sent once `ahead` is launched
        self._done(job, out)
        return ahead, None

    def _send(self, answer: HeldAnswer | None) -> None:
        """A step's answer held for the next launch: sent (once), and the job finished."""
        if answer is None or answer.sent:
            return
        answer.sent = True
        try:
            self._done(answer.job, answer.out, on_device=False)
        finally:
            self._finish(answer.job)

    def _prepare(self, turn: Turn, *, on_device: bool) -> None:
        """Refusals, the retry memory, then the executor's admission and staging. `on_device`:
        no other step is on the device (the watchdog follows this one's phases)."""
        job = turn.job
        turn.prepared = True
        refusal = job.refusal()
        if refusal is None:
            try:
                turn.answer = self.applied.lookup(job.batch_id, job.fingerprint)
            except BaseException as exc:
                refusal = exc
            if turn.answer is not None:
                return
        if refusal is not None:
            turn.error = refusal
            return
        clock = StepClock(queued_ns=job.enqueued_ns)
        clock.record("queue", job.enqueued_wall_ns, time.perf_counter_ns() - job.enqueued_ns)
        if on_device:
            self._on_device = (job.batch_id, time.monotonic(), clock)
        with self._scope(job):
            try:
                if self.tenants is not None:
                    self.tenants.check_batch(job.batch, job.caller)
                turn.sb = self.executor.prepare(job.batch, clock)
            except BaseException as exc:  # refused: nothing changed; failed: undone
                turn.error = exc

    def _take_ahead(self, job: Job, sb: StepBatch) -> object:
        """While `sb` runs on the device: the next queued item, a batch prepared against the
        state `sb` leaves. Waits for one at most until `sb`'s results are ready."""
        if not (self.executor.pipelines and sb.admits_next_early):
            return _NOTHING
        while True:
            wait = self.executor.seconds_to_ready(sb)
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                if wait > 0:
                    continue
                return _NOTHING
            break
        if item is None or isinstance(item, ControlJob):
            return item  # runs after this step's answer
        turn = self._turn(item)
        if turn is None:
            return _NOTHING
        retry = item.batch_id != 0 and item.batch_id == job.batch_id
        foreign = self.tenants is not None and item.caller != job.caller
        if not (retry or foreign):
            turn.ahead = True
            self._prepare(turn, on_device=False)
            sb.staged_after = turn.sb  # undone first if `sb` fails
        return turn

    def _forget(self, turn: Turn) -> None:
        """The step before `turn` failed: nothing prepared for it survives."""
        if turn.sb is not None:
            try:
                self.executor.undo(turn.sb)
            except BaseException as exc:
                turn.forget()
                turn.prepared, turn.error = True, exc
                return
        turn.forget()

    def _answer_unrun(self, turn: Turn) -> None:
        if turn.answer is not None:
            turn.job.replayed = True
            resolve(turn.job.future, turn.answer)
        else:
            assert turn.error is not None
            self._fail(turn.job, turn.error)

    def _fail(self, job: Job, exc: BaseException) -> None:
        """Answer `exc` (the RPC thread maps it to a status); the job's stream runs nothing
        after it (flagged before the next job's turn)."""
        self._on_device = None
        if job.stream is not None and job.stream.failed_batch_id is None:
            job.stream.failed_batch_id = job.batch_id
        resolve(job.future, exc=exc)
        if self.on_device_error is not None and is_sticky_device_error(exc):
            self.on_device_error(exc)

    def _done(self, job: Job, out: ForwardOutput, *, on_device: bool = True) -> None:
        """Answer an applied step (`on_device`: no other step is on the device now)."""
        if on_device:
            self._on_device = None
        if self.tenants is not None:
            self.tenants.record_batch(job.batch, job.caller)
        # Applied: from here on the batch is remembered, whatever the bookkeeping does.
        self.applied.store(job.batch_id, job.fingerprint, out)
        try:
            with self._scope(job):  # this job's batch_id and trace, even when answered late
                self._report(out.stats)
        except BaseException:  # a hook's failure must not report an applied batch as failed
            log.error("post-step hook failed", batch_id=job.batch_id, exc_info=True)
        resolve(job.future, out)

    @contextmanager
    def _scope(self, job: Job) -> Iterator[None]:
        """The job's log context (batch_id) and its RPC's trace context, around its phases."""
        structlog.contextvars.bind_contextvars(batch_id=job.batch_id)
        token = otel_context.attach(job.trace_context) if job.trace_context is not None else None
        try:
            yield
        finally:
            if token is not None:
                otel_context.detach(token)
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
