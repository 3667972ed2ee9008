"""Ranks agree on each captured graph bucket before serving it: `agree_on_capture`.

Each rank captures its buckets on its own: one may lose a bucket (out of memory) or have its
capture poisoned where another did not. A rank replaying a bucket that another rank runs
eagerly (or on a larger bucket) issues all-reduces of another size, and the group hangs; and
since a capture runs the model's collectives, a rank that skipped a bucket would meet the
next bucket's collectives against the others' current ones. So after every bucket the ranks
all-gather its outcome and take the worst: a bucket any rank failed is dropped on every
rank, a poisoned capture on any rank poisons every rank's (no more captures; graph paths
run eagerly everywhere), and the loop stays in step.

NOTE: this keeps the ranks in step when a bucket fails before its first collective or on
every rank alike (the common cases: an allocation before the model runs, a capture-rule
violation). A failure in the middle of a bucket, after some of its collectives ran, leaves
the ranks inside different collectives; that surfaces as `TpGroupError` (gloo: a size
mismatch; NCCL: the bounded wait), never as ranks serving different bucket sets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from executor.parallel.comm import TpComm


class CaptureOutcome(enum.IntEnum):
    """One bucket's capture on one rank, worst last (the group takes the maximum)."""

    CAPTURED = 0
    FAILED = 1  # this bucket only (out of memory, a compile error)
    POISONED = 2  # no further capture or replay on this factory


@dataclass(frozen=True)
class GroupOutcome:
    """What the group decided for one bucket, and which ranks decided it."""

    outcome: CaptureOutcome
    ranks: list[int]  # the ranks whose own outcome was `outcome` (empty when CAPTURED)

    def reason(self, kind: str, size: int) -> str:
        what = "poisoned" if self.outcome is CaptureOutcome.POISONED else "failed"
        return f"{kind} bucket {size}: capture {what} on tp rank(s) {self.ranks}"


def agree_on_capture(comm: TpComm, mine: CaptureOutcome) -> GroupOutcome:
    """The group's outcome of the bucket every rank just tried: the worst of the ranks'.
    One collective on the CPU group; every rank calls it after every bucket, in the same
    order. A failed collective raises `TpGroupError`."""
    rows = comm.all_gather_host(torch.tensor([int(mine)], dtype=torch.int8))
    outcomes = [CaptureOutcome(int(row[0])) for row in rows]
    worst = max(outcomes)
    ranks = [r for r, o in enumerate(outcomes) if o is worst] if worst else []
    return GroupOutcome(worst, ranks)
