"""The call path's hardening, each reproduction of the turn-4 review as a test: a client without
the token holds no handler thread whatever it withholds (H-3), the health port and health
Watch do not starve (M-4, M-5), a stream's late deferred masks do not hold the device (H-6),
tokens reload from their files (M-3) and the operator calls are closed without a credential."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor.batch_prep import make_extend_batch, make_idle_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.controls_types import DeferredMask, VocabMask, mask_words
from executor.service.auth import TokenCheck, TokenFile, UnauthenticatedError
from executor.service.deferred_masks import MaskWaitBudget
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from tests.server_util import Scrape, running_server, tiny_config

TOKEN = "call-token-of-the-scheduler"
STALLED = 200


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    d = tmp_path_factory.mktemp("callsec")
    (d / "token").write_text(TOKEN + "\n")
    with running_server(
        tiny_config(d / "cache", deferred_mask_timeout_s=3.0),
        call_token_file=str(d / "token"),
        health_port=0,
        deferred_mask_budget_s=0.3,
    ) as running:
        yield running


def _stalled(
    channels: list[grpc.Channel], method: str, n: int, token: str | None = None
) -> list[tuple[queue.Queue[bytes | None], grpc.Future]]:
    """`n` calls to a unary `method` that send their headers and never a body."""
    out = []
    metadata = [("authorization", f"Bearer {token}")] if token else None
    for i in range(n):
        raw = channels[i % len(channels)].stream_unary(
            method, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        outbox: queue.Queue[bytes | None] = queue.Queue()
        out.append((outbox, raw.future(iter(outbox.get, None), timeout=60, metadata=metadata)))
    return out


def _end(calls: list[tuple[queue.Queue[bytes | None], grpc.Future]]) -> None:
    for outbox, future in calls:
        future.cancel()
        outbox.put(None)


def _check(port: int, service: str = "") -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        answer = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=3
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def test_clients_without_the_token_hold_no_thread_whatever_they_withhold(
    guarded: RunningServer,
) -> None:
    """The review's pre-auth stall: 200 tokenless calls send headers and never a body (all 16
    handler threads, then all 64 RPC slots, were theirs). Each is refused from its metadata at
    once; an authenticated caller and both health ports are served meanwhile."""
    channels = [grpc.insecure_channel(f"127.0.0.1:{guarded.port}") for _ in range(4)]
    calls = _stalled(channels, "/model_executor.v1.ModelExecutor/GetInfo", STALLED // 2)
    calls += _stalled(channels, "/model_executor.v1.ModelExecutor/Forward", STALLED // 4)
    calls += _stalled(channels, "/grpc.health.v1.Health/Check", STALLED // 4)
    try:
        # Stalled callers that held the threads would hold them for good: these would time out
        # (the deadline is only there so a loaded machine's scheduling cannot fail the test).
        with ExecutorClient(f"127.0.0.1:{guarded.port}", token=TOKEN) as legit:
            assert legit.info(timeout=20).info.vocab_size == 512
            assert legit.health(timeout=20) == "SERVING"
            assert legit.forward(make_idle_batch(), timeout=20).next_token_ids.numel() == 0
        assert guarded.health_port is not None and _check(guarded.health_port) == "SERVING"
        for _, future in calls:  # refused at once, not left waiting for their body
            err = future.exception(timeout=10)
            assert isinstance(err, grpc.RpcError)
            assert err.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        _end(calls)
        for ch in channels:
            ch.close()


@pytest.mark.slow
def test_stalled_checks_do_not_starve_the_health_port(guarded: RunningServer) -> None:
    """The health port needs no credentials, so anyone who reaches it may stall Checks: on
    grpc.aio they hold no thread, and the kubelet's probe is still answered."""
    assert guarded.health_port is not None
    channels = [grpc.insecure_channel(f"127.0.0.1:{guarded.health_port}") for _ in range(4)]
    calls = _stalled(channels, "/grpc.health.v1.Health/Check", STALLED)
    try:
        time.sleep(0.5)
        assert not any(future.done() for _, future in calls)  # they really wait
        for service in ("", "model_executor.v1.ModelExecutor"):
            assert _check(guarded.health_port, service) == "SERVING"
    finally:
        _end(calls)
        for ch in channels:
            ch.close()


def test_health_watch_streams_hold_no_main_port_thread(guarded: RunningServer) -> None:
    """What gRPC client-side health checking opens: one Watch per subchannel. With the token
    check on, 24 of them (more than the 16 handler threads) leave GetInfo answered."""
    ch = grpc.insecure_channel(f"127.0.0.1:{guarded.port}")
    stub = health_pb2_grpc.HealthStub(ch)
    metadata = [("authorization", f"Bearer {TOKEN}")]
    watches = [
        stub.Watch(health_pb2.HealthCheckRequest(service=""), metadata=metadata, timeout=30)
        for _ in range(24)
    ]
    try:
        for w in watches:
            assert next(w).status == health_pb2.HealthCheckResponse.SERVING
        with ExecutorClient(f"127.0.0.1:{guarded.port}", token=TOKEN) as legit:
            t0 = time.monotonic()
            assert legit.info(timeout=3).info.vocab_size == 512
            assert time.monotonic() - t0 < 3
    finally:
        for w in watches:
            w.cancel()
        ch.close()


@pytest.mark.slow
def test_late_deferred_masks_do_not_hold_the_device_from_other_callers(
    guarded: RunningServer,
) -> None:
    """The review's slow stream: its masks come 1.5 s late, again and again, each on a new
    stream. Its waits are cut by its caller's budget (0.3 s per 5 s), counted, and answered
    DEADLINE_EXCEEDED; another caller's steps keep running meanwhile."""
    before = Scrape(guarded)
    with (
        ExecutorClient(f"127.0.0.1:{guarded.port}", token=TOKEN) as legit,
        ExecutorClient(f"127.0.0.1:{guarded.port}", token=TOKEN) as slow,
    ):
        vocab = slow.info().info.limits.vocab_size
        words = torch.full((1, mask_words(vocab)), -1, dtype=torch.int32)
        latencies: list[float] = []
        stop = threading.Event()

        def steps() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                legit.forward(make_idle_batch(), timeout=30)
                latencies.append(time.monotonic() - t0)

        worker = threading.Thread(target=steps)
        worker.start()
        codes = []
        t_start = time.monotonic()
        for k in range(3):
            session = slow.open_stream()
            batch = make_extend_batch(
                input_ids=[[5, 6, 7]], req_pool_indices=[10 + k],
                out_cache_loc=[[3000 + 10 * k + i for i in range(3)]],
            )  # fmt: skip
            bid = session.send(dataclasses.replace(batch, deferred_mask=DeferredMask(0)))
            time.sleep(1.5)
            session.send_mask(bid, VocabMask(words))
            try:
                session.recv()
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
            session.cancel()
        held = time.monotonic() - t_start
        stop.set()
        worker.join()
    assert codes == ["DEADLINE_EXCEEDED"] * 3, codes
    # the device waited at most the budget (0.3 s, then a trickle) in 4.5 s: the other
    # caller's steps went on, none of them held for a late mask's 1.5 s
    assert max(latencies) < 1.0 and len(latencies) > 10, (max(latencies), len(latencies))
    after = Scrape(guarded)
    cut = "model_executor_deferred_mask_waits_cut_total"
    assert after.get(cut) - before.get(cut) == 3
    waited = "model_executor_deferred_mask_wait_seconds_sum"
    # one budget for the caller however many streams it opens: 0.3 s, and its refill
    assert 0.25 < after.get(waited) - before.get(waited) < 0.3 + 0.3 * held / 5 + 0.1


def test_a_stream_mask_wait_budget_refills() -> None:
    clock = [0.0]
    seen: list[tuple[float, bool]] = []
    budget = MaskWaitBudget(1.0, lambda s, cut: seen.append((s, cut)), clock=lambda: clock[0])
    assert budget.grant(5.0) == 1.0
    budget.spend(0.8, cut=False)
    assert budget.grant(5.0) == pytest.approx(0.2)
    clock[0] += 2.5  # half the window: half the budget back
    assert budget.grant(5.0) == pytest.approx(0.7)
    clock[0] += 100.0
    assert budget.grant(0.05) == 0.05 and budget.grant(5.0) == 1.0
    assert seen == [(0.8, False)]


def test_token_files_name_callers_and_reload_on_change(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# two schedulers\nsched-a aaaa-token\nbbbb-token\n")
    clock = [0.0]
    tokens = TokenFile(str(path), "call_token_file", clock=lambda: clock[0])
    check = TokenCheck(tokens)
    assert check.check([("authorization", "Bearer aaaa-token")]) == "sched-a"
    assert check.check([("authorization", "Bearer bbbb-token")]) == ""
    assert tokens.named and tokens.first() == b"aaaa-token"
    path.write_text("sched-a cccc-token\n")  # rotated: a new file (inode, size, mtime)
    assert check.check([("authorization", "Bearer aaaa-token")]) == "sched-a"  # not yet read
    clock[0] += 2.0
    assert check.check([("authorization", "Bearer cccc-token")]) == "sched-a"
    with pytest.raises(UnauthenticatedError):
        check.check([("authorization", "Bearer aaaa-token")])
    path.write_text("")  # caught half-written: the previous tokens stay
    clock[0] += 2.0
    assert check.check([("authorization", "Bearer cccc-token")]) == "sched-a"
    assert tokens.reloads == 1


@pytest.mark.slow
def test_a_rotated_call_token_is_taken_without_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("old-token-value\n")
    with running_server(tiny_config(tmp_path), call_token_file=str(path)) as srv:
        target = f"127.0.0.1:{srv.port}"
        with ExecutorClient(target, token="old-token-value") as c:
            assert c.health() == "SERVING"
        path.write_text("new-token-value-longer\n")
        time.sleep(1.1)
        with ExecutorClient(target, token="new-token-value-longer") as c:
            assert c.health() == "SERVING"
        with ExecutorClient(target, token="old-token-value") as c, pytest.raises(grpc.RpcError):
            c.health()


@pytest.mark.slow
def test_the_operator_calls_are_closed_without_a_credential(tmp_path: Path) -> None:
    with (
        running_server(tiny_config(tmp_path), operator_calls_open=False) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        update = lambda: c.stub.UpdateRuntimeConfig(pb.UpdateRuntimeConfigRequest(), timeout=5)  # noqa: E731
        for call in (c.get_runtime_config, update):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "runtime_config_token_file" in (err.value.details() or "")
        assert c.info().runtime_config is None  # GetInfo keeps it to an operator
        assert c.health() == "SERVING"  # nothing else is closed
