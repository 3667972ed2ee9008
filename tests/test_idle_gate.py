"""`IdleGate`: the capture thread's own work waits while steps run (and batches are on their
way to one) and for LINGER_S after the last one (issue 36: a load of the compiled step never
stalls a step); never while it holds the step lock (`LockHold`: its hook off there); never for
longer than MAX_WAIT_S for one step (a step blocked on a lock that the capture thread holds
cannot deadlock with it)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from executor.graphs import idle_gate
from executor.graphs.capture import LockHold
from executor.graphs.idle_gate import LINGER_S, IdleGate
from executor.observability import logs

SETTLE_S = 0.03  # for the worker's call in flight to end (well under the longest wait, 0.1 s)


class _Worker:
    """A capture thread: counts the calls it makes inside `gate.yielding()` until stopped."""

    def __init__(self, gate: IdleGate, lock: threading.RLock | None = None) -> None:
        self.gate, self.lock = gate, lock
        self.calls, self.stop, self.inside = 0, threading.Event(), threading.Event()
        self.hook_in_lock: list[object] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.inside.wait(5)

    def _tick(self) -> None:
        self.calls += 1

    def _run(self) -> None:
        with self.gate.yielding():
            self.inside.set()
            while not self.stop.is_set():
                if self.lock is not None:
                    with LockHold(self.lock):  # as a capture pass holds the step lock
                        self.hook_in_lock.append(sys.getprofile())
                        self._tick()
                else:
                    self._tick()
                time.sleep(0.0005)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def _progress(worker: _Worker, seconds: float) -> int:
    before = worker.calls
    time.sleep(seconds)
    return worker.calls - before


def test_it_waits_while_a_step_runs_and_goes_on_after_the_linger() -> None:
    gate = IdleGate()
    worker = _Worker(gate)
    assert _progress(worker, 0.05) > 0  # idle: it runs
    gate.step_started()
    time.sleep(SETTLE_S)  # (its call in flight ends)
    assert _progress(worker, 0.1) == 0  # a step runs: it waits
    gate.step_ended()
    assert _progress(worker, LINGER_S / 2) == 0  # the linger
    time.sleep(LINGER_S)
    assert _progress(worker, 0.2) > 0  # idle again
    worker.end()
    assert gate.waits >= 1 and gate.waited_s >= 0.1


def test_steps_back_to_back_keep_it_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    linger = 0.3  # (gaps far shorter than it, however slow this machine's sleeps are)
    monkeypatch.setattr(idle_gate, "LINGER_S", linger)
    gate = IdleGate()
    worker = _Worker(gate)
    gate.step_started()
    time.sleep(SETTLE_S)
    start = worker.calls
    for _ in range(10):
        gate.step_ended()
        time.sleep(0.01)
        gate.step_started()
        time.sleep(0.005)
    assert worker.calls == start
    gate.step_ended()
    time.sleep(linger * 2)
    assert worker.calls > start
    worker.end()


def test_a_step_longer_than_the_longest_wait_lets_it_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(idle_gate, "MAX_WAIT_S", 0.1)
    gate = IdleGate()
    worker = _Worker(gate)
    gate.step_started()  # a step that waits for something the capture thread holds
    time.sleep(SETTLE_S)
    assert _progress(worker, 0.02) == 0
    time.sleep(0.1)
    assert _progress(worker, 0.2) > 0  # this step no longer holds it back
    gate.step_ended()
    gate.step_started()  # the next step does
    time.sleep(SETTLE_S)
    assert _progress(worker, 0.05) == 0
    gate.step_ended()
    worker.end()


def test_it_never_waits_holding_the_step_lock_and_its_hook_is_off_there() -> None:
    gate, lock = IdleGate(), threading.RLock()
    worker = _Worker(gate, lock)
    assert _progress(worker, 0.05) > 0
    with lock:  # a step: holds the lock, then says it runs
        gate.step_started()
        time.sleep(SETTLE_S)
        during = _progress(worker, 0.05)
    assert during == 0
    gate.step_ended()
    time.sleep(LINGER_S * 2)
    assert _progress(worker, 0.2) > 0
    worker.end()
    assert set(worker.hook_in_lock) == {None}


def test_steps_pay_nothing_and_change_nothing_while_nothing_yields() -> None:
    gate = IdleGate()
    gate.step_started()
    assert not gate._running and gate._steps == 0 and gate._ended.is_set()
    gate.step_ended()
    with gate.yielding():
        assert sys.getprofile() == gate._hook
    assert sys.getprofile() is None and not gate._on


def test_a_batch_holds_it_from_its_arrival_and_its_step_inside_from_its_start() -> None:
    """`batch_arrived` (an RPC thread, before decoding and admission) holds the yielding thread
    back as a step does; the step's end inside it does not release it, the batch's does."""
    gate = IdleGate()
    worker = _Worker(gate)
    assert _progress(worker, 0.05) > 0
    gate.batch_arrived()
    time.sleep(SETTLE_S)
    assert _progress(worker, 0.05) == 0  # decoding, admission: it waits already
    gate.step_started()
    gate.step_ended()
    time.sleep(LINGER_S * 2)
    assert _progress(worker, 0.05) == 0  # the answer is not sent yet
    gate.batch_left()
    time.sleep(LINGER_S * 2)
    assert _progress(worker, 0.2) > 0
    worker.end()
    assert gate._arrivals == 0


def test_batches_arriving_while_a_step_is_stuck_do_not_hold_it_back_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step stuck on something the capture thread holds lets it go on after MAX_WAIT_S;
    batches arriving meanwhile (the device thread cannot start their steps) must not make it
    wait again each time, or it would never free the stuck step."""
    monkeypatch.setattr(idle_gate, "MAX_WAIT_S", 0.1)
    gate = IdleGate()
    worker = _Worker(gate)
    gate.step_started()  # stuck
    time.sleep(SETTLE_S + 0.1)
    for _ in range(5):
        gate.batch_arrived()
        assert _progress(worker, 0.03) > 0
    gate.step_ended()
    gate.step_started()  # the next step, once unstuck: it waits again
    time.sleep(SETTLE_S)
    assert _progress(worker, 0.05) == 0
    gate.step_ended()
    for _ in range(5):
        gate.batch_left()
    worker.end()


def test_batches_are_counted_while_nothing_yields(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrivals are counted from any start: a thread that starts yielding while a batch is on
    its way waits for it (here for MAX_WAIT_S: the batch's step never comes)."""
    monkeypatch.setattr(idle_gate, "MAX_WAIT_S", 0.2)
    gate = IdleGate()
    gate.batch_arrived()
    assert gate._arrivals == 1 and gate._ended.is_set()  # no event touched
    start = time.monotonic()
    worker = _Worker(gate)  # (its first call inside waits)
    assert time.monotonic() - start >= 0.15 and gate.waits == 1
    gate.batch_left()
    assert gate._arrivals == 0 and _progress(worker, 0.1) > 0
    worker.end()


def test_it_never_waits_holding_a_lock_that_an_arriving_batch_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step lock (or the compile worker's pause lock) held by the yielding thread with its
    hook on: a batch that arrives then must get the lock, not wait out MAX_WAIT_S for a thread
    that waits for it."""
    monkeypatch.setattr(idle_gate, "MAX_WAIT_S", 5.0)
    gate, lock = IdleGate(), threading.RLock()
    gate.guard(lock)
    entered, done = threading.Event(), threading.Event()

    def work() -> None:
        with gate.yielding(), lock:
            entered.set()
            time.sleep(0.05)  # the batch arrives meanwhile
            for _ in range(100):
                str(1)  # calls with the hook on
        done.set()  # the lock let go: this call waits for the batch

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    assert entered.wait(5)
    gate.batch_arrived()
    assert lock.acquire(timeout=2)  # the batch's way to the device (its turn takes the lock)
    lock.release()
    time.sleep(SETTLE_S)
    assert not done.is_set()  # out of the lock, it waits for the batch
    gate.batch_left()
    thread.join(5)
    assert done.is_set() and gate.waits == 1


def test_it_never_waits_in_the_middle_of_a_log_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's write lock is a guard (the device worker makes it one): a background load
    writing a line when a batch arrives finishes the line before it waits, so the batch's own
    lines (an RPC thread's, the device thread's) do not wait for it."""
    monkeypatch.setattr(idle_gate, "MAX_WAIT_S", 5.0)
    gate = IdleGate()
    gate.guard(logs.WRITE_LOCK)
    writing, done = threading.Event(), threading.Event()

    class _File:
        def write(self, text: str) -> None:
            writing.set()
            time.sleep(0.1)  # the batch arrives meanwhile; then calls with the hook on

        def flush(self) -> None:
            pass

    def work() -> None:
        with gate.yielding():
            logs.LinePrinter(_File()).msg("a line")  # type: ignore[arg-type]
            done.set()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    assert writing.wait(5)
    gate.batch_arrived()
    assert logs.WRITE_LOCK.acquire(timeout=2)  # a line on the batch's way
    logs.WRITE_LOCK.release()
    gate.batch_left()
    thread.join(5)
    assert done.is_set()


def test_two_threads_yield_at_once_and_one_leaving_keeps_the_other_waiting() -> None:
    """The capture thread and the KV commit yield together: each waits while a step runs, and
    the gate stays on until the last of them leaves."""
    gate = IdleGate()
    first, second = _Worker(gate), _Worker(gate)
    gate.step_started()
    time.sleep(SETTLE_S)
    assert _progress(first, 0.1) == 0 and _progress(second, 0.05) == 0
    gate.step_ended()
    first.end()
    assert gate._on  # the second still yields
    gate.step_started()
    time.sleep(SETTLE_S)
    assert _progress(second, 0.1) == 0
    gate.step_ended()
    time.sleep(LINGER_S * 2)
    assert _progress(second, 0.2) > 0
    second.end()
    assert not gate._on and sys.getprofile() is None
