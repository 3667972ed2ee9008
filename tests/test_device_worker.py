"""The device worker's inline path: a unary job that finds the device idle runs on its caller's
thread; everything else still runs one at a time, in the order accepted, with the queue's
accounting (depth, back-pressure, abandon) unchanged."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from executor.batch_prep import make_decode_batch
from executor.forward_batch import ForwardBatch
from executor.service.device_worker import DeviceWorker, QueueFullError, WorkerClosedError
from executor.step.outputs import ForwardOutput


class FakeExecutor:
    """Records which thread ran each batch; `gate` (when set) holds a step until opened."""

    def __init__(self) -> None:
        self.ran: list[tuple[int, str]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def forward(self, batch: ForwardBatch, **_: Any) -> ForwardOutput:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.ran.append((int(batch.req_pool_indices[0]), threading.current_thread().name))
        return ForwardOutput(next_token_ids=torch.zeros(1, dtype=torch.int64))


def _batch(row: int) -> ForwardBatch:
    return make_decode_batch(
        input_ids=[1], req_pool_indices=[row], seq_lens=[2], out_cache_loc=[row]
    )


def _wait(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def worker() -> Iterator[tuple[DeviceWorker, FakeExecutor]]:
    ex = FakeExecutor()
    w = DeviceWorker(ex, queue_size=1)  # type: ignore[arg-type]
    w.start()
    yield w, ex
    if ex.gate is not None:
        ex.gate.set()
    w.stop(10)


def test_an_inline_job_runs_on_the_callers_thread_when_the_device_is_idle(
    worker: tuple[DeviceWorker, FakeExecutor],
) -> None:
    w, ex = worker
    job = w.submit(_batch(1), 1, inline=True)
    assert job.future.done() and job.future.result().next_token_ids.shape == (1,)
    queued = w.submit(_batch(2), 2)  # not inline: the worker thread runs it
    queued.future.result(10)
    assert ex.ran == [(1, threading.current_thread().name), (2, "device-worker")]
    assert w.wait_idle(1) and w.depth == 0


def test_jobs_behind_an_inline_one_wait_for_it_and_count_as_queued(
    worker: tuple[DeviceWorker, FakeExecutor],
) -> None:
    w, ex = worker
    ex.gate = threading.Event()
    inline = threading.Thread(target=lambda: w.submit(_batch(1), 1, inline=True), name="rpc")
    inline.start()
    _wait(ex.entered.is_set)
    second = w.submit(_batch(2), 2, inline=True)  # the device is busy: queued, not inline
    _wait(lambda: w.depth == 1)
    time.sleep(0.05)  # the worker thread holds it and must not run it yet
    assert ex.ran == [] and not second.future.done()
    with pytest.raises(QueueFullError):  # the held job still fills the queue (queue_size 1)
        w.submit(_batch(3), 3)
    ex.gate.set()
    inline.join(10)
    second.future.result(10)
    assert ex.ran == [(1, "rpc"), (2, "device-worker")]  # in the order accepted


def test_abandon_answers_the_job_held_behind_an_inline_one(
    worker: tuple[DeviceWorker, FakeExecutor],
) -> None:
    w, ex = worker
    ex.gate = threading.Event()
    inline = threading.Thread(target=lambda: w.submit(_batch(1), 1, inline=True), name="rpc")
    inline.start()
    _wait(ex.entered.is_set)
    held = w.submit(_batch(2), 2)
    _wait(lambda: w.depth == 1)
    assert w.abandon("grace over") == 2  # the held job and the running inline one
    with pytest.raises(WorkerClosedError):
        held.future.result(1)
    ex.gate.set()
    inline.join(10)
    time.sleep(0.05)
    assert [row for row, _ in ex.ran] == [1]  # the held job never ran
    with pytest.raises(WorkerClosedError):
        w.submit(_batch(4), 4, inline=True)  # closed: inline or not
