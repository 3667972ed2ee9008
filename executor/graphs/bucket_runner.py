"""What both graph runners share: bucketed capture, registry staging and the fallback rules.

A runner keeps one captured entry per bucket size (a batch size for full-graph DECODE, a token
count for piecewise EXTEND). Capture and replay stage their inputs through the same registry
`fill_from`, here in one place, so capture and replay cannot disagree. A subclass says how one
bucket is compiled (no device state: off the step lock) and captured, which size picks a
batch's bucket, and how a replay runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Generic, TypeVar

import torch

from attention.base import AttentionBackend
from executor.core.buckets import pad_to_bucket
from executor.core.forward_batch import ForwardBatch
from executor.core.runner_output import RunnerOutput
from executor.graphs.capture import CaptureReport, LockHold, capture_buckets
from executor.graphs.factory import GraphFactory
from executor.models.decoder_model import DecoderModel
from executor.parallel.agreement import agree_on_capture
from registry import BufferRegistry, FillStats

CapturedT = TypeVar("CapturedT")


class BucketGraphRunner(ABC, Generic[CapturedT]):
    kind: str  # decode | piecewise: the label of its captures and fallbacks
    registry: BufferRegistry  # built by the subclass, sized for its largest bucket

    def __init__(
        self,
        model: DecoderModel,
        attn_backend: AttentionBackend,
        *,
        device: torch.device,
        buckets: list[int],
        factory: GraphFactory,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.buckets = buckets
        self.factory = factory
        self.captured: dict[int, CapturedT] = {}
        self.report: CaptureReport | None = None
        self._hold: LockHold | None = None  # the step lock, during a background capture

    def capture(
        self, *, progress: bool = True, lock: AbstractContextManager[object] | None = None
    ) -> CaptureReport:
        """Capture every bucket, largest first; a failed bucket is left out (eager for it).
        With `lock`, the preparation of the buffers and each bucket's capture hold it (a
        background capture); the factory's (dynamo's first import, its limits) and each
        bucket's compile phase run without it."""
        self.factory.prepare(len(self.buckets))
        with lock or nullcontext():
            self._prepare_capture()
        self.captured.clear()
        self._hold = LockHold(lock) if lock is not None else None
        comm = self.model.comm
        if comm.enabled:
            # One real collective first: NCCL creates its communicator on the first one,
            # which must not happen inside a capture.
            comm.all_reduce_(torch.zeros(1, device=self.device))
        try:
            with comm.capture_runs() if comm.enabled else nullcontext():
                self.report = capture_buckets(
                    self.kind,
                    self.buckets,
                    self._capture_one,
                    self.factory,
                    compile_one=self._compile_one,
                    progress=progress,
                    lock=self._hold,
                    graphs_per_bucket=self.graphs_per_bucket(),
                    agree=partial(agree_on_capture, comm) if comm.enabled else None,
                    drop=lambda size: self.keep_only([s for s in self.captured if s != size]),
                )
        finally:
            self._hold = None
        return self.report

    def let_steps_in(self) -> None:
        """Between two graphs of a bucket in a background capture (not under tensor
        parallelism, whose ranks capture in step): a step waiting for the lock runs."""
        if self._hold is not None and not self.model.comm.enabled:
            self._hold.let_steps_in()

    def compile_only(self) -> dict[int, str]:
        """Every bucket's compile phase and nothing else (no capture, nothing kept): what
        the compile worker does, so that a capture elsewhere finds the compiled code in the
        caches. The buckets that failed, with the reason."""
        self._prepare_capture()
        self.factory.prepare(len(self.buckets))
        failed: dict[int, str] = {}
        with self.factory.capturing():
            for size in sorted(self.buckets, reverse=True):
                try:
                    self._compile_one(size)
                except Exception as e:  # the server's own capture fails it again, eagerly
                    failed[size] = f"{type(e).__name__}: {e}"
        return failed

    def keep_only(self, buckets: Sequence[int]) -> None:
        """Drop every captured bucket not in `buckets` (its batches then replay a larger
        bucket, or run eagerly); the dropped graphs are released."""
        keep = set(buckets)
        for size in [s for s in self.captured if s not in keep]:
            del self.captured[size]

    def graphs_per_bucket(self) -> int:
        """How many graphs one bucket captures (the start-up report counts them)."""
        return 1

    def _prepare_capture(self) -> None:
        """Runs once before the first bucket is captured (e.g. the backend's graph buffers)."""

    def _compile_one(self, size: int) -> None:
        """The compile phase of bucket `size`, without the step lock: it must not run the
        model on shared buffers nor write any. By default the compiled layer halves for
        `size` rows (nothing for the backends that do not compile)."""
        self.factory.compile_halves(size, self.kind)

    @abstractmethod
    def _capture_one(self, size: int) -> None:
        """Capture the bucket of `size` into `self.captured[size]`."""

    @abstractmethod
    def bucket_size(self, fb: ForwardBatch) -> int:
        """The size that picks `fb`'s bucket."""

    @abstractmethod
    def replay(self, fb: ForwardBatch) -> RunnerOutput:
        """Run `fb` on its bucket's captured graph(s); only after `fallback_reason` is None."""

    def fallback_reason(self, fb: ForwardBatch) -> str | None:
        """None if this batch can replay a captured bucket, else why not (a metric label)."""
        if self.factory.poisoned is not None:
            return "capture_poisoned"
        if fb.input_embeds is not None:
            return "input_embeds"
        size = self.bucket_size(fb)
        if pad_to_bucket(size, self.buckets) is None:
            return "batch_too_large"
        if self.replay_size(fb) is None:
            return "capture_failed"
        return None

    def replay_size(self, fb: ForwardBatch) -> int | None:
        """The smallest captured bucket that holds `fb` (a larger one when the smallest
        fitting bucket failed to capture), or None."""
        return pad_to_bucket(self.bucket_size(fb), sorted(self.captured))

    def _stage(
        self,
        fb: ForwardBatch,
        *,
        raw_bs: int,
        padded_bs: int,
        raw_num_tokens: int,
        padded_num_tokens: int,
    ) -> tuple[ForwardBatch, FillStats]:
        """Fill the registry from `fb` (padding tails by policy) and return the batch view the
        graph reads, with what the fill copied."""
        stats = self.registry.fill_from(
            fb,
            raw_bs=raw_bs,
            padded_bs=padded_bs,
            raw_num_tokens=raw_num_tokens,
            padded_num_tokens=padded_num_tokens,
        )
        # extract_buffer's view, through ForwardBatch's own (cheaper) replace
        views = self.registry.buffer_views(
            padded_bs=padded_bs, padded_num_tokens=padded_num_tokens, forward_batch_template=fb
        )
        return fb.replace(batch_size=padded_bs, **views), stats
