"""Start-up, readiness, drain and SIGTERM: nothing accepted is ever dropped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2_grpc

import executor.service.server
from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.model_executor import ModelExecutor
from executor.service.server import start_server
from executor.service.server_config import ServerConfig
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import free_port, serve_command, tiny_config


def test_health_moves_not_serving_serving_not_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warmup_gate = threading.Event()

    class SlowToWarm(ModelExecutor):
        def warmup(self) -> None:
            warmup_gate.wait(30)
            super().warmup()

    monkeypatch.setattr(executor.service.server, "ModelExecutor", SlowToWarm)
    running = start_server(
        tiny_config(tmp_path), ServerConfig(port=0, metrics_port=0, drain_grace_s=10)
    )
    batch = make_extend_batch(input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[1, 2]])
    with ExecutorClient(f"127.0.0.1:{running.port}") as c:
        assert c.health("") == "SERVING"  # alive while loading
        assert c.health() == "NOT_SERVING"  # not ready
        with pytest.raises(grpc.RpcError) as err:
            c.forward(batch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()

        warmup_gate.set()
        c.wait_ready(timeout=30)
        assert c.health() == "SERVING"

        # Hold one batch on the device so that the drain has something to wait for.
        device_gate = threading.Event()
        assert running.worker is not None
        real_prepare = running.worker.executor.prepare

        def held(b, clock):  # type: ignore[no-untyped-def]
            device_gate.wait(30)
            return real_prepare(b, clock)

        running.worker.executor.prepare = held  # type: ignore[method-assign]
        with ThreadPoolExecutor(2) as pool:
            in_flight = pool.submit(c.forward, batch)
            while not running.worker._in_flight:
                time.sleep(0.01)
            drained = pool.submit(running.drain)
            while not running.servicer.draining.is_set():
                time.sleep(0.01)
            assert c.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                c.forward(
                    make_extend_batch(input_ids=[[3]], req_pool_indices=[2], out_cache_loc=[[9]])
                )
            assert (
                err.value.code() == grpc.StatusCode.UNAVAILABLE
                and "draining" in err.value.details()
            )
            device_gate.set()
            assert in_flight.result(timeout=30).next_token_ids.shape == (1,)  # accepted -> answered
            assert drained.result(timeout=30) is True


@pytest.mark.slow
def test_sigterm_finishes_every_accepted_batch_then_exits_zero(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = serve_command(
        port,
        tmp_path / "cache",
        *("--max-reqs", "16", "--kv-slots", "40000", "--max-context-len", "8192"),
        *("--drain-grace-s", "60", "--metrics-port", "0"),
        # Every accepted batch must finish however slow this machine is: no queue-wait bound
        # (test_wire_contract.py tests that bound).
        *("--queue-wait-s", "0"),
        # Eager steps only: at the defaults a compile worker would compile the bs-1 step
        # beside them (SIGTERM stopping a compile: tests/test_background_capture.py).
        *("--graph-mode", "none"),
    )
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as c:
            c.wait_ready(timeout=120)
            info = subprocess.run(
                [sys.executable, "-m", "executor", "info", "--target", f"127.0.0.1:{port}"],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            )
            assert json.loads(info.stdout)["readiness"] == "SERVING"
            n_tokens = (
                4000  # ~0.25 s each on 2 cores: six of them keep the device busy past SIGTERM
            )
            batches = [
                make_extend_batch(
                    input_ids=[[5] * n_tokens],
                    req_pool_indices=[r],
                    out_cache_loc=[list(range(1 + (r - 1) * n_tokens, 1 + r * n_tokens))],
                )
                for r in range(1, 7)
            ]
            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(c.forward, b) for b in batches]
                time.sleep(0.5)  # all six are accepted; most are still queued
                assert not all(f.done() for f in futures), (
                    "the work finished before SIGTERM; make it bigger"
                )
                proc.send_signal(signal.SIGTERM)
                results = [f.result(timeout=120) for f in futures]
            assert [r.next_token_ids.shape for r in results] == [(1,)] * 6
            with pytest.raises(grpc.RpcError) as err:  # nothing new is accepted
                c.forward(batches[0], timeout=10)
            # UNAVAILABLE from the draining servicer, or, once the drain has closed the port,
            # from the channel. In the moment between, while `server.stop` runs, gRPC itself
            # cancels calls that arrive (CANCELLED): refused all the same, never run.
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    events = [line["event"] for line in lines]
    assert "shutdown signal received" in events
    # The effective config is logged once, at start-up, with both halves.
    [starting] = [line for line in lines if line["event"] == "starting"]
    assert starting["executor_config"]["max_reqs"] == 16
    assert starting["server_config"]["metrics_port"] == 0
    assert all({"timestamp", "level"} <= set(line) for line in lines)
    drained = next(line for line in lines if line["event"] == "drained")
    assert drained["finished"] is True


@pytest.mark.slow
def test_the_health_port_answers_while_the_data_plane_is_saturated(tmp_path: Path) -> None:
    """Every handler thread of the main port held by calls that never finish (idle streams,
    reflection streams, unary calls whose body never arrives): the health-only server, with
    its own threads, still answers both probes within a second."""
    from tests.server_util import running_server

    config = tiny_config(tmp_path)
    with running_server(config, rpc_threads=3, max_forward_calls=2, health_port=0) as srv:
        assert srv.health_port is not None
        stop = threading.Event()

        def idle() -> Iterator[Any]:  # a stream that never sends anything
            stop.wait(30)
            yield from ()

        channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
        stub = pb_grpc.ModelExecutorStub(channel)
        calls = [stub.ForwardStream(idle()) for _ in range(2)]
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        watches = [reflection.ServerReflectionInfo(idle()) for _ in range(3)]
        # Unary calls whose body never comes: headers sent, the message never (a unary
        # method called as a client stream that yields nothing), each holding a thread.
        stalled_call = channel.stream_unary(
            "/model_executor.v1.ModelExecutor/GetInfo", request_serializer=None
        )
        stalled = [stalled_call.future(idle()) for _ in range(3)]
        time.sleep(0.5)  # the idle calls take their threads
        try:
            with ExecutorClient(f"127.0.0.1:{srv.port}") as main:  # the main port is starved
                with pytest.raises(grpc.RpcError) as err:
                    main.health("", timeout=1.0)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with ExecutorClient(f"127.0.0.1:{srv.health_port}") as probe:
                start = time.perf_counter()
                assert probe.health("", timeout=1.0) == "SERVING"
                assert probe.health(timeout=1.0) == "SERVING"
                assert time.perf_counter() - start < 1.0
        finally:
            stop.set()
            for c in calls:
                c.cancel()
            for w in watches:
                w.cancel()
            for f in stalled:
                f.cancel()
            channel.close()
