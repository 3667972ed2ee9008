"""`StepBatch`: the one object a batch is after admission, through staging, launch and read.

Admission (`Step.admit`) turns a decoded `ForwardBatch` into a StepBatch: the completed host
batch, the sampling plan, and each feature's part of the step (`work`, `executor.core.features`:
the row table's checked write, the controls' rows, the extra outputs' plan, ...). Staging adds
the device batch (`device`: the staged copies of the host batch's device fields) and each
part's typed staged views; launch adds the model's output (`ran`) and the step in flight
(`flight`: its draw and the copy of its results on the way to the host). Nothing else travels
beside it: no string-keyed views, no separate undo handles (each part keeps its own).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from executor.core.clock import DeviceEvent, StepClock
from executor.core.features import Draw, FeatureStep
from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput
from executor.core.runner_output import RunnerOutput
from ops.h2d_staging import StagedField
from ops.host_transfer import HostCopy
from ops.sampling import SamplingPlan


@dataclass(eq=False)
class InFlight:
    """A launched step: its draw, the copy of its results on the way to the host, and when
    the device had it."""

    draw: Draw
    copy: HostCopy
    parts: list[int]  # how many of the copies each part's `outputs` added, in `work` order
    logits: torch.Tensor | None  # what sampling drew from, when the caller asked for logits
    launched_ns: int  # perf_counter_ns when the launch began
    ready_ns: int = 0  # the stand-in accelerator: when its results are readable
    idle_ns: int = 0  # the stand-in: how long it sat idle before this launch (< 0: queued)
    start: DeviceEvent | None = None  # CUDA: recorded before the launch's first kernel
    end: DeviceEvent | None = None  # and after the copy of its results


@dataclass(eq=False)
class StepBatch:
    host: ForwardBatch  # completed (derived fields), host tensors
    clock: StepClock
    return_logits: bool = False  # in-process callers: the logits sampling drew from
    keep_rows: bool = True  # False (warm-up): everything applied is undone after the read
    sampling: SamplingPlan | None = None  # decided on the host from the sampling parameters
    work: list[FeatureStep] = field(default_factory=list)  # the features' parts, in order
    started_ns: int = field(default_factory=time.perf_counter_ns)  # admission began
    started_wall_ns: int = field(default_factory=time.time_ns)
    device: ForwardBatch | None = None  # after staging: the device fields are staged views
    applied: int = 0  # parts whose `apply` ran (undone in reverse on a failure)
    ran: RunnerOutput | None = None  # after launch
    flight: InFlight | None = None
    # This step's own host<->device transfers, summed over its phases: (device-to-host,
    # synchronizing uploads, staged copies).
    transfers: list[int] = field(default_factory=lambda: [0, 0, 0])
    host_gap_ns: int = 0  # the device's idle time before this step while it was queued
    device_busy_ns: int = 0  # the device's time on this step
    _staged_sizes: list[int] = field(default_factory=list)  # staged fields: batch, each part
    # The batch staged while this one ran (the pipeline): undone first if this one fails.
    staged_after: StepBatch | None = None

    # --- the parts' hooks, in the protocol's order (`executor.core.features`) ---------------
    def staged_fields(self) -> list[StagedField]:
        """The batch's device fields, then every part's, for the step's one upload."""
        groups = [self.host.staged_fields(), *(part.staged_fields() for part in self.work)]
        self._staged_sizes = [len(g) for g in groups]
        return list(chain.from_iterable(groups))

    def apply(self, views: Sequence[torch.Tensor]) -> None:
        """The device batch from its views, then each part applies its own (in order)."""
        sizes = self._staged_sizes
        at = sizes[0]
        self.device = self.host.on_device(views[:at])
        for part, n in zip(self.work, sizes[1:], strict=True):
            part.apply(self, views[at : at + n])
            self.applied += 1
            at += n

    def undo(self) -> None:
        """Every applied part, in reverse: the state before the step (the batch staged after
        it first: nothing prepared for the next batch survives this one's failure)."""
        if self.staged_after is not None:
            self.staged_after.undo()
            self.staged_after = None
        while self.applied:
            self.applied -= 1
            self.work[self.applied].undo(self)

    def launch_parts(self) -> None:
        for part in self.work:
            part.launch(self)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        for part in self.work:
            logits = part.logits(self, logits)
        return logits

    def draw(self, logits: torch.Tensor) -> Draw | None:
        """A part's draw (VERIFY), or None: the sampler draws."""
        for part in self.work:
            draw = part.draw(self, logits)
            if draw is not None:
                return draw
        return None

    def sampled(self, ids: torch.Tensor) -> None:
        for part in self.work:
            part.sampled(self, ids)

    def outputs(self) -> list[list[torch.Tensor]]:
        return [part.outputs(self) for part in self.work]

    def commit(self, out: ForwardOutput, host: list[torch.Tensor], parts: list[int]) -> None:
        """Each part's last acts; `host`: the parts' outputs' host copies (`parts` each)."""
        at = 0
        for part, n in zip(self.work, parts, strict=True):
            part.commit(self, out, host[at : at + n])
            at += n

    @property
    def awaits_mask(self) -> bool:
        """Its deferred vocab mask has not come: its launch waits for it, and the mask may
        follow the answer of the step before (so that answer must not wait for this launch)."""
        mask = self.host.deferred_mask
        return mask is not None and not mask.settled

    @property
    def admits_next_early(self) -> bool:
        """Whether the next batch may be admitted while this one is on the device (no part
        changes host state at its read that admission reads)."""
        return not any(w.settles_at_read for w in self.work)

    def staged_device(self) -> ForwardBatch:
        assert self.device is not None, "staged"
        return self.device

    def launched(self) -> InFlight:
        assert self.flight is not None, "launched"
        return self.flight
