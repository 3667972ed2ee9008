"""`StepClock`: each phase of one step timed once, where it runs.

`with clock.phase("forward"):` records the phase's wall-clock start (`time.time_ns`, for
trace spans) and its duration. A phase is recorded once, on success; `record` takes a phase
measured elsewhere (the device worker's queue wait). `StepStats` carries the two dicts as
they are; nothing adds to them afterwards.

Durations are host time (`perf_counter_ns`), except the device phases (`forward`,
`sample`) of a step on CUDA (`use_device_events`): there the host only enqueues the
forward's kernels and then waits for all of them in the sample's device-to-host read, so a
host timer credits the GPU's forward to "sample". Those two phases are timed by CUDA events
recorded on the stream at their start and end, and read (`durations_ns`) once the step is
over: by then the step's one device-to-host read has waited for everything up to it, and
reading waits for nothing but the few kernels the sample phase enqueues after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import torch

DEVICE_PHASES = frozenset({"forward", "sample"})
_AFTER = {p: f"after {p}" for p in ("total", "validate", "stage", "forward", "sample")}


class DeviceEvent(Protocol):
    """What `torch.cuda.Event(enable_timing=True)` offers the clock."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: DeviceEvent) -> float: ...  # milliseconds


def cuda_timing_event() -> DeviceEvent:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[return-value]


@dataclass
class _DevicePhase:
    name: str
    started_ns: int  # wall clock
    start: DeviceEvent
    end: DeviceEvent


@dataclass
class StepClock:
    started_ns: dict[str, int] = field(default_factory=dict)  # wall clock
    # Makes the events of the device phases; None: every phase on the host clock (CPU).
    events: Callable[[], DeviceEvent] | None = None
    queued_ns: int = 0  # perf_counter_ns when the batch was queued (0: it was not)
    _durations: dict[str, int] = field(default_factory=dict)
    _device: list[_DevicePhase] = field(default_factory=list)

    def use_device_events(self, device: torch.device) -> None:
        """Time the device phases with CUDA events when the step runs on CUDA."""
        self.events = cuda_timing_event if device.type == "cuda" else None

    @property
    def durations_ns(self) -> dict[str, int]:
        """Each recorded phase's duration; the device phases' events are read here."""
        while self._device:
            p = self._device.pop(0)
            p.end.synchronize()  # done already, but for the sample's last kernels
            ms = p.start.elapsed_time(p.end)
            self._durations[p.name] = round(ms * 1_000_000)
        return self._durations

    # Where the step is now, for a watchdog on another thread: the phase entered last, or
    # "after <phase>" once it ended ("" before the first).
    current: str = ""

    def phase(self, name: str) -> _Phase:
        on_device = self.events is not None and name in DEVICE_PHASES
        return _Phase(self, name, on_device)

    def _check_new(self, name: str) -> None:
        if name in self._durations or (self._device and any(p.name == name for p in self._device)):
            raise ValueError(f"phase {name!r} was already recorded for this step")

    def record(self, name: str, started_ns: int, duration_ns: int) -> None:
        self._check_new(name)
        self.started_ns[name] = started_ns
        self._durations[name] = duration_ns

    def _record_device(
        self, name: str, started_ns: int, start: DeviceEvent, end: DeviceEvent
    ) -> None:
        self._check_new(name)
        self.started_ns[name] = started_ns
        self._device.append(_DevicePhase(name, started_ns, start, end))


class _Phase:
    """One `clock.phase(name)` block (a class, not a generator: five of them run per step)."""

    __slots__ = ("_clock", "_name", "_on_device", "_start", "_t0", "_wall")

    def __init__(self, clock: StepClock, name: str, on_device: bool) -> None:
        self._clock = clock
        self._name = name
        self._on_device = on_device

    def __enter__(self) -> None:
        self._clock.current = self._name
        self._wall = time.time_ns()
        if self._on_device:
            assert self._clock.events is not None
            self._start = self._clock.events()
            self._start.record()
        self._t0 = time.perf_counter_ns()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._clock.current = _AFTER.get(self._name) or f"after {self._name}"
        if exc_type is not None:  # recorded on success only
            return
        if self._on_device:
            assert self._clock.events is not None
            end = self._clock.events()
            end.record()
            self._clock._record_device(self._name, self._wall, self._start, end)
        else:
            self._clock.record(self._name, self._wall, time.perf_counter_ns() - self._t0)
