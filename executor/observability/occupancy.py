"""`model_executor_forward_occupancy`: the device's busy time over its time with work queued,
in a sliding window, read at scrape time.

Each step reports the device's time on it and the host gap before it (the device idle while
the step was queued: `executor.step.timeline`). Over the steps that ended in the last
`window_s` seconds, occupancy = busy / (busy + gap): 1 when the device never waited for the
host with a batch queued, near D / (D + host work) when every step waits for its own
admission and staging. Time with nothing queued counts on neither side (that is the
scheduler's, not the executor's). 1 when no step ended in the window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NAME = "model_executor_forward_occupancy"
WINDOW_S = 10.0


class Occupancy(Collector):
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int, int]] = deque()  # (ended, busy_ns, gap_ns)
        self._busy = 0
        self._gap = 0

    def record(self, busy_ns: int, gap_ns: int, now: float | None = None) -> None:
        """One step ended (the device thread)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._steps.append((now, busy_ns, gap_ns))
            self._busy += busy_ns
            self._gap += gap_ns
            self._expire(now)

    def value(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            total = self._busy + self._gap
            return self._busy / total if total else 1.0

    def _expire(self, now: float) -> None:
        steps, cutoff = self._steps, now - self.window_s
        while steps and steps[0][0] < cutoff:
            _, busy, gap = steps.popleft()
            self._busy -= busy
            self._gap -= gap

    def describe(self) -> Iterator[Metric]:
        yield self._family(None)

    def collect(self) -> Iterator[Metric]:
        yield self._family(self.value())

    def _family(self, value: float | None) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(
            NAME,
            f"Device-busy time over device time with a batch queued (busy plus the host gap "
            f"before each step), over the steps of the last {self.window_s:g} s; 1 when none "
            "ended in it.",
        )
        if value is not None:
            gauge.add_metric([], value)
        return gauge
