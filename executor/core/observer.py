"""What the executor reports while it runs, beyond each step's `StepStats`.

The executor calls these hooks; the server's metrics (:class:`executor.observability.metrics.ExecutorMetrics`)
implement them. In-process users get :class:`NullObserver`, which does nothing. The hooks
run on the device thread: they must be quick and must not raise.
"""

from __future__ import annotations

from typing import Protocol


class ExecutorObserver(Protocol):
    """Events of the graph runners (captures, fallbacks to eager)."""

    def on_graph_capture(self, kind: str, seconds: float, ok: bool) -> None:
        """A graph capture pass finished: `kind` is the runner's (`decode` for full graphs,
        `piecewise` for EXTEND pieces); `seconds` its wall time; `ok` False if it failed."""
        ...

    def on_graph_fallback(self, kind: str, reason: str) -> None:
        """A batch ran eagerly although graph mode `kind` is on; `reason` is a short fixed
        token (e.g. `batch_too_large`, `not_captured`), never free text: it is a label."""
        ...

    def on_graph_capture_disabled(self, reason: str) -> None:
        """A poisoned capture stopped graph capture for good; graph paths run eagerly.
        `reason` is free text (for logs and GetInfo), never a label."""
        ...


class NullObserver:
    """Ignores every event (in-process use without metrics)."""

    def on_graph_capture(self, kind: str, seconds: float, ok: bool) -> None:
        pass

    def on_graph_fallback(self, kind: str, reason: str) -> None:
        pass

    def on_graph_capture_disabled(self, reason: str) -> None:
        pass
