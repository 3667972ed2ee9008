"""`StepClock`: each phase of one step timed once, where it runs.

`with clock.phase("forward"):` records the phase's wall-clock start (`time.time_ns`, for
trace spans) and its duration (`perf_counter_ns`). A phase is recorded once, on success;
`record` takes a phase measured elsewhere (the device worker's queue wait). `StepStats`
carries the two dicts as they are; nothing adds to them afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StepClock:
    durations_ns: dict[str, int] = field(default_factory=dict)
    started_ns: dict[str, int] = field(default_factory=dict)  # wall clock

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall = time.time_ns()
        t0 = time.perf_counter_ns()
        yield
        self.record(name, wall, time.perf_counter_ns() - t0)

    def record(self, name: str, started_ns: int, duration_ns: int) -> None:
        if name in self.durations_ns:
            raise ValueError(f"phase {name!r} was already recorded for this step")
        self.started_ns[name] = started_ns
        self.durations_ns[name] = duration_ns
