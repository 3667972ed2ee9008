"""`CompilePause`: on a CPU device, the compile worker's processes stop while steps run and go
on once the server has been idle for a moment.

The worker (`compile_job`) compiles for minutes. Beside a CPU step it takes a core that the
step's OpenMP team counts on: a parallel region then waits at its barrier for the displaced
thread; and between two steps it delays the RPC path that carries the next one
(docs/performance.md). So a batch stops the worker's process group (SIGSTOP: the worker and
the C++ compiler processes it started) as it arrives, before its RPC path and admission, and
so does a step before its device work; the worker goes on (SIGCONT) only once nothing has
run for `LINGER_S`: steps back to back keep it stopped, with no signal between them. The
compile runs on what the steps leave: the server's idle time; a server that is never idle
compiles nothing until it is.

Only the capture thread attaches, continues (`tick`, from its wait loop) and detaches a
worker. The step's thread stops it (`pause`) and marks the step's end (`resume`); an RPC
thread stops it as a batch arrives (`batch_arrived`), and the batch's answer (or refusal)
ends that (`batch_left`). Arrivals are counted (they overlap, each ends once: its job's
future always resolves); a step's mark is a flag, so a launched step that is never read (the
one before it failed) leaves nothing held. A lock
keeps a signal from reaching a group that has ended: the worker is reaped only under it
(`poll`), and it ends while stopped only when killed (a shutdown, under the lock; or the
kernel's OOM killer, after which nothing signals its group again).

The worker runs in a process group of its own in the server's session: if the server dies
while the group is stopped, the group is orphaned with stopped members, and the kernel sends
it SIGHUP and SIGCONT, which end it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

LINGER_S = 0.05  # the idle time after a step before the worker goes on
TICK_S = 0.01  # how often the capture thread looks (`tick`, `poll`) while a worker is attached


class CompilePause:
    def __init__(self) -> None:
        # Re-entrant for its owner test: an `IdleGate` never parks the capture thread in it.
        self.lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None  # the attached worker, its group's leader
        self._stopped_at: float | None = None  # monotonic time of the stop now in force
        self._stepping = False  # a step between `pause` and `resume`
        self._arrivals = 0  # batches between `batch_arrived` and `batch_left`
        self._idle_since = 0.0  # monotonic time of the last step's (or batch's) end
        self.paused_s = 0.0  # the attached worker's time stopped, in all
        self.pauses = 0  # how many times it was stopped

    @property
    def attached(self) -> bool:
        return self._proc is not None

    def attach(self, proc: subprocess.Popen[bytes]) -> None:
        """The capture thread: `proc` (started with `process_group=0`) pauses with the steps."""
        with self.lock:
            self._proc, self.paused_s, self.pauses = proc, 0.0, 0

    def poll(self) -> int | None:
        """The capture thread: the worker's exit code (reaped, and detached), or None."""
        with self.lock:
            proc = self._proc
            if proc is None:
                return None
            code = proc.poll()
            if code is not None:  # reaped: its group id is no longer ours to signal
                self._end_stop()
                self._proc = None
            return code

    def tick(self) -> None:
        """The capture thread: a stopped worker goes on once nothing ran for `LINGER_S` (no
        step, no batch on its way to one)."""
        if self._stopped_at is None or self._stepping or self._arrivals:
            return
        with self.lock:
            busy = self._stepping or self._arrivals
            if busy or time.monotonic() - self._idle_since < LINGER_S:
                return
            if self._stopped_at is not None and self._proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGCONT)
            self._end_stop()

    def kill(self) -> None:
        """The capture thread (a shutdown): the worker's whole group killed, reaped, detached."""
        with self.lock:
            proc = self._proc
            if proc is None:
                return
            with contextlib.suppress(ProcessLookupError):  # stopped or not: it acts at once
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            self._stopped_at = None
            self._proc = None

    def pause(self) -> None:
        """The step's thread, before its device work: the worker stops, unless it is stopped
        already (steps back to back: no signal). Nothing attached: one attribute read."""
        if self._proc is None:
            return
        with self.lock:  # (a `tick` continues the worker under it, or sees this step)
            self._stepping = True
            self._stop()

    def batch_arrived(self) -> None:
        """An RPC thread, as a batch arrives: the worker stops (unless it is stopped already)
        until `batch_left`, so the batch's RPC path and admission run without it too."""
        with self.lock:
            self._arrivals += 1
            self._stop()

    def batch_left(self) -> None:
        """The batch answered or refused (its job's end): with the last one out and no step
        running, the idle time starts."""
        with self.lock:
            self._arrivals -= 1
            self._idle_since = time.monotonic()

    def _stop(self) -> None:
        if self._proc is not None and self._stopped_at is None:
            with contextlib.suppress(ProcessLookupError):  # a step never fails for it
                os.killpg(self._proc.pid, signal.SIGSTOP)
            self._stopped_at = time.monotonic()
            self.pauses += 1

    def resume(self) -> None:
        """The step's thread, once the step is read (or failed): the idle time starts (the
        worker goes on at a `tick` after `LINGER_S` of it)."""
        if self._stepping:
            self._idle_since = time.monotonic()
            self._stepping = False

    def _end_stop(self) -> None:
        if self._stopped_at is not None:
            self.paused_s += time.monotonic() - self._stopped_at
            self._stopped_at = None


def process_state(pid: int) -> str:
    """A process's state letter from /proc ("T": stopped), or "gone" (reaped, or never was)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]
