"""`StepClock`: each phase of one step timed once, where it runs.

`with clock.phase("forward"):` records the phase's wall-clock start (`time.time_ns`, for
trace spans) and its duration (`perf_counter_ns`). A phase is recorded once, on success;
`record` takes a phase measured elsewhere (the device worker's queue wait). `StepStats`
carries the two dicts as they are; nothing adds to them afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType


@dataclass
class StepClock:
    durations_ns: dict[str, int] = field(default_factory=dict)
    started_ns: dict[str, int] = field(default_factory=dict)  # wall clock
    # Where the step is now, for a watchdog on another thread: the phase entered last, or
    # "after <phase>" once it ended ("" before the first).
    current: str = ""

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def record(self, name: str, started_ns: int, duration_ns: int) -> None:
        if name in self.durations_ns:
            raise ValueError(f"phase {name!r} was already recorded for this step")
        self.started_ns[name] = started_ns
        self.durations_ns[name] = duration_ns


class _Phase:
    """One `clock.phase(name)` block (a class, not a generator: five of them run per step)."""

    __slots__ = ("_clock", "_name", "_t0", "_wall")

    def __init__(self, clock: StepClock, name: str) -> None:
        self._clock = clock
        self._name = name

    def __enter__(self) -> None:
        self._clock.current = self._name
        self._wall = time.time_ns()
        self._t0 = time.perf_counter_ns()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._clock.current = f"after {self._name}"
        if exc_type is None:  # recorded on success only
            self._clock.record(self._name, self._wall, time.perf_counter_ns() - self._t0)
