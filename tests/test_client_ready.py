"""`ExecutorClient.wait_ready` against a server that is not listening yet, then not ready, then
ready: the client finds the port with a short reconnect backoff and follows the server's
readiness as it is pushed (health Watch), without polling `Check`."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from executor.client import grpc_client
from executor.client.grpc_client import READINESS_SERVICE, ExecutorClient
from tests.server_util import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class CountedHealth(health.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def Check(self, request: Any, context: Any) -> Any:
        self.checks += 1
        return super().Check(request, context)


def not_ready_server(port: int, servicer: health.HealthServicer) -> grpc.Server:
    """A started gRPC server on `port` with only `servicer`, readiness NOT_SERVING."""
    servicer.set(READINESS_SERVICE, NOT_SERVING)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def test_a_late_server_is_found_and_its_readiness_followed_as_pushed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options: list[dict[str, Any]] = []
    channel = grpc.insecure_channel

    def insecure_channel(target: str, options_: Any = None, **kw: Any) -> grpc.Channel:
        options.append(dict(kw.get("options") or options_ or []))
        return channel(target, options=kw.get("options") or options_)

    monkeypatch.setattr(grpc_client.grpc, "insecure_channel", insecure_channel)
    port = free_port()
    client = ExecutorClient(f"127.0.0.1:{port}")
    first, longest = grpc_client.RECONNECT_BACKOFF_MS
    assert options[0]["grpc.initial_reconnect_backoff_ms"] == first
    assert options[0]["grpc.max_reconnect_backoff_ms"] == longest
    done: list[float] = []

    def wait() -> None:
        client.wait_ready(timeout=60)
        done.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # nothing listens: the client's connects are refused
    assert not done
    servicer = CountedHealth()
    server = not_ready_server(port, servicer)
    try:
        time.sleep(0.5)
        assert not done  # listening, not ready
        servicer.set(READINESS_SERVICE, SERVING)
        waiter.join(30)
        assert done and servicer.checks == 0  # pushed, not polled
    finally:
        client.close()
        server.stop(None)


def test_a_server_never_ready_is_a_timeout_naming_its_last_status() -> None:
    port = free_port()
    server = not_ready_server(port, health.HealthServicer())
    try:
        with (
            ExecutorClient(f"127.0.0.1:{port}") as client,
            pytest.raises(TimeoutError, match="NOT_SERVING"),
        ):
            client.wait_ready(timeout=1.0)
    finally:
        server.stop(None)
