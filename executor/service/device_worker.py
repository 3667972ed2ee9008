"""One thread owns the device and runs batches in arrival order; a bounded queue fronts it.

RPC handler threads `submit` jobs to its queue (`executor.service.job_queue`: back-pressure,
close, abandon) and wait on their futures. A job whose future was cancelled before it started
(its stream failed) is skipped.

The pipeline: the device thread launches step N (its device work enqueued, the copy of its
results to the host with it), then takes the next queued batch, admits, stages and launches
it behind N while N runs on the device (the device starts N+1 the moment N ends), then reads
N and answers it. Under tensor parallelism (the group runs one step at a time) N+1 is
launched after N's read, and N answered after that launch. N+1 is admitted against the state N
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
from collections.abc import Callable

import structlog

from executor.core.clock import StepClock
from executor.core.outputs import ForwardOutput, StepStats
from executor.core.step_batch import StepBatch
from executor.model_executor import ModelExecutor
from executor.observability.logs import WRITE_LOCK, debug_enabled
from executor.service.applied_batches import AppliedBatches
from executor.service.job_queue import JobQueue
from executor.service.jobs import (
    ControlJob,
    HeldAnswer,
    Job,
    JobScope,
    Turn,
    resolve,
)
from executor.service.tenancy import RowTenants
from executor.service.watchdog import RunningStep, is_sticky_device_error

log = structlog.get_logger(__name__)


_NOTHING = object()  # no job came while the step ran


class DeviceWorker(JobQueue):
    """The queue's one consumer: the device thread, running each job as the module says."""

    def __init__(
        self,
        executor: ModelExecutor,
        queue_size: int,
        *,
        on_step: Callable[[StepStats], None] | None = None,
        applied: AppliedBatches | None = None,
        on_device_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        super().__init__(queue_size)
        self.executor = executor
        # The capture thread never waits for the steps holding the log's lock (a line
        # written on the way to the device would wait for it).
        executor.runner.idle_gate.guard(WRITE_LOCK)
        self.on_step = on_step
        # Called (on the device thread) with a step's error that poisons the device context.
        self.on_device_error = on_device_error
        self.applied = applied if applied is not None else AppliedBatches(0)
        # Which caller owns each row (set when callers differ in identity): checked before a
        # batch runs, recorded after it applied.
        self.tenants: RowTenants | None = None
        # The step on the device now, for the watchdog: (batch_id, start, its clock).
        self._on_device: tuple[int, float, StepClock] | None = None
        self._scope = JobScope()  # the device thread's log and trace context
        self._thread = threading.Thread(target=self._run, name="device-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def running_step(self) -> RunningStep | None:
        """The batch on the device now, how long it has run and its phase (None: idle)."""
        step = self._on_device  # one read: the device thread replaces the tuple, never mutates it
        if step is None:
            return None
        batch_id, start, clock = step
        return RunningStep(batch_id, time.monotonic() - start, clock.current or "queue")

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
            item: object = ahead
            if ahead is _NOTHING:
                self._scope.clear()  # waiting: no job's ids on what the thread logs
                item = self._queue.get()
            ahead = _NOTHING
            if item is None:
                return
            if isinstance(item, ControlJob):
                self._scope.clear()
                if self._take(item):
                    self._control(item)
                continue
            assert isinstance(item, Turn | Job)
            turn = item if isinstance(item, Turn) else self._turn(item)
            if turn is not None:
                ahead, answer = self._serve(turn, answer)

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
        # It waited, prepared ahead (and not launched yet): its RPC is checked again.
        refusal = job.refusal() if turn.ahead and not turn.launched else None
        if refusal is not None:
            self._send(before)
            self.executor.undo(sb)
            self._fail(job, refusal)
            return _NOTHING, None
        if sb.awaits_mask:  # its mask may follow the answer of the step before
            self._send(before)
        self._on_device = (job.batch_id, time.monotonic(), sb.clock)
        if not turn.launched:
            self._scope.enter(job)
            try:
                self.executor.launch(sb)
            except BaseException as exc:  # undone by the step
                self._send(before)
                self._fail(job, exc)
                return _NOTHING, None
        self._send(before)  # the device has this step: the host answers the one before
        ahead = self._take_ahead(job, sb)
        if (
            isinstance(ahead, Turn)
            and ahead.sb is not None
            and self.executor.launches_ahead
            and not ahead.sb.awaits_mask  # launched in its turn, after this step's answer
        ):
            self._launch_ahead(ahead)
        self._scope.enter(job)
        try:
            out = self.executor.finish(sb)
        except BaseException as exc:  # undone by the step, what came ahead first
            if isinstance(ahead, Turn):
                self._forget(ahead)
            self._fail(job, exc)
            return ahead, None
        if isinstance(ahead, Turn) and ahead.launched:
            self._done(job, out, on_device=False)
            assert ahead.sb is not None
            self._on_device = (ahead.job.batch_id, time.monotonic(), ahead.sb.clock)
            return ahead, None
        if isinstance(ahead, Turn) and ahead.sb is not None:
            return ahead, HeldAnswer(job, out)  # sent once `ahead` is launched
        self._done(job, out)
        return ahead, None

    def _launch_ahead(self, turn: Turn) -> None:
        """Launch a batch prepared ahead behind the step on the device, before that one is
        read: the device starts it as soon as the step before ends, with no host work
        between them. Its RPC gone, or its launch failed (undone by the step): it is
        answered in its turn, after the step before."""
        assert turn.sb is not None
        refusal = turn.job.refusal()
        if refusal is None:
            self._scope.enter(turn.job)
            try:
                self.executor.launch(turn.sb)
            except BaseException as exc:
                refusal = exc
            else:
                turn.launched = True
                return
        else:
            self.executor.undo(turn.sb)
        turn.sb, turn.error = None, refusal

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
        self._scope.enter(job)
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
        self._scope.enter(job)  # this job's batch_id and trace, even when answered late
        try:
            self._report(out.stats)
        except BaseException:  # a hook's failure must not report an applied batch as failed
            log.error("post-step hook failed", batch_id=job.batch_id, exc_info=True)
        resolve(job.future, out)

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
