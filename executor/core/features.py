"""The step's feature protocol: how a feature takes part in every step.

A feature owns some state the steps change (the row table, the future-token table, the rows'
sampling controls, the pooled hidden sums, ...) or some work a step does (VERIFY's drafts and
acceptance, the extra outputs). It is one long-lived object registered in the executor's one
feature list (`ModelExecutor`); `Step` never names it. For each batch it is asked once, at
admission, what it will do this step:

    work = feature.admit(sb)    # a FeatureStep, or None: nothing this step

`admit` reads host data only: the completed batch (`sb.host`) and the feature's host state as
the steps before left it. With the pipeline, the step before may still be on the device, but
its `apply` has run, so its host-side effects are visible; what only its `commit` changes is
not (see `settles_at_read`). `admit` refuses with `BatchValidationError` (or
`BatchTooLargeError`) naming the field and the rule, and changes nothing.

The returned `FeatureStep` is the feature's part of this step: its plan, then its staged part
and what its undo needs. It travels in `StepBatch.work` and takes part in the rest of the step
through these hooks, each called on every part in feature-list order (all optional: the
defaults do nothing):

| hook | when | what it may do |
|---|---|---|
| `staged_fields()` | stage | name the host tensors it needs on the device; they go in the step's one upload |
| `apply(sb, staged)` | stage, after the upload | write the feature's state from its staged views (`staged`: exactly its `staged_fields`, in order) and the plan: host mirror and device tensors; keep what `undo` needs. The next batch's admission sees what it wrote. |
| `launch(sb)` | launch, before the forward | enqueue device work that reads what earlier steps' `commit` wrote (the future-token table), or replace fields of `sb.device` (VERIFY's drafted input ids) |
| `logits(sb, logits)` | launch, after the forward | return the logits sampling draws from (a new tensor: `sb.ran.logits` stays the model's, for logprobs); may wait on the host (a deferred vocab mask) |
| `draw(sb, logits)` | launch | a `Draw` that samples this step instead of the sampler (VERIFY; at most one part per step), or None |
| `sampled(sb, ids)` | launch, after the draw | enqueue device writes of the sampled ids (`ids`: the draw's device ids) that the next step, launched behind this one, reads (the future-token store); keep what `undo` needs to restore them |
| `outputs(sb)` | launch, after the draw | device tensors to bring back in the step's one device-to-host copy |
| `commit(sb, out, host)` | read, after the copy | the step's last acts, which must not fail: host changes that depend on the results (VERIFY's truncation, the future tokens' host mirror), and its part of the answer `out` from `host` (its `outputs`' host copies, in order) |
| `undo(sb)` | a failure after `apply` | restore exactly the state before `apply`, host and device |

Order and failure: `undo` runs in reverse feature order, on the parts whose `apply` ran, when
anything fails before the step's read finished (staging, launch, read), and when the step
that ran before it fails while this one was already staged (the pipeline: nothing prepared
for a batch survives the failure of the step before it). A refused batch never reached
`apply`. A retried `batch_id` is answered before admission, so nothing applies twice.

`settles_at_read`: True when `commit` changes host state a later admission reads (VERIFY
truncates rows to what was accepted): the next batch is then admitted only after this one is
read. Everything else a feature changes must happen in `apply`, so the next batch can be
admitted while this one runs.

Device order: every device write is enqueued on the one stream in step order, so `apply` of
step N+1 (enqueued while N runs) lands after N's kernels. The pipeline launches N+1 before it
reads N (behind N on the stream), so N's results reach N+1 only through device writes N makes
at launch (`sampled`), never through N's `commit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ops.h2d_staging import StagedField

if TYPE_CHECKING:
    from executor.core.outputs import ForwardOutput, StepStats
    from executor.core.step_batch import StepBatch


class Draw(Protocol):
    """A step's sampled results, still on the device: what the step copies to the host in its
    one transfer, and how the host copies become the answer."""

    @property
    def ids(self) -> torch.Tensor:
        """The ids drawn per request, on the device (the future-token table stores them)."""
        ...

    @property
    def device(self) -> list[torch.Tensor]:
        """The device tensors to copy to the host (first in the step's one transfer)."""
        ...

    def output(self, host: list[torch.Tensor], stats: StepStats) -> ForwardOutput:
        """The answer from the host copies of `device` (in order); `stats` is the step's."""
        ...


class FeatureStep:
    """One feature's part of one step. Subclasses keep their plan, staged part and undo
    handle as typed fields and override the hooks they use (see the module's table)."""

    settles_at_read = False

    def staged_fields(self) -> list[StagedField]:
        return []

    def apply(self, sb: StepBatch, staged: Sequence[torch.Tensor]) -> None:
        return None

    def launch(self, sb: StepBatch) -> None:
        return None

    def logits(self, sb: StepBatch, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def draw(self, sb: StepBatch, logits: torch.Tensor) -> Draw | None:
        return None

    def sampled(self, sb: StepBatch, ids: torch.Tensor) -> None:
        return None

    def outputs(self, sb: StepBatch) -> list[torch.Tensor]:
        return []

    def commit(self, sb: StepBatch, out: ForwardOutput, host: list[torch.Tensor]) -> None:
        return None

    def undo(self, sb: StepBatch) -> None:
        return None


class StepFeature(Protocol):
    """A feature of the step: registered once, asked at every admission."""

    def admit(self, sb: StepBatch) -> FeatureStep | None:
        """This step's part (None: nothing to do); host data only; refuses with
        BatchValidationError and changes nothing."""
        ...
