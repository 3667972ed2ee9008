"""The capture loop both graph runners share: largest bucket first, one failure per bucket."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import structlog
from tqdm import tqdm

from executor.errors import StartupCancelled
from executor.graphs.graph import GraphCapturePoisoned, GraphFactory

log = structlog.get_logger(__name__)


@dataclass
class CaptureReport:
    """What one capture pass did: per-bucket failures keep their reason."""

    kind: str  # decode | piecewise
    captured: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    memory_bytes: int = 0
    graphs_per_bucket: int = 1  # piecewise: layers + 1 pieces per token count

    @property
    def graphs(self) -> int:
        """Graphs captured (buckets x graphs per bucket)."""
        return len(self.captured) * self.graphs_per_bucket

    # Set when a capture poisoned the factory (this pass's or an earlier one): nothing more
    # is captured or replayed, graph mode runs eagerly with this reason.
    poisoned: str | None = None


def capture_buckets(
    kind: str,
    buckets: Sequence[int],
    capture_one: Callable[[int], None],
    factory: GraphFactory,
    *,
    progress: bool = True,
    lock: AbstractContextManager[object] | None = None,
    graphs_per_bucket: int = 1,
) -> CaptureReport:
    """Capture every bucket, largest first. A bucket whose capture fails cleanly (an
    out-of-memory error, a compile error) is logged with its reason and left out (its
    batches run eagerly or on a larger bucket); the others are still captured. A poisoned
    capture (GraphCapturePoisoned) poisons the factory and ends the pass: no later bucket,
    and no later pass, is captured.

    With `lock`, each bucket is captured holding it (a background capture: the steps that
    take it run between two buckets).

    Raises StartupCancelled before the next bucket once `factory.stop` is set."""
    report = CaptureReport(kind, graphs_per_bucket=graphs_per_bucket)
    if factory.poisoned is not None:
        report.poisoned = factory.poisoned
        log.warning("graph capture skipped", kind=kind, poisoned=factory.poisoned)
        return report
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
            try:
                with lock or nullcontext():
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
                break
            except Exception as e:
                report.failed[size] = f"{type(e).__name__}: {e}"
                log.warning("graph capture failed", kind=kind, size=size, error=report.failed[size])
                continue
            report.captured.append(size)
            log.info(
                "graph captured", kind=kind, size=size, seconds=round(time.perf_counter() - t, 4)
            )
    report.seconds = time.perf_counter() - t0
    report.memory_bytes = factory.memory_bytes() - mem_before
    log.info(
        "graphs captured",
        kind=kind,
        captured=len(report.captured),
        graphs=report.graphs,
        failed=len(report.failed),
        seconds=round(report.seconds, 3),
        memory_mib=round(report.memory_bytes / 2**20, 1),
    )
    return report
