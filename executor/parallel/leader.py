"""`TpLeader`: rank 0's side of the group: one lock around every command, and the heartbeat.

Rank 0 holds `lock` for a whole step (the broadcast and the step's collectives) so that the
heartbeat thread never interleaves a ping with a step: every rank sees the same sequence of
collectives. While no command went out for `heartbeat_s`, the heartbeat sends `ping`: the
workers' wait for their next command never reaches the collective timeout on an idle
server, and a dead or hung worker is found within about `heartbeat_s` plus the timeout even
when no request arrives (`TpComm.fail` tells the host).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from executor.core.forward_batch import ForwardBatch
from executor.parallel import broadcast
from executor.parallel.broadcast import Command
from executor.parallel.comm import TpComm, TpGroupError

log = structlog.get_logger(__name__)


class TpLeader:
    def __init__(self, comm: TpComm, *, heartbeat_s: float) -> None:
        if comm.rank != 0 or not comm.enabled:
            raise ValueError("TpLeader runs on rank 0 of a group of size > 1")
        self.comm = comm
        self.heartbeat_s = heartbeat_s
        self.lock = threading.Lock()
        self._last = time.monotonic()
        self._step_held = False  # a step holds the group from its launch to its read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True)
        self._thread.start()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Around one command and the collectives that follow it."""
        self.hold()
        try:
            yield
        finally:
            self.free()

    def hold(self) -> None:
        self.lock.acquire()

    def free(self) -> None:
        self._last = time.monotonic()
        self.lock.release()

    def send_step(self, step: ForwardBatch, *, keep_rows: bool) -> None:
        """Broadcast a step at its launch and hold the group (no heartbeat) until `end_step`,
        after its read: the step's collectives run in between."""
        self.hold()
        self._step_held = True
        self.send(Command(broadcast.STEP, step, keep_rows=keep_rows))

    def end_step(self) -> None:
        """The step's read is over (or it failed): the group is free again (a no-op when no
        step holds it)."""
        if self._step_held:
            self._step_held = False
            self.free()

    def send(self, command: Command) -> None:
        """Broadcast `command` (call inside `holding`)."""
        broadcast.send(self.comm, command)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 4):
            if time.monotonic() - self._last < self.heartbeat_s or self.comm.failed:
                continue
            if not self.lock.acquire(blocking=False):
                continue  # a step is running: it proves liveness itself
            try:
                broadcast.send(self.comm, Command(broadcast.PING))
                self.comm.ping()
            except TpGroupError as e:
                log.error("tensor-parallel heartbeat failed", reason=str(e))
            finally:
                self._last = time.monotonic()
                self.lock.release()

    def close(self, *, stop_workers: bool = True) -> None:
        """Stop the heartbeat and (when the group is healthy) tell every worker to stop."""
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 5)
        if not stop_workers or self.comm.failed is not None:
            return
        # A step stuck in a collective holds the lock: give up after the heartbeat period
        # (the host then kills the workers).
        if not self.lock.acquire(timeout=self.heartbeat_s):
            log.warning("a step still holds the group; workers not told to stop")
            return
        try:
            broadcast.send(self.comm, Command(broadcast.STOP))
            # Every rank takes part in one last collective: none leaves the group (and tears
            # its connections down) while another is still inside the stop's broadcast.
            self.comm.ping()
        except TpGroupError as e:
            log.warning("could not tell the workers to stop", reason=str(e))
        finally:
            self.lock.release()
