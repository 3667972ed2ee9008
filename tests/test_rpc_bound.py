"""max_concurrent_rpcs: calls beyond it are refused at once (RESOURCE_EXHAUSTED), not queued
without bound behind handler threads that idle streams and stalled bodies hold."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from executor.service.server_config import ServerConfig
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import running_server, tiny_config


@pytest.mark.slow
def test_calls_beyond_the_bound_are_refused_at_once(tmp_path: Path) -> None:
    stop = threading.Event()

    def idle() -> Iterator[bytes]:
        stop.wait(30)
        yield from ()

    with running_server(
        tiny_config(tmp_path), rpc_threads=3, max_forward_calls=2, max_concurrent_rpcs=4
    ) as srv:
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
        stalled = channel.stream_unary(
            "/model_executor.v1.ModelExecutor/GetInfo", request_serializer=None
        )
        held = [stalled.future(idle()) for _ in range(4)]  # 3 on threads, 1 waiting for one
        time.sleep(0.5)
        try:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ModelExecutorStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - start < 1.0  # refused, not queued until the deadline
        finally:
            stop.set()
            for f in held:
                f.cancel()
            channel.close()


def test_the_bound_is_checked() -> None:
    assert ServerConfig().concurrent_rpcs == 4 * ServerConfig().rpc_threads
    assert ServerConfig(rpc_threads=4, max_concurrent_rpcs=10).concurrent_rpcs == 10
    with pytest.raises(ValueError, match="max_concurrent_rpcs"):
        ServerConfig(rpc_threads=4, max_concurrent_rpcs=3)
