"""`DeviceTimeline`: when the device had each step; the host gap before it, its busy time.

The device thread tells it each step's launch and read. What it measures, per step:

- busy: the device's time on the step: between CUDA events recorded before the launch's
  first kernel and after the copy of its results (CUDA); the stand-in's D (`simulated_step_ms`:
  the step's results are readable D ms after its launch, or D ms after the step before it is
  done when it was launched behind that one);
  on a CPU device, whose forward runs on the host, from the launch to the end of the read.
- the host gap: how long the device sat idle before the step's launch while the step was
  queued: launch - max(when the device was free, when the batch was queued). On CUDA the idle
  time is measured on the device (the previous step's end event to this one's start).

busy / (busy + host gap) over a window is the device's occupancy while work is queued
(`model_executor_forward_occupancy`); the gaps add up to `model_executor_device_idle_seconds_total`.
On a CPU device the gap holds each step's admission and staging (the forward is
synchronous); pipelined, it holds what the host could not hide behind the step before.
"""

from __future__ import annotations

import time

import torch

from executor.core.clock import DeviceEvent, cuda_timing_event
from executor.core.step_batch import InFlight, StepBatch

POLL_S = 0.0002  # CUDA: how often a host waiting for other work checks a step's results


class DeviceTimeline:
    def __init__(self, device: torch.device, simulated_step_ms: float) -> None:
        self.step_ns = round(simulated_step_ms * 1_000_000)
        self.cuda = device.type == "cuda" and not self.step_ns
        self.free_ns = 0  # perf_counter_ns: the device finished its last step (not CUDA)
        self.last_end: DeviceEvent | None = None  # CUDA: the last step's end event

    @property
    def asynchronous(self) -> bool:
        """Whether the host is free while a launched step runs (CUDA, the stand-in)."""
        return self.cuda or self.step_ns > 0

    def launching(self) -> DeviceEvent | None:
        """At a launch's start: CUDA's start event (recorded), else None."""
        if not self.cuda:
            return None
        start = cuda_timing_event()
        start.record()
        return start

    def launched(self, flight: InFlight) -> None:
        """At a launch's end: CUDA's end event; the stand-in's ready time."""
        if self.cuda:
            flight.end = cuda_timing_event()
            flight.end.record()
        if self.step_ns:  # queued behind the step before when that one still runs
            flight.idle_ns = flight.launched_ns - self.free_ns
            flight.ready_ns = max(flight.launched_ns, self.free_ns) + self.step_ns
            self.free_ns = flight.ready_ns

    def seconds_to_ready(self, flight: InFlight) -> float:
        """How long before the step's results can be read (0: now); on CUDA, where the end
        is not known in advance, a short poll interval until its copy is done."""
        if self.step_ns:
            return max(0.0, (flight.ready_ns - time.perf_counter_ns()) / 1e9)
        if self.cuda:
            return 0.0 if flight.copy.ready() else POLL_S
        return 0.0

    def wait(self, flight: InFlight) -> None:
        """The stand-in: sleep until the step's results are readable (CUDA waits on the
        copy's event, a CPU device has them already)."""
        if self.step_ns:
            wait = self.seconds_to_ready(flight)
            if wait > 0:
                time.sleep(wait)

    def read(self, sb: StepBatch, queued_ns: int) -> None:
        """After the step's read: its busy time and the host gap before it (`sb`)."""
        flight = sb.launched()
        queued_for = max(0, flight.launched_ns - queued_ns)
        if self.cuda:
            assert flight.start is not None and flight.end is not None
            # Recorded right behind the copy just awaited (nothing between them on the
            # stream): done, or within microseconds; elapsed_time needs it complete.
            flight.end.synchronize()
            busy = round(flight.start.elapsed_time(flight.end) * 1_000_000)
            last, self.last_end = self.last_end, flight.end
            idle = queued_for if last is None else round(last.elapsed_time(flight.start) * 1e6)
        elif self.step_ns:
            busy, idle = self.step_ns, flight.idle_ns
        else:
            now = time.perf_counter_ns()
            busy, idle = now - flight.launched_ns, flight.launched_ns - self.free_ns
            self.free_ns = now
        sb.device_busy_ns = busy
        sb.host_gap_ns = max(0, min(idle, queued_for))
