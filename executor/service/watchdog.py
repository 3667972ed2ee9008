"""The device watchdog: a step that never ends, and a device error that never clears.

A hung kernel, a deadlocked collective or a device lost to the driver leaves the device thread
inside one step forever; without a watchdog the pod stays Live and Ready while every batch
waits. `DeviceWatchdog` polls the running step from its own thread; once a step has run longer
than `step_timeout_s` it calls `on_stuck` once with the batch, the seconds and the phase the
step's `StepClock` was in (the server then turns liveness and readiness NOT_SERVING and answers
every waiting caller UNAVAILABLE; the kubelet's liveness probe restarts the pod).

Some device errors poison the CUDA context for good (an illegal memory access, a device-side
assert, a launch failure, an uncorrectable ECC error): every later call fails too.
`is_sticky_device_error` recognizes them, and the server ends the process (exit 1) so that
Kubernetes restarts it with a fresh context, rather than refusing every batch forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

# Messages of CUDA errors after which the context is unusable (cudaErrorIllegalAddress,
# cudaErrorAssert, cudaErrorLaunchFailure, ...): the runtime returns them for every later call.
_STICKY_MESSAGES = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ecc error",
    "hardware stack error",
    "cuda error: unknown error",
    "nccl error: unhandled cuda error",
)


def is_sticky_device_error(exc: BaseException) -> bool:
    """True for a device error that poisons the process's CUDA context (see module doc)."""
    if not isinstance(exc, RuntimeError):  # torch's AcceleratorError is a RuntimeError
        return False
    text = str(exc).lower()
    return any(message in text for message in _STICKY_MESSAGES)


@dataclass(frozen=True)
class RunningStep:
    """The step on the device now: its batch, how long it has run, and its phase."""

    batch_id: int
    seconds: float
    phase: str


class _Worker(Protocol):
    def running_step(self) -> RunningStep | None: ...


class DeviceWatchdog:
    """Calls `on_stuck(step)` once when a step runs longer than `bound_s`; then stops."""

    def __init__(
        self,
        worker: _Worker,
        bound_s: float,
        on_stuck: Callable[[RunningStep], None],
        *,
        poll_s: float | None = None,
    ) -> None:
        if bound_s <= 0:
            raise ValueError(f"bound_s must be > 0, got {bound_s}")
        self.worker = worker
        self.bound_s = bound_s
        self.on_stuck = on_stuck
        # Polled often enough that a stuck step is seen within a tenth of the bound past it.
        self.poll_s = poll_s if poll_s is not None else min(1.0, bound_s / 10)
        self.fired: RunningStep | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def check(self) -> RunningStep | None:
        """The running step when it is past the bound (then `on_stuck` was called), else None."""
        step = self.worker.running_step()
        if step is None or step.seconds < self.bound_s or self.fired is not None:
            return None
        self.fired = step
        try:
            self.on_stuck(step)
        except Exception:  # the watchdog must not die of its own handler
            log.error("device watchdog handler failed", exc_info=True)
        return step

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check() is not None:
                return
