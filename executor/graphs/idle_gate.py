"""`IdleGate`: background threads' work in this process runs in the server's idle time.

Loading a compiled step is seconds of Python on the capture thread: dynamo's and inductor's
imports, each saved step's deserialization. Beside it, a step's thread, which lets go of the
GIL around every op, waits to get it back each time: a step took many times its length
(docs/performance.md). So inside `yielding`, a profile hook on the capture thread alone makes
it wait, at its next call, while a step runs and until `LINGER_S` after the last one ended:
the compile worker's rule (`CompilePause`), here for the threads of one process. Steps back
to back keep it waiting; the load goes on in the server's idle time. The CPU's KV cache is
committed the same way (`ops.host_pages`: its populate holds the memory-map lock that a step's
allocations and page faults wait for, docs/performance.md). Several threads may yield at once;
each one's hook is its own.

The steps' thread marks each step (`step_started`, `step_ended`): one attribute read while
nothing yields. An RPC thread marks a batch from its arrival to its answer (`batch_arrived`,
`batch_left`: counted, under a lock), so its RPC path and admission run without the load
too. The capture thread never waits while it holds the step lock (no step runs then;
`capture.LockHold` turns its hook off there, so the capture's own runs do not pay for it). A
step that runs longer than `MAX_WAIT_S` (a long prefill; or one that waits for a lock the
capture thread holds, such as a module's import lock) lets the capture thread go on for the
rest of that step: a wait never becomes a deadlock. Only steps count for that rule: batches
keep arriving while the device thread is stuck, and must not hold the capture thread back
again each time. And a thread never waits while it holds a lock a batch takes on its way to
the device (`guard`: the step lock, the compile worker's pause lock, the log's write lock):
the batch would wait for the waiting thread.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from executor.graphs.compile_pause import LINGER_S

MAX_WAIT_S = 1.0  # the longest wait for one step


class IdleGate:
    def __init__(self) -> None:
        self._users = 0  # the threads yielding now (each with its hook installed)
        self._lock = threading.Lock()  # `_users`, `_arrivals` and `_ended` change under it
        self._steps = 0  # steps started while on
        self._running = False  # a step between `step_started` and `step_ended`
        self._arrivals = 0  # batches between `batch_arrived` and `batch_left`
        self._ended = threading.Event()  # nothing runs or arrives (kept while a thread yields)
        self._ended.set()
        self._passed = -1  # the step the capture thread stopped waiting for (`MAX_WAIT_S`)
        self.waits = 0  # how many times a yielding thread waited
        self.waited_s = 0.0  # for how long, in all
        self._guards: list[Callable[[], bool]] = []  # whether this thread holds each guard

    def guard(self, lock: Any) -> None:
        """`lock` (a `threading.RLock`: it knows its owner) is one a batch or a step takes:
        a yielding thread holding it never waits."""
        if lock._is_owned not in self._guards:
            self._guards.append(lock._is_owned)

    @property
    def _on(self) -> bool:
        return self._users > 0

    def step_started(self) -> None:
        """The steps' thread, before a step's device work."""
        if self._users:
            with self._lock:
                self._steps += 1
                self._running = True
                self._ended.clear()

    def step_ended(self) -> None:
        """The steps' thread, once the step is read (or failed)."""
        if self._running:
            with self._lock:
                self._running = False
                if not self._arrivals:
                    self._ended.set()

    def batch_arrived(self) -> None:
        """An RPC thread, as a batch arrives (before its decoding and admission)."""
        with self._lock:
            self._arrivals += 1
            if self._users:
                self._ended.clear()

    def batch_left(self) -> None:
        """The batch answered or refused (its job's end, on whichever thread ends it)."""
        with self._lock:
            self._arrivals -= 1
            if self._users and not (self._arrivals or self._running):
                self._ended.set()

    @contextmanager
    def yielding(self) -> Iterator[None]:
        """On a background thread: its work inside waits for the steps (not nested on one
        thread)."""
        with self._lock:
            self._users += 1
            if self._arrivals:  # (a step already running is not known: it started unmarked)
                self._ended.clear()
        sys.setprofile(self._hook)
        try:
            yield
        finally:
            sys.setprofile(None)
            with self._lock:
                self._users -= 1
                if not self._users:
                    self._running = False
                    self._ended.set()

    def _hook(self, frame: FrameType, event: str, arg: object) -> None:
        busy = (self._running or self._arrivals) and self._steps != self._passed
        if busy and not any(owned() for owned in self._guards):
            self._wait()

    def _wait(self) -> None:
        """Until nothing has run or arrived for `LINGER_S`, or one step ran for `MAX_WAIT_S`."""
        start = time.monotonic()
        while True:
            step = self._steps
            if not self._ended.wait(MAX_WAIT_S):
                self._passed = step
                break
            time.sleep(LINGER_S)
            if not (self._running or self._arrivals) and self._steps == step:
                break
        self.waits += 1
        self.waited_s += time.monotonic() - start
