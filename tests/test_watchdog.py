"""The device watchdog: a step stuck past step_timeout_s (an injected hang) turns liveness and
readiness NOT_SERVING within the bound, answers the waiting caller UNAVAILABLE and logs the
phase; a sticky device error (injected) ends serving and marks the process to exit 1."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.clock import StepClock
from executor.core.errors import InjectedFault
from executor.service.watchdog import DeviceWatchdog, RunningStep, is_sticky_device_error
from tests.server_util import running_server, tiny_config

BOUND_S = 0.5


class _Hang:
    """Stands in for the FaultInjector: the step's `forward` site blocks until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def check(self, site: str) -> None:
        if site == "forward":
            self.entered.set()
            self.release.wait(30)


class _Raise:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def check(self, site: str) -> None:
        if site == "forward":
            raise self.exc


def _batch(row: int) -> object:
    return make_extend_batch(
        input_ids=[[5, 6, 7]],
        req_pool_indices=[row],
        out_cache_loc=[[row * 10 + 1, row * 10 + 2, row * 10 + 3]],
    )


@pytest.mark.slow
def test_a_stuck_step_turns_the_server_not_serving_within_the_bound(tmp_path: Path) -> None:
    hang = _Hang()
    # A deferred-mask wait counts as step time: its timeout must stay below the bound.
    config = tiny_config(tmp_path, deferred_mask_timeout_s=BOUND_S / 2)
    with running_server(config, step_timeout_s=BOUND_S, health_port=0) as srv:
        assert srv.executor is not None and srv.health_port is not None
        srv.executor.hooks.faults = hang  # type: ignore[assignment]
        answers: list[BaseException | object] = []
        with capture_logs() as logs, ExecutorClient(f"127.0.0.1:{srv.port}") as c:

            def call() -> None:
                try:
                    answers.append(c.forward(_batch(1), timeout=30))  # type: ignore[arg-type]
                except grpc.RpcError as exc:
                    answers.append(exc)

            caller = threading.Thread(target=call)
            caller.start()
            try:
                assert hang.entered.wait(10)
                start = time.monotonic()
                with ExecutorClient(f"127.0.0.1:{srv.health_port}") as probe:
                    while probe.health("", timeout=1.0) == "SERVING":
                        assert time.monotonic() - start < BOUND_S + 2.0, "liveness still SERVING"
                        time.sleep(0.02)
                    turned = time.monotonic() - start
                    assert probe.health(timeout=1.0) == "NOT_SERVING"  # readiness too
                caller.join(10)
                # The waiting caller is answered while the step is still stuck.
                [answer] = answers
                assert isinstance(answer, grpc.RpcError)
                assert answer.code() == grpc.StatusCode.UNAVAILABLE
                assert "step_timeout_s" in (answer.details() or "")
                with pytest.raises(grpc.RpcError) as later:  # nothing new is taken
                    c.forward(_batch(2), timeout=10)  # type: ignore[arg-type]
                assert later.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                hang.release.set()
        assert turned <= BOUND_S + 1.0
        [stuck] = [line for line in logs if line["event"] == "device step stuck; not serving"]
        assert stuck["phase"] == "forward" and stuck["seconds"] >= BOUND_S
        assert not srv.device_fatal.is_set()  # a hang: liveness restarts the pod


@pytest.mark.slow
def test_a_sticky_device_error_ends_serving_and_marks_exit(tmp_path: Path) -> None:
    poisoned = RuntimeError("CUDA error: an illegal memory access was encountered")
    with running_server(tiny_config(tmp_path), health_port=0) as srv:
        assert srv.executor is not None and srv.health_port is not None
        srv.executor.hooks.faults = _Raise(poisoned)  # type: ignore[assignment]
        with ExecutorClient(f"127.0.0.1:{srv.port}") as c:
            with pytest.raises(grpc.RpcError) as err:
                c.forward(_batch(1), timeout=10)  # type: ignore[arg-type]
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert srv.device_fatal.wait(5)  # `serve` exits 1 on it
            with ExecutorClient(f"127.0.0.1:{srv.health_port}") as probe:
                assert probe.health("", timeout=1.0) == "NOT_SERVING"
                assert probe.health(timeout=1.0) == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as later:
                c.forward(_batch(2), timeout=10)  # type: ignore[arg-type]
            assert later.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_an_ordinary_step_error_keeps_serving(tmp_path: Path) -> None:
    with running_server(tiny_config(tmp_path), health_port=0) as srv:
        assert srv.executor is not None
        srv.executor.hooks.faults = _Raise(InjectedFault("injected forward fault"))  # type: ignore[assignment]
        with ExecutorClient(f"127.0.0.1:{srv.port}") as c:
            with pytest.raises(grpc.RpcError):
                c.forward(_batch(1), timeout=10)  # type: ignore[arg-type]
            srv.executor.hooks.faults = None
            assert c.forward(_batch(1), timeout=10).next_token_ids.shape == (1,)  # type: ignore[arg-type]
            assert c.health("") == "SERVING"
        assert not srv.device_failed.is_set()


def test_sticky_errors_are_told_from_the_others() -> None:
    for text in (
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered",
        "CUDA error: unspecified launch failure",
        "CUDA error: uncorrectable ECC error encountered",
    ):
        assert is_sticky_device_error(RuntimeError(text)), text
    for exc in (
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ValueError("illegal memory access"),  # not a device error type
        InjectedFault("injected forward fault"),
    ):
        assert not is_sticky_device_error(exc), exc


def test_the_watchdog_fires_once_past_the_bound() -> None:
    class Worker:
        step: RunningStep | None = None

        def running_step(self) -> RunningStep | None:
            return self.step

    worker, fired = Worker(), []
    dog = DeviceWatchdog(worker, 10.0, fired.append)
    assert dog.check() is None  # idle
    worker.step = RunningStep(7, 9.9, "forward")
    assert dog.check() is None and not fired
    worker.step = RunningStep(7, 10.0, "sample")
    assert dog.check() == worker.step and fired == [worker.step]
    assert dog.check() is None and len(fired) == 1  # once
    with pytest.raises(ValueError, match="bound_s"):
        DeviceWatchdog(worker, 0, fired.append)


def test_the_step_clock_says_where_the_step_is() -> None:
    clock = StepClock()
    assert clock.current == ""
    with clock.phase("stage"):
        assert clock.current == "stage"
    assert clock.current == "after stage"


@pytest.mark.slow
def test_serve_exits_1_on_a_sticky_device_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve` (as `model-executor serve` runs it) returns exit code 1 once a batch hits a
    sticky device error, so that Kubernetes restarts the container."""
    import signal

    from executor.service import server as server_mod
    from executor.service.server_config import ServerConfig

    real_start = server_mod.start_server
    poisoned = RuntimeError("CUDA error: an illegal memory access was encountered")

    def start(*args: object, **kwargs: object) -> object:
        running = real_start(*args, **kwargs)  # type: ignore[arg-type]

        def poison() -> None:
            running.wait_ready(60)
            assert running.executor is not None
            running.executor.hooks.faults = _Raise(poisoned)  # type: ignore[assignment]
            with ExecutorClient(f"127.0.0.1:{running.port}") as c, pytest.raises(grpc.RpcError):
                c.forward(_batch(1), timeout=10)  # type: ignore[arg-type]

        threading.Thread(target=poison, daemon=True).start()
        return running

    monkeypatch.setattr(server_mod, "start_server", start)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = server_mod.serve(
            tiny_config(tmp_path), ServerConfig(host="127.0.0.1", port=0, metrics_port=-1)
        )
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 1
