"""`Step`: one batch from admission to sampled tokens, as five calls on one `StepBatch`.

    sb = step.admit(batch, clock)   # every refusal, on host data; each feature's part
    step.stage(sb)                  # one upload; each part applies (row table, controls, ...)
    step.launch(sb)                 # forward, logits, draw, the copy of the results: enqueued
    out = step.read(sb)             # wait for the copy; each part commits; the answer

`forward` runs them in a row. Between `launch` and `read` the host is free (CUDA, the
stand-in accelerator): the device thread admits and stages the next batch there, against the
state this one leaves (`executor.service.device_worker`). The features take part through
`executor.core.features` (the hooks' order and rules are there); `Step` never names one. A
failure after `apply` undoes every applied part, in reverse (`undo`), so a refused or failed
batch leaves the executor as it was.

The clock's phases: `validate` (admission), `stage`, `forward` and `sample` (the launch),
`read` (the wait for the results and the commits), `total` from admission to the answer.
It is not thread-safe: one thread owns the device; a background graph capture takes `lock`
between two phases.

Tensor parallel: rank 0 admits, and broadcasts each step at its launch, holding the group
until its read; the other ranks run :meth:`Step.run_shard` on it (staging, their row table,
their part of the model and its collectives; rank 0 samples).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from itertools import chain

from executor.batch_prep import complete_batch
from executor.core.clock import StepClock
from executor.core.errors import TestHooks
from executor.core.features import StepFeature
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
from executor.core.names import MODE_NAMES
from executor.core.observer import ExecutorObserver
from executor.core.outputs import ForwardOutput, StepStats
from executor.core.step_batch import InFlight, StepBatch
from executor.core.toggles import Toggles
from executor.future_tokens import FutureTokenTable
from executor.model_runner import ModelRunner
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from executor.row_table import RowTable
from executor.sampling import Sampler
from executor.speculative.speculation import resolve_held_prefix
from executor.step.timeline import DeviceTimeline
from executor.validation import validate_batch
from ops.h2d_staging import H2DStaging
from ops.host_transfer import host_transfers, to_host, to_host_async


class Step:
    def __init__(
        self,
        *,
        limits: BatchLimits,
        allow_custom_positions: bool,
        row_table: RowTable,
        future: FutureTokenTable,
        features: list[StepFeature],
        runner: ModelRunner,
        sampler: Sampler,
        staging: H2DStaging,
        toggles: Toggles,
        hooks: TestHooks,
        comm: TpComm,
        observer: ExecutorObserver,
        lock: threading.RLock,
        timeline: DeviceTimeline,
    ) -> None:
        """`features`: the executor's one feature list, in hook order (the row table first)."""
        self.limits = limits
        self.row_table = row_table
        self.pool = row_table.pool
        self.future = future
        self.features = features
        self.runner = runner
        self.sampler = sampler
        self.staging = staging
        self.toggles = toggles
        self.hooks = hooks
        self.comm = comm
        self.observer = observer
        self.lock = lock
        self.timeline = timeline  # when the device had each step (occupancy, the stand-in)
        self.leader: TpLeader | None = None  # rank 0 of a group, once it serves
        # The weights' version; changed only holding `lock`, between two steps.
        self.weight_version = ""
        # The batch's rules, against the live row lengths and future slots.
        self.validate = partial(
            validate_batch,
            limits=limits,
            resident_lens=self.pool.resident_lens,
            allow_custom_positions=allow_custom_positions,
            future_assigned=future.assigned,
        )

    def forward(
        self, batch: ForwardBatch, clock: StepClock, *, return_logits: bool = False
    ) -> ForwardOutput:
        """Run one step. A refused or failed batch leaves the executor as it was."""
        sb = self.admit(batch, clock, return_logits=return_logits)
        with self.lock:  # one step between two background-capture buckets
            self.stage(sb)
            self.launch(sb)
            return self.read(sb)

    def admit(
        self, batch: ForwardBatch, clock: StepClock, *, return_logits: bool = False
    ) -> StepBatch:
        """Every refusal, on host data, before anything changes (BatchValidationError): the
        batch's rules, then each feature's, against the state the steps before left."""
        sb = StepBatch(batch, clock, return_logits=return_logits)
        clock.use_device_events(self.runner.device)  # CUDA: forward and sample on events
        with clock.phase("validate"):
            self.hooks.check("admit")
            batch = resolve_held_prefix(batch, self.pool.resident_lens)
            self.validate(batch)
            self.complete(sb, batch)
            for feature in self.features:
                if (part := feature.admit(sb)) is not None:
                    sb.work.append(part)
        return sb

    def stage(self, sb: StepBatch) -> None:
        """One upload of the batch's and its parts' staged fields; each part applies."""
        with sb.clock.phase("stage"), self.lock, _Counted(sb):
            views = self.staging.stage(sb.staged_fields())
            try:
                sb.apply(views)
                self.hooks.check("stage")
            except BaseException:
                sb.undo()
                raise

    def launch(self, sb: StepBatch) -> None:
        """Enqueue the device work: the parts' launch, the forward, their logits, the draw
        and the copy of every result to the host (CUDA, the stand-in: the host is free)."""
        clock = sb.clock
        with self.lock, self.hooks.device_step_guard(), _Counted(sb):
            try:
                self.runner.step_started()  # background compiles and loads wait till read
                launched_ns, start = time.perf_counter_ns(), self.timeline.launching()
                self.comm.take_allreduce_ns()  # drop what warm-up or a capture accumulated
                with clock.phase("forward"):
                    if self.leader is not None:  # every rank runs what rank 0 accepted
                        step = self.future.resolved_for_workers(sb.host)
                        self.leader.send_step(step, keep_rows=sb.keep_rows)
                    sb.launch_parts()
                    sb.ran = self.runner.forward(sb.staged_device())
                    self.hooks.check("forward")
                with clock.phase("sample"):
                    logits = sb.logits(sb.ran.logits)
                    self.hooks.check("sampler")
                    draw = sb.draw(logits) or self.sampler.draw_step(sb, logits)
                    sb.sampled(draw.ids)
                    outputs = sb.outputs()
                    copy = to_host_async([*draw.device, *chain(*outputs)], "sampled_tokens")
                parts, kept = [len(o) for o in outputs], logits if sb.return_logits else None
                sb.flight = InFlight(draw, copy, parts, kept, launched_ns, start=start)
                self.timeline.launched(sb.flight)
            except BaseException:
                self._end_group()
                self.runner.step_ended()
                sb.undo()
                raise

    def read(self, sb: StepBatch) -> ForwardOutput:
        """Wait for the step's results (CUDA: its one sync); each part commits; the answer."""
        flight = sb.launched()
        with sb.clock.phase("read"), self.lock, self.hooks.device_step_guard():
            try:
                with _Counted(sb):
                    self.timeline.wait(flight)  # the stand-in: D ms after the launch
                    host = flight.copy.wait()
                    self.timeline.read(sb, sb.clock.queued_ns or sb.started_ns)
                    self.comm.settle()  # the device is done: a failed NCCL call raises
                    self.hooks.check("read")
                    logits = None if flight.logits is None else to_host(flight.logits, "logits")
            except BaseException:
                sb.undo()
                raise
            finally:
                self._end_group()
                self.runner.step_ended()
            at = len(flight.draw.device)
            out = flight.draw.output(host[:at], StepStats())
            sb.commit(out, host[at:], flight.parts)
            out.logits = logits
            if not sb.keep_rows:  # warm-up
                sb.undo()
        self._fill_stats(sb, out.stats)
        out.weight_version = self.weight_version  # changed only between two steps (the lock)
        return out

    def undo(self, sb: StepBatch) -> None:
        """A staged step that will not run (the step before it failed): its parts undone."""
        with self.lock:
            sb.undo()

    def complete(self, sb: StepBatch, batch: ForwardBatch) -> None:
        """The derived fields of a batch and its sampling plan (warm-up, on the reserved
        row 0, skips the batch rules and takes the row table's part only)."""
        sb.host = complete_batch(
            batch,
            needs_cpu_seq_lens=self.toggles.needs_cpu_seq_lens,
            max_context_len=self.limits.max_context_len,
        )
        assert sb.host.sampling is not None
        sb.sampling = self.sampler.plan(sb.host.sampling)

    def warm(self, batch: ForwardBatch) -> None:
        """One step on the reserved row 0, everything undone after it (the warm-up)."""
        sb = StepBatch(batch, StepClock(), keep_rows=False)
        self.complete(sb, batch)
        sb.work.append(self.row_table.admit(sb))
        self.stage(sb)
        self.launch(sb)
        self.read(sb)

    def run_shard(self, host: ForwardBatch, *, keep_rows: bool) -> None:
        """A worker rank: a step rank 0 admitted and broadcast (staging, row-table write,
        this rank's part of the model and its collectives; rank 0 samples)."""
        self.comm.settle()  # the previous step's collectives (done before rank 0 sent this one)
        sb = StepBatch(host, StepClock(), keep_rows=keep_rows)
        sb.work.append(self.row_table.admit(sb))
        self.stage(sb)
        try:
            self.runner.forward(sb.staged_device())  # references resolved by rank 0
        except BaseException:
            self.undo(sb)
            raise
        if not keep_rows:
            self.undo(sb)
        self.comm.take_allreduce_ns()

    def _end_group(self) -> None:
        if self.leader is not None:
            self.leader.end_step()

    def _fill_stats(self, sb: StepBatch, stats: StepStats) -> None:
        """The step's stats, set in `stats` (this step's own, where the draw and the parts
        wrote theirs)."""
        host, ran, clock = sb.host, sb.ran, sb.clock
        assert ran is not None
        clock.record("total", sb.started_wall_ns, time.perf_counter_ns() - sb.started_ns)
        if ran.graph_fallback is not None:
            self.observer.on_graph_fallback(ran.graph_fallback.kind, ran.graph_fallback.reason)
        stats.d2h_syncs, stats.h2d_syncs, stats.h2d_copies = sb.transfers
        stats.path = ran.path
        stats.batch_size = host.batch_size
        stats.padded_batch_size = ran.padded_batch_size
        stats.num_tokens = host.num_tokens
        stats.padded_num_tokens = ran.padded_num_tokens
        stats.timings_ns = clock.durations_ns
        stats.mode = MODE_NAMES[host.forward_mode]
        stats.fill_registry = ran.fill_registry
        fill = ran.fill_stats
        stats.fill_tensors, stats.fill_bytes = fill.tensors_copied, fill.bytes_copied
        stats.fill_copy_calls = fill.copy_calls
        stats.graph_fallback = ran.graph_fallback
        stats.future_refs = host.future_refs
        stats.started_ns = clock.started_ns
        stats.allreduce_ns = self.comm.take_allreduce_ns()
        stats.host_gap_ns = sb.host_gap_ns
        stats.device_busy_ns = sb.device_busy_ns


class _Counted:
    """Adds the host<->device transfers made inside the block to the step's own counts (the
    process-wide totals also move for the next batch, staged between this one's phases)."""

    __slots__ = ("_before", "_sb")

    def __init__(self, sb: StepBatch) -> None:
        self._sb = sb

    def __enter__(self) -> None:
        self._before = host_transfers.totals()

    def __exit__(self, *exc: object) -> None:
        after = host_transfers.totals()
        t = self._sb.transfers
        for i in range(3):
            t[i] += after[i] - self._before[i]
