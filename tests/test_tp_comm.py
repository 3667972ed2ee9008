"""`TpComm` without a group (fakes stand in for torch.distributed): what runs on NCCL, the
bounded wait that turns an aborted NCCL collective into `TpGroupError`, the capture runs'
local all-reduces, and the NCCL environment the launcher sets."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from executor.parallel.comm import TpComm, TpGroupError
from executor.parallel.nccl_env import ASYNC_ERROR_HANDLING, set_nccl_error_handling


class FakeWork:
    """A collective's Work: `wait()` orders streams; `wait(timeout)` raises when aborted."""

    def __init__(self, aborted: bool = False) -> None:
        self.aborted = aborted
        self.waits: list[timedelta | None] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if timeout is not None and self.aborted:
            raise dist.DistBackendError("NCCL communicator was aborted: watchdog timeout")
        return True


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    works: list[FakeWork] = []

    def all_reduce(tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        work = FakeWork(aborted=bool(seen and seen[0].get("abort")))
        seen.append({"async_op": async_op, "work": work})
        works.append(work)
        return work if async_op else None

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


def test_nccl_all_reduce_does_not_wait_on_the_host_and_settle_raises_an_abort(
    calls: list[dict[str, Any]],
) -> None:
    failures: list[str] = []
    comm = TpComm(rank=1, size=2, backend="nccl", wait_timeout_s=7, on_failure=failures.append)
    calls.append({"abort": True, "work": FakeWork()})  # every later work is aborted
    comm.all_reduce_(torch.ones(4))
    work = calls[-1]["work"]
    assert calls[-1]["async_op"] is True
    assert work.waits == [None]  # stream order only: no host wait in the step
    with pytest.raises(TpGroupError, match="watchdog timeout"):
        comm.settle()
    assert work.waits == [None, timedelta(seconds=7)]  # the bounded wait
    assert comm.failed is not None and failures == [comm.failed]
    with pytest.raises(TpGroupError, match="failed earlier"):
        comm.all_reduce_(torch.ones(4))


def test_settle_after_a_healthy_step_clears_the_pending_work(calls: list[dict[str, Any]]) -> None:
    comm = TpComm(rank=0, size=2, backend="nccl")
    comm.all_reduce_(torch.ones(2))
    comm.settle()
    comm.settle()  # nothing pending: no second wait
    assert calls[0]["work"].waits == [None, timedelta(seconds=60)]
    assert comm.failed is None


def test_gloo_all_reduce_stays_synchronous(calls: list[dict[str, Any]]) -> None:
    comm = TpComm(rank=0, size=2, backend="gloo")
    comm.all_reduce_(torch.ones(2))
    comm.settle()
    assert calls[0]["async_op"] is False and calls[0]["work"].waits == []


def test_capture_runs_reduce_locally_on_the_capturing_thread_only(
    calls: list[dict[str, Any]],
) -> None:
    comm = TpComm(rank=0, size=2, backend="gloo")
    other: list[int] = []
    with comm.capture_runs():
        comm.all_reduce_(torch.ones(2))  # a warm-up run: no communication
        assert calls == []
        t = threading.Thread(target=lambda: (comm.all_reduce_(torch.ones(2)), other.append(1)))
        t.start()
        t.join()
    assert other == [1] and len(calls) == 1  # a step on another thread still communicates
    comm.all_reduce_(torch.ones(2))
    assert len(calls) == 2


def test_the_launcher_turns_nccl_async_error_handling_on_for_cuda_only() -> None:
    env: dict[str, str] = {}
    assert set_nccl_error_handling(env, torch.device("cpu")) is None and env == {}
    assert set_nccl_error_handling(env, torch.device("cuda", 0)) == "2"
    assert env == {ASYNC_ERROR_HANDLING: "2"}
    env = {ASYNC_ERROR_HANDLING: "1"}  # the operator's value wins
    assert set_nccl_error_handling(env, torch.device("cuda", 0)) == "1"
