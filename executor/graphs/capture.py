"""The capture loop both graph runners share: largest bucket first, one failure per bucket.

Each bucket is captured in two phases: its compile (`compile_one`: no device state, so it runs
without the step lock: inductor's work, or the load of a saved compile) and its capture
(`capture_one`: warm-up runs, checks, recording), which holds the lock. A background capture
(`lock` given) therefore blocks steps only for the runs, not for the compile; a bucket of
whole-step compiled graphs lets a waiting step run between two of its graphs
(`LockHold.let_steps_in`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import structlog
from tqdm import tqdm

from executor.core.errors import StartupCancelled
from executor.graphs.factory import GraphFactory
from executor.graphs.graph import GraphCapturePoisoned
from executor.parallel.agreement import CaptureOutcome, GroupOutcome

log = structlog.get_logger(__name__)

# `LockHold.let_steps_in`'s pause with the lock let go: the lock is not fair (this thread would
# take it again at once); in this time a step blocked on it wakes and takes it.
LET_IN_S = 0.005


@dataclass
class CaptureReport:
    """What one capture pass did: per-bucket failures keep their reason."""

    kind: str  # decode | piecewise
    captured: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    # Under the step lock (a background capture): the longest hold, and in all.
    held_max_seconds: float = 0.0
    held_seconds: float = 0.0
    memory_bytes: int = 0
    graphs_per_bucket: int = 1  # piecewise: layers + 1 pieces per token count

    @property
    def graphs(self) -> int:
        """Graphs captured (buckets x graphs per bucket)."""
        return len(self.captured) * self.graphs_per_bucket

    # Set when a capture poisoned the factory (this pass's or an earlier one): nothing more
    # is captured or replayed, graph mode runs eagerly with this reason.
    poisoned: str | None = None


class LockHold:
    """The step lock as a capture pass holds it: each hold timed (the report's `held_*`), and
    the thread's profile hook (an `IdleGate`'s) off meanwhile: no step runs then to wait for,
    and the capture's runs do not pay for the hook."""

    def __init__(self, lock: AbstractContextManager[Any]) -> None:
        self._lock = lock
        self._since = 0.0
        self._hook: Any = None
        self.longest = 0.0
        self.total = 0.0

    def __enter__(self) -> None:
        self._lock.__enter__()  # (a hook on waits for the steps first)
        self._hook = sys.getprofile()
        sys.setprofile(None)
        self._since = time.perf_counter()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        held = time.perf_counter() - self._since
        self.total += held
        self.longest = max(self.longest, held)
        try:
            return self._lock.__exit__(kind, exc, tb)
        finally:
            sys.setprofile(self._hook)  # (once the lock is let go)

    def let_steps_in(self) -> None:
        """Between two graphs of a bucket: the lock let go for `LET_IN_S`, so a step that
        waits for it runs, and taken again (after that step)."""
        self.__exit__(None, None, None)
        time.sleep(LET_IN_S)
        self.__enter__()


def capture_buckets(
    kind: str,
    buckets: Sequence[int],
    capture_one: Callable[[int], None],
    factory: GraphFactory,
    *,
    compile_one: Callable[[int], None] | None = None,
    progress: bool = True,
    lock: AbstractContextManager[object] | None = None,
    graphs_per_bucket: int = 1,
    agree: Callable[[CaptureOutcome], GroupOutcome] | None = None,
    drop: Callable[[int], None] | None = None,
) -> CaptureReport:
    """Capture every bucket, largest first. A bucket whose capture fails cleanly (an
    out-of-memory error, a compile error) is logged with its reason and left out (its
    batches run eagerly or on a larger bucket); the others are still captured. A poisoned
    capture (GraphCapturePoisoned) poisons the factory and ends the pass: no later bucket,
    and no later pass, is captured.

    `compile_one(size)` runs first, without `lock`: a bucket's compile phase, which touches
    no device state. With `lock`, each bucket's `capture_one` holds it (a background capture:
    the steps that take it run during the compiles and between two buckets; a `LockHold`
    given as `lock` may be let go between two graphs of a bucket).

    With `agree` (tensor parallelism: `executor.parallel.agreement.agree_on_capture` on
    this rank's group), every bucket's outcome is the group's: a bucket captured here but
    failed on another rank is dropped here too (`drop(size)`), and a poisoned capture on
    any rank poisons this factory, so every rank serves the same buckets.

    Raises StartupCancelled before the next bucket once `factory.stop` is set."""
    report = CaptureReport(kind, graphs_per_bucket=graphs_per_bucket)
    if factory.poisoned is not None:
        report.poisoned = factory.poisoned
        log.warning("graph capture skipped", kind=kind, poisoned=factory.poisoned)
        return report
    hold = lock if lock is None or isinstance(lock, LockHold) else LockHold(lock)
    mem_before = factory.memory_bytes()
    t0 = time.perf_counter()
    with factory.capturing():
        for size in tqdm(
            sorted(buckets, reverse=True),
            desc=f"capturing {kind} graphs",
            disable=not progress,
            leave=False,
        ):
            if factory.stop.is_set():
                log.info("graph capture stopped", kind=kind, before_size=size)
                raise StartupCancelled(f"{kind} graph capture stopped before bucket {size}")
            t = time.perf_counter()
            outcome = CaptureOutcome.CAPTURED
            try:
                if compile_one is not None:
                    compile_one(size)
                before = hold.total if hold is not None else 0.0
                with hold or nullcontext():
                    capture_one(size)
            except GraphCapturePoisoned as e:
                report.failed[size] = report.poisoned = f"{type(e).__name__}: {e}"
                factory.poison(report.poisoned)
                log.error(
                    "graph capture poisoned: no more captures, graph paths run eagerly",
                    kind=kind,
                    size=size,
                    error=report.poisoned,
                )
                outcome = CaptureOutcome.POISONED
            except Exception as e:
                report.failed[size] = f"{type(e).__name__}: {e}"
                log.warning(
                    "graph capture failed",
                    kind=kind,
                    size=size,
                    error=report.failed[size],
                    exc_info=True,
                )
                outcome = CaptureOutcome.FAILED
            if agree is not None:
                outcome = _follow_group(kind, size, outcome, agree, drop, factory, report)
            if outcome is CaptureOutcome.POISONED:
                break
            if outcome is CaptureOutcome.FAILED:
                continue
            report.captured.append(size)
            log.info(
                "graph captured",
                kind=kind,
                size=size,
                seconds=round(time.perf_counter() - t, 4),
                held_seconds=round(hold.total - before, 4) if hold is not None else None,
            )
    report.seconds = time.perf_counter() - t0
    if hold is not None:
        report.held_seconds, report.held_max_seconds = hold.total, hold.longest
    report.memory_bytes = factory.memory_bytes() - mem_before
    log.info(
        "graphs captured",
        kind=kind,
        captured=len(report.captured),
        graphs=report.graphs,
        failed=len(report.failed),
        seconds=round(report.seconds, 3),
        held_max_seconds=round(report.held_max_seconds, 4),
        memory_mib=round(report.memory_bytes / 2**20, 1),
    )
    return report


def _follow_group(
    kind: str,
    size: int,
    mine: CaptureOutcome,
    agree: Callable[[CaptureOutcome], GroupOutcome],
    drop: Callable[[int], None] | None,
    factory: GraphFactory,
    report: CaptureReport,
) -> CaptureOutcome:
    """This rank takes the group's outcome of bucket `size` (the worst of the ranks')."""
    group = agree(mine)
    if group.outcome <= mine:
        return mine
    reason = group.reason(kind, size)
    log.warning("graph bucket dropped: the group's outcome", kind=kind, size=size, reason=reason)
    if drop is not None:
        drop(size)
    report.failed[size] = reason
    if group.outcome is CaptureOutcome.POISONED:
        report.poisoned = reason
        factory.poison(reason)
    return group.outcome
