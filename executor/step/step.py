"""`Step`: one batch from admission to sampled tokens, with the row table undone on failure.

:meth:`Step.forward` is the whole step: admit the batch (every refusal, before anything is
uploaded or written), stage it (one host-to-device copy, the row-table write), run the
model on the path the runner picks, sample. A failure after the write undoes it.
The clock's phases: `validate` is the admission (rules, derived fields, the owner check),
`stage` the upload and the write, then `forward` and `sample`; `total` spans them.
It is not thread-safe: one thread owns the device; a background graph capture takes
`lock` bucket by bucket.

Tensor parallel: rank 0 admits and broadcasts each accepted step to the workers, which run
:meth:`Step.run_shard` on it: every rank stages, writes its row table and runs the same path.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

from executor.batch_prep import complete_batch
from executor.controls.admission import ControlsStep
from executor.controls.step_controls import StepControls
from executor.core.errors import BatchValidationError, TestHooks
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
from executor.core.names import MODE_NAMES
from executor.core.observer import ExecutorObserver
from executor.core.outputs import ForwardOutput, StepStats
from executor.core.runner_output import RunnerOutput
from executor.core.toggles import Toggles
from executor.extras.compute import Computed, PooledSums, assemble, compute, finish
from executor.extras.plan import OutputsPlan, plan_outputs
from executor.future_tokens import FutureTokenTable
from executor.kv_cache import ReqToTokenPool, RowWrite, WritePlan
from executor.model_runner import ModelRunner
from executor.parallel import broadcast
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from executor.sampling import Sampler
from executor.speculative.speculation import (
    Speculation,
    check_not_verify,
    check_verify,
    resolve_held_prefix,
)
from executor.step.clock import StepClock
from executor.validation import validate_batch
from ops.future_tokens import resolve_future_tokens
from ops.h2d_staging import H2DStaging
from ops.host_transfer import host_transfers, to_host
from ops.sampling import SamplingPlan


@dataclass(frozen=True)
class Admitted:
    """A batch the step accepted: completed with its derived fields, and its row-table
    write checked against the slot owners. Nothing was changed to admit it."""

    batch: ForwardBatch
    write: WritePlan
    controls: ControlsStep | None = None  # the sampling controls' work, None: none
    outputs: OutputsPlan | None = None  # the extra outputs' work, None: none


class Step:
    def __init__(
        self,
        *,
        limits: BatchLimits,
        allow_custom_positions: bool,
        pool: ReqToTokenPool,
        future: FutureTokenTable,
        runner: ModelRunner,
        sampler: Sampler,
        staging: H2DStaging,
        controls: StepControls,
        toggles: Toggles,
        hooks: TestHooks,
        comm: TpComm,
        observer: ExecutorObserver,
        lock: threading.Lock,
    ) -> None:
        self.limits = limits
        self.allow_custom_positions = allow_custom_positions
        self.pool = pool
        self.future = future
        self.runner = runner
        self.sampler = sampler
        self.staging = staging
        self.controls = controls
        self.speculation = Speculation(controls.slot_tokens, limits.vocab_size)
        config = runner.model.config
        self.pooled = PooledSums(limits.max_reqs, config.hidden_size, controls.device)
        self.toggles = toggles
        self.hooks = hooks
        self.comm = comm
        self.observer = observer
        self.lock = lock
        self.leader: TpLeader | None = None  # rank 0 of a group, once it serves
        # The weights' version; changed only holding `lock`, between two steps.
        self.weight_version = ""

    def forward(
        self, batch: ForwardBatch, clock: StepClock, *, return_logits: bool = False
    ) -> ForwardOutput:
        """Run one step. A refused or failed batch leaves the executor as it was."""
        transfers = host_transfers.totals()
        clock.use_device_events(self.runner.device)  # CUDA: forward and sample on events
        self.comm.take_allreduce_ns()  # drop what warm-up or a capture accumulated
        with clock.phase("total"):
            with clock.phase("validate"):
                admitted = self.admit(batch)
            with self.lock, self._group():
                ran, out = self.run(admitted, clock, return_logits=return_logits, keep_rows=True)
                self.comm.settle()  # the device is done (the D2H read): a failed NCCL call raises
                out.weight_version = self.weight_version
        sampled = out.stats  # the sampler's part of the stats
        out.stats = self._stats(admitted.batch, ran, clock, transfers)
        out.stats.control_rows = sampled.control_rows
        out.stats.draft_tokens = sampled.draft_tokens
        out.stats.accepted_drafts = sampled.accepted_drafts
        out.stats.accept_lengths = sampled.accept_lengths
        if ran.graph_fallback is not None:
            self.observer.on_graph_fallback(ran.graph_fallback.kind, ran.graph_fallback.reason)
        return out

    def admit(self, batch: ForwardBatch) -> Admitted:
        """Every refusal a decoded batch can meet, in one place, on host data, before
        anything is uploaded or written (BatchValidationError; nothing changed): the batch's
        rules, then its row-table write against the slots live rows hold."""
        batch = resolve_held_prefix(batch, self.pool.resident_lens)
        validate_batch(
            batch,
            self.limits,
            self.pool.resident_lens,
            allow_custom_positions=self.allow_custom_positions,
            future_assigned=self.future.assigned,
        )
        if batch.forward_mode.is_verify():
            check_verify(batch, self.limits, tp_size=self.comm.size)
        else:
            check_not_verify(batch)
        admitted = self.complete(batch)
        outputs = plan_outputs(
            admitted.batch,
            self.limits,
            num_layers=self.runner.model.config.num_layers,
            pooled=self.pooled.counts,
            tp_size=self.comm.size,
        )
        controls = self.controls.admit(admitted.batch)
        if controls is not None and batch.forward_mode.is_verify():
            raise BatchValidationError(
                "req_pool_indices", "VERIFY rows may not have sampling controls set"
            )
        if controls is None and outputs is None:
            return admitted
        return replace(admitted, controls=controls, outputs=outputs)

    def complete(self, batch: ForwardBatch) -> Admitted:
        """The derived fields of a batch and its checked row-table write (warm-up, on the
        reserved row 0, skips the batch rules)."""
        host = complete_batch(
            batch,
            needs_cpu_seq_lens=self.toggles.needs_cpu_seq_lens,
            max_context_len=self.limits.max_context_len,
        )
        return Admitted(host, self.pool.check_write(host))

    def run(
        self, admitted: Admitted, clock: StepClock, *, return_logits: bool, keep_rows: bool
    ) -> tuple[RunnerOutput, ForwardOutput]:
        """Stage, run, sample; the row-table write is undone if anything fails (or always,
        with `keep_rows=False`)."""
        host = admitted.batch
        assert host.sampling is not None
        with clock.phase("stage"):
            plan = self.sampler.plan(host.sampling)
            fb, write, views = self._stage(admitted, keep_rows=keep_rows)
            future = self.future.apply(host) if keep_rows else None
            controls = self.controls.apply(admitted.controls, views)
        try:
            with self.hooks.device_step_guard():
                with clock.phase("forward"):
                    if host.forward_mode.is_verify():  # drafts in, references resolved
                        fb = self.speculation.prepare(
                            host, fb, self.future.tokens, self.pool.req_to_token
                        )
                    self.controls.record_tokens(fb, self.future.tokens)
                    ran = self.runner.forward(fb)  # full graph, piecewise or eager
                    self.hooks.check("forward")
                with clock.phase("sample"):
                    out, extras = self._sample(
                        admitted, fb, views, ran, plan, return_logits=return_logits
                    )
                    if future is not None:  # last: nothing after it can fail the step
                        self.future.store(
                            fb.future_token_slots,
                            out.device_token_ids,
                            host.future_token_slots,
                            out.next_token_ids,
                        )
                    if out.accepted_lengths is not None:  # VERIFY: rejected drafts' slots freed
                        self._truncate(host, out.accepted_lengths)
                    if keep_rows:
                        self.pooled.release(host.released_req_pool_indices)
                        if extras is not None and admitted.outputs is not None:
                            finish(admitted.outputs, extras, self.pooled)
        except BaseException:
            self.pool.undo(write)
            if future is not None:
                self.future.undo(future)
            self.controls.undo(controls)
            raise
        if not keep_rows:
            self.pool.undo(write)
            self.controls.undo(controls)
        return ran, out

    def _truncate(self, host: ForwardBatch, accepted_lengths: torch.Tensor) -> None:
        assert host.extend_prefix_lens_cpu is not None
        rows = host.req_pool_indices.numpy().astype(np.int64)
        prefix = np.asarray(host.extend_prefix_lens_cpu, dtype=np.int64)
        self.pool.truncate(rows, prefix + accepted_lengths.numpy().astype(np.int64))

    def _sample(
        self,
        admitted: Admitted,
        fb: ForwardBatch,
        views: Mapping[str, torch.Tensor],
        ran: RunnerOutput,
        plan: SamplingPlan,
        *,
        return_logits: bool,
    ) -> tuple[ForwardOutput, Computed | None]:
        """The next tokens (and logprobs, and the extra outputs) from the step's logits,
        after the sampling controls: one host transfer, plus the logits themselves when
        asked."""
        self.hooks.check("sampler")
        host = admitted.batch
        assert fb.sampling is not None
        if host.forward_mode.is_verify():
            out = self.speculation.sample(ran.logits, host, fb, plan, self.sampler.generator)
            if return_logits:
                out.logits = to_host(ran.logits, "logits")
            return out, None
        extras = None
        if admitted.outputs is not None:
            ids = fb.input_ids
            if ids is not None and fb.future_refs:
                ids = resolve_future_tokens(ids, self.future.tokens)
            extras = compute(
                admitted.outputs,
                ran,
                self.runner.model,
                views,
                ids,
                fb.req_pool_indices,
                self.pooled,
            )
        logits, controls = self.controls.logits(
            ran.logits, admitted.controls, host, fb, views, self.pool.req_to_token
        )
        out, host_extras = self.sampler.sample(
            logits,
            plan,
            fb.sampling,
            fb.seq_lens,
            return_logprob=host.return_logprob,
            top_logprobs_num=host.top_logprobs_num,
            raw_logits=ran.logits,
            extra=None if extras is None else extras.tensors,
        )
        if extras is not None and admitted.outputs is not None:
            out.extras = assemble(admitted.outputs, host_extras)
        if controls is not None:
            out.stats.control_rows = controls.control_rows
        if return_logits:
            out.logits = to_host(logits, "logits")  # what sampling drew from
        return out, extras

    def _stage(
        self, admitted: Admitted, *, keep_rows: bool
    ) -> tuple[ForwardBatch, RowWrite, Mapping[str, torch.Tensor]]:
        """One staged host-to-device copy of the batch's device fields, its sampling
        parameters, its row-table cells and its controls (ops.h2d_staging); the row-table
        write from the staged cells; and, on rank 0 of a group, the step's broadcast."""
        host, cells = admitted.batch, admitted.write.cells
        views = self.staging.stage(
            host.staged_fields()
            + cells.staged_fields()
            + self.controls.staged_fields(admitted.controls)
            + ([] if admitted.outputs is None else admitted.outputs.staged_fields())
        )
        # IDLE too: it may release rows.
        write = self.pool.write_batch(
            host, device_cells=cells.from_views(views), plan=admitted.write
        )
        if self.leader is not None:  # every rank runs what rank 0 accepted
            try:
                step = self.future.resolved_for_workers(host)  # workers keep no future table
                self.leader.send(broadcast.Command(broadcast.STEP, step, keep_rows=keep_rows))
            except BaseException:
                self.pool.undo(write)
                raise
        return host.with_device_fields(views), write, views

    def run_shard(self, host: ForwardBatch, *, keep_rows: bool) -> None:
        """A worker rank: a step rank 0 admitted and broadcast (staging, row-table write,
        this rank's part of the model and its collectives; rank 0 samples)."""
        self.comm.settle()  # the previous step's collectives (done before rank 0 sent this one)
        fb, write, _ = self._stage(Admitted(host, self.pool.check_write(host)), keep_rows=keep_rows)
        try:
            self.runner.forward(fb)  # references resolved by rank 0
        except BaseException:
            self.pool.undo(write)
            raise
        if not keep_rows:
            self.pool.undo(write)
        self.comm.take_allreduce_ns()

    def _group(self) -> AbstractContextManager[object]:
        """Rank 0 of a group: no heartbeat between a step's broadcast and its collectives."""
        return self.leader.holding() if self.leader is not None else nullcontext()

    def _stats(
        self,
        host: ForwardBatch,
        ran: RunnerOutput,
        clock: StepClock,
        transfers: tuple[int, int, int],
    ) -> StepStats:
        d2h, h2d_syncs, h2d_copies = (
            now - then for now, then in zip(host_transfers.totals(), transfers, strict=True)
        )
        return StepStats(
            path=ran.path,
            batch_size=host.batch_size,
            padded_batch_size=ran.padded_batch_size,
            num_tokens=host.num_tokens,
            padded_num_tokens=ran.padded_num_tokens,
            timings_ns=clock.durations_ns,
            mode=MODE_NAMES[host.forward_mode],
            fill_registry=ran.fill_registry,
            fill_tensors=ran.fill_stats.tensors_copied,
            fill_bytes=ran.fill_stats.bytes_copied,
            fill_copy_calls=ran.fill_stats.copy_calls,
            graph_fallback=ran.graph_fallback,
            d2h_syncs=d2h,
            h2d_syncs=h2d_syncs,
            h2d_copies=h2d_copies,
            future_refs=host.future_refs,
            started_ns=clock.started_ns,
            allreduce_ns=self.comm.take_allreduce_ns(),
        )
