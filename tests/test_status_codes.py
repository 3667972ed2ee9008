"""Status codes that tell the truth: the caller's doing (undecodable bytes, a cancelled call, a
passed deadline) is never INTERNAL, is logged without a stack trace and counted under its own
code; a real bug is INTERNAL with its stack trace."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from executor.batch_prep import make_extend_batch
from executor.service.codec import batch_to_proto
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from tests.server_util import Scrape, running_server, tiny_config

FORWARD = "/model_executor.v1.ModelExecutor/Forward"
FORWARD_STREAM = "/model_executor.v1.ModelExecutor/ForwardStream"
GARBAGE = b"\xff\xff\xff\xff\x0f"  # a varint that never ends: no message parses from it


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tiny_config(tmp_path_factory.mktemp("cache"))) as running:
        yield running


def _request(batch_id: int, row: int = 1) -> bytes:
    batch = make_extend_batch(
        input_ids=[[5, 6]], req_pool_indices=[row], out_cache_loc=[[2 * row, 2 * row + 1]]
    )
    return pb.ForwardRequest(batch_id=batch_id, batch=batch_to_proto(batch)).SerializeToString()


def _count(server: RunningServer, method: str, code: str) -> float:
    return Scrape(server).get("model_executor_requests_total", method=method, code=code)


def _no_stack_traces(logs: list[dict[str, Any]]) -> None:
    assert not [line for line in logs if "exc_info" in line or line["log_level"] == "error"]


def _wait_for(predicate: Any, timeout: float = 10.0, state: Any = None) -> None:
    """Until `predicate()`; on a timeout the message shows `state()` (what was seen instead)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {state() if state else ''}"
        time.sleep(0.02)


def test_undecodable_forward_bytes_are_invalid_argument_naming_the_message(
    server: RunningServer,
) -> None:
    before = _count(server, "Forward", "INVALID_ARGUMENT")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, capture_logs() as logs:
        raw = channel.unary_unary(FORWARD)  # bytes in, bytes out: no serializer
        with pytest.raises(grpc.RpcError) as err:
            raw(GARBAGE, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid model_executor.v1.ForwardRequest" in err.value.details()
        assert pb.ForwardResponse.FromString(raw(_request(7), timeout=30)).batch_id == 7
    assert _count(server, "Forward", "INVALID_ARGUMENT") == before + 1
    [line] = [line for line in logs if line["event"] == "undecodable request"]
    assert line["log_level"] == "warning" and line["code"] == "INVALID_ARGUMENT"
    _no_stack_traces(logs)


def test_undecodable_bytes_on_a_stream_end_it_with_invalid_argument(server: RunningServer) -> None:
    before = _count(server, "ForwardStream", "INVALID_ARGUMENT")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, capture_logs() as logs:
        raw = channel.stream_stream(FORWARD_STREAM)
        answers = raw(iter([_request(11, row=2), GARBAGE]), timeout=30)
        assert pb.ForwardResponse.FromString(next(answers)).batch_id == 11
        with pytest.raises(grpc.RpcError) as err:
            next(answers)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model_executor.v1.ForwardRequest" in err.value.details()
    assert _count(server, "ForwardStream", "INVALID_ARGUMENT") == before + 1
    assert [line["log_level"] for line in logs if line["event"] == "undecodable request"] == [
        "warning"
    ]
    _no_stack_traces(logs)


def test_a_cancelled_stream_is_cancelled_at_info_not_internal(server: RunningServer) -> None:
    """Counted once, as CANCELLED with one info line, never INTERNAL or with a stack trace.
    Or as OK with no line: gRPC may hand the handler the end of the request stream (the
    cancelled read) before the cancellation itself, and the handler then ends the stream
    normally before anything says the caller left."""
    codes = ("CANCELLED", "OK", "INTERNAL")
    before = {code: _count(server, "ForwardStream", code) for code in codes}
    release = threading.Event()

    def requests() -> Iterator[bytes]:
        yield _request(21, row=3)
        release.wait(30)  # the scheduler is still thinking when it restarts

    def ended() -> dict[str, float]:
        return {code: _count(server, "ForwardStream", code) - before[code] for code in codes}

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, capture_logs() as logs:
        call = channel.stream_stream(FORWARD_STREAM)(requests())
        assert pb.ForwardResponse.FromString(next(call)).batch_id == 21
        call.cancel()
        release.set()
        _wait_for(
            lambda: sum(ended().values()) >= 1,
            state=lambda: (
                before,
                [ln for ln in Scrape(server).text.splitlines() if 'method="ForwardStream"' in ln],
                logs,
            ),
        )
        time.sleep(0.2)  # a second count would come now
    gone = [(g["log_level"], g["code"]) for g in logs if g["event"] == "caller gone"]
    if ended()["CANCELLED"]:
        assert ended() == {"CANCELLED": 1, "OK": 0, "INTERNAL": 0}
        assert gone == [("info", "CANCELLED")]
    else:
        assert ended() == {"CANCELLED": 0, "OK": 1, "INTERNAL": 0}
        assert gone == []
    _no_stack_traces(logs)


def test_a_passed_deadline_is_deadline_exceeded_not_internal(server: RunningServer) -> None:
    assert server.worker is not None
    executor = server.worker.executor
    real_prepare, started, gate = executor.prepare, threading.Event(), threading.Event()

    def slow(batch: Any, clock: Any) -> Any:
        started.set()
        gate.wait(30)
        return real_prepare(batch, clock)

    before = _count(server, "Forward", "DEADLINE_EXCEEDED")
    executor.prepare = slow  # type: ignore[method-assign]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, capture_logs() as logs:
            raw = channel.unary_unary(FORWARD)
            with pytest.raises(grpc.RpcError) as err:
                raw(_request(31, row=4), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert started.is_set()
            gate.set()
            _wait_for(lambda: _count(server, "Forward", "DEADLINE_EXCEEDED") == before + 1)
    finally:
        executor.prepare = real_prepare  # type: ignore[method-assign]
        gate.set()
    gone = [line for line in logs if line["event"] == "caller gone"]
    assert [(g["log_level"], g["code"]) for g in gone] == [("info", "DEADLINE_EXCEEDED")]
    _no_stack_traces(logs)


def test_a_real_bug_is_internal_with_its_stack_trace(server: RunningServer) -> None:
    assert server.worker is not None
    executor = server.worker.executor
    real_prepare = executor.prepare

    def broken(batch: Any, clock: Any) -> Any:
        raise ZeroDivisionError("a bug")

    before = _count(server, "Forward", "INTERNAL")
    executor.prepare = broken  # type: ignore[method-assign]
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
            capture_logs() as logs,
            pytest.raises(grpc.RpcError) as err,
        ):
            channel.unary_unary(FORWARD)(_request(41, row=5), timeout=30)
    finally:
        executor.prepare = real_prepare  # type: ignore[method-assign]
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert _count(server, "Forward", "INTERNAL") == before + 1
    [line] = [line for line in logs if line["event"] == "request failed"]
    assert line["log_level"] == "error" and isinstance(line["exc_info"], ZeroDivisionError)
