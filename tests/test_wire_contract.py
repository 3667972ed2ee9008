"""The wire contract under failure (issue 12), reproduced through the public RPCs.

Each test is the reproduction of one defect: a failed stream, a deadline, a drain, a retry,
a size claim. State is read from the live server's own row table (`resident_lens`): the
ground truth of what the executor applied.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
from executor.service.codec import batch_to_proto
from executor.service.server import DRAIN_MARGIN_S, SERVICE_NAME, RunningServer
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import Scrape, running_server, tiny_config


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tiny_config(tmp_path_factory.mktemp("cache"))) as running:
        yield running


def _resident(srv: RunningServer) -> np.ndarray:
    assert srv.worker is not None
    return srv.worker.executor.req_to_token_pool.resident_lens.copy()


class DeviceGate:
    """Holds every step on the device thread until opened; counts the steps that ran."""

    def __init__(self, srv: RunningServer) -> None:
        assert srv.worker is not None
        self.worker = srv.worker
        self.real = srv.worker.executor.prepare
        self.open = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    def __enter__(self) -> DeviceGate:
        def held(batch: ForwardBatch, clock: Any) -> Any:
            self.calls += 1
            self.entered.set()
            self.open.wait(30)
            return self.real(batch, clock)

        self.worker.executor.prepare = held  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.open.set()
        self.worker.wait_idle(30)
        self.worker.executor.prepare = self.real  # type: ignore[method-assign]


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def _extend(row: int, n: int, base: int) -> ForwardBatch:
    return make_extend_batch(
        input_ids=[[5 + i for i in range(n)]],
        req_pool_indices=[row],
        out_cache_loc=[list(range(base, base + n))],
    )


def _release(*rows: int) -> ForwardBatch:
    released = torch.tensor(rows, dtype=torch.int64)
    return dataclasses.replace(make_idle_batch(), released_req_pool_indices=released)


# --- 1. a failed batch ends its stream; nothing after it is applied -------------------------


@pytest.mark.parametrize("bad_at", range(4))
def test_nothing_after_a_failed_batch_on_a_stream_is_applied(
    server: RunningServer, bad_at: int
) -> None:
    """The issue's stream [extend row A, bad, extend row B, IDLE releasing A], with the bad
    batch at every position, ten times each: the client gets the answers before it, then
    INVALID_ARGUMENT naming the bad batch_id, and the server applied exactly those before."""
    a, b = 10 + bad_at * 2, 11 + bad_at * 2
    bad = make_extend_batch(input_ids=[[3, 4]], req_pool_indices=[0], out_cache_loc=[[9, 10]])
    for run in range(10):
        base = 1000 + 100 * (bad_at * 10 + run)
        good = [_extend(a, 3, base), _extend(b, 2, base + 10), _release(a)]
        batches = good[:bad_at] + [bad] + good[bad_at:]
        ids = [7_000_000 + 1000 * bad_at + 10 * run + i for i in range(len(batches))]
        requests = [
            pb.ForwardRequest(batch_id=i, batch=batch_to_proto(bt))
            for i, bt in zip(ids, batches, strict=True)
        ]
        answers = []
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.ModelExecutorStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                for response in stub.ForwardStream(iter(requests)):
                    answers.append(response.batch_id)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"batch_id {ids[bad_at]}" in err.value.details(), err.value.details()
        assert answers == ids[:bad_at]
        assert server.worker is not None
        server.worker.wait_idle(10)
        held = _resident(server)
        expected = {a: 0, b: 0}
        if bad_at > 0:
            expected[a] = 3
        if bad_at > 1:
            expected[b] = 2
        if bad_at > 2:
            expected[a] = 0
        assert {a: held[a], b: held[b]} == expected, f"run {run}: applied after the failure"
        with ExecutorClient(f"127.0.0.1:{server.port}") as c:
            c.forward(_release(a, b))


def test_a_batch_failing_on_the_device_stops_the_queued_ones_behind_it(
    server: RunningServer,
) -> None:
    """Deterministic version: the later batches are already queued when the bad one fails."""
    rows = [20, 21, 22]
    bad = make_extend_batch(input_ids=[[3]], req_pool_indices=[0], out_cache_loc=[[9]])
    batches = [_extend(rows[0], 2, 3000), bad, _extend(rows[1], 2, 3010), _release(rows[0])]
    with DeviceGate(server) as gate, ExecutorClient(f"127.0.0.1:{server.port}") as c:
        session = c.open_stream()
        for bt in batches:
            session.send(bt)
        assert server.worker is not None
        _wait(lambda: gate.entered.is_set() and server.worker is not None)
        _wait(lambda: server.worker is not None and server.worker.depth == 3)
        gate.open.set()
        assert session.recv().next_token_ids.shape == (1,)
        with pytest.raises(grpc.RpcError) as err:
            session.recv()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    held = _resident(server)
    assert (held[20], held[21]) == (2, 0)
    assert gate.calls == 2  # the first batch and the bad one; nothing behind it
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        c.forward(_release(20))


def test_a_cancelled_stream_applies_nothing_queued_behind_the_running_batch(
    server: RunningServer,
) -> None:
    rows = [14, 15, 16]
    with DeviceGate(server) as gate, ExecutorClient(f"127.0.0.1:{server.port}") as c:
        session = c.open_stream()
        for i, row in enumerate(rows):
            session.send(_extend(row, 2, 6000 + 10 * i))
        _wait(gate.entered.is_set)
        _wait(lambda: server.worker is not None and server.worker.depth == 2)
        session._responses.cancel()  # the scheduler gives up on the stream
        assert server.worker is not None
        queued = [j for j in list(server.worker._queue.queue) if j is not None]
        _wait(lambda: all(j.future.cancelled() for j in queued))  # the server saw it
        gate.open.set()
    held = _resident(server)
    assert [held[r] for r in rows] == [2, 0, 0]  # the running one finished; nothing after it
    assert gate.calls == 1
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        c.forward(_release(14))


# --- 2. deadlines and cancellation ----------------------------------------------------------


def test_a_forward_whose_deadline_passed_in_the_queue_is_not_applied(
    server: RunningServer,
) -> None:
    row = 25
    before = Scrape(server).get("model_executor_requests_total", method="Forward", code="OK")
    with (
        DeviceGate(server) as gate,
        ExecutorClient(f"127.0.0.1:{server.port}") as c,
        ThreadPoolExecutor(1) as pool,
    ):
        blocker = pool.submit(c.forward, _extend(24, 1, 3990))
        _wait(gate.entered.is_set)
        with pytest.raises(grpc.RpcError) as err:
            c.forward(_extend(row, 4, 4000), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.open.set()
        blocker.result(10)
    assert _resident(server)[row] == 0  # the client saw DEADLINE_EXCEEDED: nothing changed
    assert gate.calls == 1
    after = Scrape(server).get("model_executor_requests_total", method="Forward", code="OK")
    assert after == before + 1  # the blocker only
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        c.forward(_release(24))


def test_a_cancelled_forward_is_not_applied(server: RunningServer) -> None:
    row = 26

    def cancelled() -> float:
        return Scrape(server).get(
            "model_executor_requests_total", method="Forward", code="CANCELLED"
        )

    cancelled_before = cancelled()
    with (
        DeviceGate(server) as gate,
        ExecutorClient(f"127.0.0.1:{server.port}") as c,
        ThreadPoolExecutor(1) as pool,
    ):
        blocker = pool.submit(c.forward, _extend(24, 1, 4090))
        _wait(gate.entered.is_set)
        request = pb.ForwardRequest(batch_id=99, batch=batch_to_proto(_extend(row, 4, 4100)))
        call = c.stub.Forward.future(request)
        assert server.worker is not None
        _wait(lambda: server.worker is not None and server.worker.depth == 1)
        call.cancel()
        # The handler stops waiting at once (its job, not started, is dropped).
        _wait(lambda: cancelled() == cancelled_before + 1)
        gate.open.set()
        blocker.result(10)
    assert _resident(server)[row] == 0
    assert gate.calls == 1
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        c.forward(_release(24))


# --- 6. exactly-once retries ----------------------------------------------------------------


def test_a_retry_after_deadline_exceeded_gets_the_stored_answer(server: RunningServer) -> None:
    """The batch ran, its answer was lost to the deadline: the retry with the same batch_id
    gets that answer and applies nothing again."""
    row = 27
    batch = _extend(row, 3, 5000)
    with (
        DeviceGate(server) as gate,
        ExecutorClient(f"127.0.0.1:{server.port}") as c,
        ThreadPoolExecutor(1) as pool,
    ):
        lost = pool.submit(c.forward, batch, batch_id=424242, timeout=0.3)
        _wait(gate.entered.is_set)  # it is running: the deadline passes inside the step
        with pytest.raises(grpc.RpcError) as err:
            lost.result(10)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.open.set()
        assert server.worker is not None
        server.worker.wait_idle(10)
        assert _resident(server)[row] == 3  # it was applied
        first_calls = gate.calls
        replayed = Scrape(server).get("model_executor_batches_replayed_total")
        retry = c.forward(batch, batch_id=424242)
        assert gate.calls == first_calls  # not applied again
        assert Scrape(server).get("model_executor_batches_replayed_total") == replayed + 1
        decode = make_decode_batch(
            input_ids=[int(retry.next_token_ids[0])],
            req_pool_indices=[row],
            seq_lens=[4],
            out_cache_loc=[5003],
        )
        c.forward(decode, batch_id=424243)
        again = c.forward(batch, batch_id=424242)  # a late retry: still the stored answer
        assert again.next_token_ids.tolist() == retry.next_token_ids.tolist()
        assert _resident(server)[row] == 4  # the EXTEND retry did not rewind the row
        with pytest.raises(grpc.RpcError) as err:  # the same id on a different batch
            c.forward(_extend(row, 2, 5100), batch_id=424242)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch_id" in err.value.details() and "different batch" in err.value.details()
        c.forward(_release(row))


def test_batch_id_zero_opts_out_of_the_retry_memory(server: RunningServer) -> None:
    row = 28
    with DeviceGate(server) as gate, ExecutorClient(f"127.0.0.1:{server.port}") as c:
        gate.open.set()
        request = pb.ForwardRequest(batch_id=0, batch=batch_to_proto(_extend(row, 2, 5200)))
        c.stub.Forward(request)
        c.stub.Forward(request)
        assert gate.calls == 2
        c.forward(_release(row))


# --- 3. drain -------------------------------------------------------------------------------


@pytest.mark.slow
def test_drain_answers_what_is_left_at_the_end_of_the_grace_and_returns(tmp_path: Path) -> None:
    """A step outlives the grace with four jobs queued behind it: each queued one is answered
    UNAVAILABLE (not run), the running one's caller stops waiting, and drain() returns
    within the grace plus a bounded margin."""
    grace = 0.5
    with running_server(tiny_config(tmp_path)) as srv:
        gate = DeviceGate(srv).__enter__()
        try:
            with ExecutorClient(f"127.0.0.1:{srv.port}") as c, ThreadPoolExecutor(5) as pool:
                calls = [pool.submit(c.forward, _extend(r, 1, 100 * r)) for r in range(1, 6)]
                assert srv.worker is not None
                _wait(lambda: srv.worker is not None and srv.worker.depth == 4)
                t0 = time.monotonic()
                assert srv.drain(grace) is False
                took = time.monotonic() - t0
                assert took < grace + DRAIN_MARGIN_S + 1.5, took
                codes = []
                for call in calls:
                    with pytest.raises(grpc.RpcError) as err:
                        call.result(10)
                    codes.append(err.value.code())
                assert codes == [grpc.StatusCode.UNAVAILABLE] * 5
            assert gate.calls == 1  # the queued ones never ran
        finally:
            gate.open.set()


@pytest.mark.slow
def test_a_batch_decoded_while_the_drain_starts_is_answered_not_stranded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's drain race: a handler passed the readiness check, then the drain found the
    worker idle and put its stop marker in; the handler's job, queued behind the marker, was
    never answered and its thread waited forever. Now it is refused (UNAVAILABLE)."""
    import executor.service.servicer as servicer_module

    decoding, release = threading.Event(), threading.Event()
    real_decode = servicer_module.batch_from_proto

    def slow_decode(msg: pb.ForwardBatch, limits: object = None, **kw: Any) -> ForwardBatch:
        decoding.set()
        release.wait(30)
        return real_decode(msg, limits, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(servicer_module, "batch_from_proto", slow_decode)
    with (
        running_server(tiny_config(tmp_path)) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
        ThreadPoolExecutor(2) as pool,
    ):
        call = pool.submit(c.forward, _extend(1, 1, 1))
        assert decoding.wait(10)
        drained = pool.submit(srv.drain, 5.0)
        _wait(srv.servicer.draining.is_set)
        time.sleep(0.2)  # the drain found nothing in flight and closed the worker
        release.set()
        with pytest.raises(grpc.RpcError) as err:
            call.result(10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert drained.result(10) is True
        assert _resident(srv)[1] == 0


def test_readiness_never_returns_to_serving_once_draining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's "attach, then SERVING unless draining" against a drain that starts
    between the check and the set: the lock makes it one or the other."""
    import executor.service.server as server_module
    from executor.model_executor import ModelExecutor
    from executor.service.server import start_server
    from executor.service.server_config import ServerConfig

    warm = threading.Event()

    class SlowToWarm(ModelExecutor):
        def warmup(self) -> None:
            warm.wait(30)
            super().warmup()

    monkeypatch.setattr(server_module, "ModelExecutor", SlowToWarm)
    running = start_server(tiny_config(tmp_path), ServerConfig(port=0, metrics_port=0))
    drained = ThreadPoolExecutor(1).submit(running.drain, 5.0)
    _wait(running.servicer.draining.is_set)
    warm.set()  # the model finishes loading after the drain began
    assert running.ready.wait(30)
    assert running.worker is None  # never attached: no batch can reach it
    assert drained.result(30) is True
    check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    status = running.health.Check(check, None).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_nothing_is_accepted_after_the_stop_marker(tmp_path: Path) -> None:
    with running_server(tiny_config(tmp_path)) as srv:
        assert srv.worker is not None
        srv.worker.close()  # the marker: a handler that passed the draining check is refused too
        with ExecutorClient(f"127.0.0.1:{srv.port}") as c:
            with pytest.raises(grpc.RpcError) as err:
                c.forward(_extend(1, 1, 1))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _resident(srv)[1] == 0


# --- 4/5. cheap refusals and limits ---------------------------------------------------------


def _raw(srv: RunningServer, batch: pb.ForwardBatch) -> grpc.RpcError:
    with (
        grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        pb_grpc.ModelExecutorStub(channel).Forward(pb.ForwardRequest(batch_id=11, batch=batch))
    return err.value


def test_a_batch_size_claim_is_refused_before_anything_is_built(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100,000 sampling entries (the issue's 880,000-request message, smaller): refused from
    the repeated field's length, without building one SamplingParams."""
    import executor.service.codec as codec

    built = []
    real = codec.SamplingParams
    monkeypatch.setattr(codec, "SamplingParams", lambda **kw: built.append(1) or real(**kw))
    msg = batch_to_proto(_extend(1, 1, 1))
    for _ in range(100_000):
        msg.sampling_params.add(temperature=0.5)
    err = _raw(server, msg)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "sampling_params" in err.details() and "max_batch_size (32)" in err.details()
    msg = batch_to_proto(_extend(1, 1, 1))
    msg.req_pool_indices.data = b"\x01" + bytes(8 * 40 - 1)
    msg.req_pool_indices.shape[:] = [40]
    err = _raw(server, msg)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "req_pool_indices" in err.details()
    assert built == []


@pytest.mark.parametrize(
    ("shape", "rule"),
    [([2**32, 2**32], "data has 0 bytes"), ([1] * 9, "rank must be <= 8"), ([-1], "non-negative")],
)
def test_impossible_shapes_are_invalid_argument(
    server: RunningServer, shape: list[int], rule: str
) -> None:
    msg = batch_to_proto(_extend(1, 1, 1))
    msg.input_ids.shape[:] = shape  # used to overflow np.prod to 0 elements, then INTERNAL
    msg.input_ids.data = b""
    err = _raw(server, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "input_ids" in err.details() and rule in err.details(), err.details()


def test_top_logprobs_num_is_capped_and_the_cap_is_in_get_info(tmp_path: Path) -> None:
    from executor.service.server import message_limits

    with running_server(tiny_config(tmp_path, max_top_logprobs=3)) as srv:
        with ExecutorClient(f"127.0.0.1:{srv.port}") as c:
            assert c.info().info.limits.max_top_logprobs == 3
            batch = make_extend_batch(
                input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[1, 2]], top_logprobs_num=3
            )
            out = c.forward(batch)
            assert out.top_logprob_ids is not None and out.top_logprob_ids.shape == (1, 3)
        msg = batch_to_proto(_extend(2, 1, 10))
        msg.top_logprobs_num = 512  # the whole vocabulary: a 122x larger answer than asked
        err = _raw(srv, msg)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_logprobs_num" in err.details() and "0..3" in err.details()
    # The send limit follows the cap, not the vocabulary.
    cfg = tiny_config(tmp_path)
    _, send20 = message_limits(cfg, 64, 152_000, 1024)
    _, send40 = message_limits(cfg.replace(max_top_logprobs=40), 64, 152_000, 1024)
    assert send40 - send20 == cfg.max_reqs * 20 * 12
    # was bs * vocab * 12 bytes: 55 MiB for this vocabulary; the extra outputs have their own cap
    assert send20 - BatchLimits.max_output_bytes < 8 << 20


def test_a_tiny_temperature_is_greedy(tmp_path: Path) -> None:
    from executor.core.forward_batch import SamplingParams
    from executor.model_executor import ModelExecutor

    ex = ModelExecutor(tiny_config(tmp_path))
    prompt = [[7, 8, 9, 10]]
    greedy = ex.forward(
        make_extend_batch(input_ids=prompt, req_pool_indices=[1], out_cache_loc=[[1, 2, 3, 4]]),
        return_logits=True,
    )
    assert greedy.logits is not None
    for temperature in (1e-38, 1e-6):
        out = ex.forward(
            make_extend_batch(
                input_ids=prompt,
                req_pool_indices=[2],
                out_cache_loc=[[5, 6, 7, 8]],
                sampling=[SamplingParams(temperature=temperature)],
            )
        )
        assert out.next_token_ids.tolist() == [int(greedy.logits[0].argmax())], temperature
        assert int(out.next_token_ids[0]) != 511  # the issue: the last vocabulary id


# --- 7. KV slot ownership and positions -----------------------------------------------------


@pytest.mark.slow
def test_a_new_token_may_not_overwrite_a_slot_a_live_row_holds(tmp_path: Path) -> None:
    """The issue's reproduction: a token written into another live request's prefix slot
    was accepted and changed that request's next token. Now refused, naming slot and
    holder (the holder's row and position only with detailed_refusals: by default a caller
    never learns where other requests keep their KV); shared prefix reads stay allowed; a
    slot is free again once no row holds it."""
    with (
        running_server(tiny_config(tmp_path)) as plain,
        ExecutorClient(f"127.0.0.1:{plain.port}") as c,
    ):
        c.forward(_extend(1, 4, 101))
        with pytest.raises(grpc.RpcError) as err:
            c.forward(_extend(2, 2, 102))
        assert "slot 102 holds the KV of a live request" in err.value.details()
        assert "row 1" not in err.value.details() and "position" not in err.value.details()
    config = tiny_config(tmp_path, detailed_refusals=True)
    with running_server(config) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as c:
        first = c.forward(_extend(1, 4, 101))  # row 1 holds slots 101..104
        decode_row1 = make_decode_batch(
            input_ids=[int(first.next_token_ids[0])],
            req_pool_indices=[1],
            seq_lens=[5],
            out_cache_loc=[105],
        )
        expected = ModelExecutorRef(tmp_path).run([_extend(1, 4, 101), decode_row1])

        def refused(batch: ForwardBatch, *needles: str) -> None:
            before = _resident(srv)
            with pytest.raises(grpc.RpcError) as err:
                c.forward(batch)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for needle in needles:
                assert needle in err.value.details(), err.value.details()
            assert (_resident(srv) == before).all()

        # Another row writes a new token into row 1's prefix slot 102.
        refused(_extend(2, 2, 102), "out_cache_loc[0]", "slot 102", "row 1 at position 1")
        # Row 1 itself writes its next token into its own prefix.
        own = make_decode_batch(
            input_ids=[7], req_pool_indices=[1], seq_lens=[5], out_cache_loc=[103]
        )
        refused(own, "slot 103", "own prefix")
        # Reading row 1's slots as a shared prefix is fine.
        shared = make_extend_batch(
            input_ids=[[9]],
            req_pool_indices=[3],
            out_cache_loc=[[200]],
            prefix_lens=[4],
            prefix_cache_loc=[[101, 102, 103, 104]],
        )
        c.forward(shared)
        # Row 1's next token is what it would have been: nothing above touched its KV.
        assert c.forward(decode_row1).next_token_ids.tolist() == expected
        # Row 1 released: row 3 still holds 101..104 through its prefix.
        c.forward(_release(1))
        refused(_extend(4, 1, 102), "slot 102", "row 3 at position 1")
        c.forward(_release(3))
        c.forward(_extend(4, 1, 102))  # nobody holds it now
        # A row rewound and re-extended over its own positions may reuse their slots.
        c.forward(_extend(5, 3, 300))
        rewind = make_extend_batch(
            input_ids=[[1, 2]], req_pool_indices=[5], out_cache_loc=[[301, 302]], prefix_lens=[1]
        )
        c.forward(rewind)
        assert _resident(srv)[5] == 3


class ModelExecutorRef:
    """The same steps in process: the tokens a remote run must reproduce."""

    def __init__(self, tmp_path: Path) -> None:
        from executor.model_executor import ModelExecutor

        self.ex = ModelExecutor(tiny_config(tmp_path))

    def run(self, batches: list[ForwardBatch]) -> list[int]:
        out = None
        for b in batches:
            out = self.ex.forward(b)
        assert out is not None
        return [int(t) for t in out.next_token_ids]


@pytest.mark.slow
def test_explicit_positions_must_be_the_derived_ones(tmp_path: Path) -> None:
    """`positions=[900]` with `seq_lens=[5]` was accepted and changed the token."""
    with running_server(tiny_config(tmp_path)) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as c:
        c.forward(_extend(1, 4, 1))
        decode = make_decode_batch(
            input_ids=[7], req_pool_indices=[1], seq_lens=[5], out_cache_loc=[5]
        )
        wrong = dataclasses.replace(decode, positions=torch.tensor([900]))
        with pytest.raises(grpc.RpcError) as err:
            c.forward(wrong)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "positions[0]: must be 4" in err.value.details()
        assert _resident(srv)[1] == 4
        right = dataclasses.replace(decode, positions=torch.tensor([4]))
        assert c.forward(right).next_token_ids.shape == (1,)  # the derived one is accepted
        assert _resident(srv)[1] == 5
    with (
        running_server(tiny_config(tmp_path, allow_custom_positions=True)) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        c.forward(_extend(1, 4, 1))
        assert c.forward(wrong).next_token_ids.shape == (1,)  # the start-up flag allows it


def test_a_failed_step_leaves_the_owner_map_exactly_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from executor.model_executor import ModelExecutor

    ex = ModelExecutor(tiny_config(tmp_path))
    ex.forward(_extend(1, 4, 1))
    ex.forward(_extend(2, 3, 10))
    owners = ex.req_to_token_pool.owners
    assert owners is not None
    table, refs = owners.table.copy(), owners.refs.copy()

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("device fault")

    monkeypatch.setattr(ex.runner, "forward", broken)
    step = dataclasses.replace(
        make_extend_batch(
            input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[20, 21]], prefix_lens=[2]
        ),
        released_req_pool_indices=torch.tensor([2]),
    )
    with pytest.raises(RuntimeError, match="device fault"):
        ex.forward(step)  # releases row 2, rewinds row 1 to 2 tokens, writes 2: all undone
    assert (owners.table == table).all() and (owners.refs == refs).all()
    monkeypatch.undo()
    ex.forward(step)
    assert owners.refs[[3, 4, 10, 11, 12]].tolist() == [0, 0, 0, 0, 0]  # dropped
    assert owners.refs[[1, 2, 20, 21]].tolist() == [1, 1, 1, 1]


def test_a_failing_post_step_hook_does_not_report_an_applied_batch_as_failed(
    tmp_path: Path,
) -> None:
    with running_server(tiny_config(tmp_path)) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as c:
        assert srv.worker is not None

        def broken_hook(stats: object) -> None:
            raise RuntimeError("metrics backend fault")

        srv.worker.on_step = broken_hook
        out = c.forward(_extend(1, 3, 1))  # applied: the answer says so
        assert out.next_token_ids.shape == (1,)
        assert _resident(srv)[1] == 3


# --- 4. capacity ----------------------------------------------------------------------------


def test_open_streams_never_starve_health_or_get_info(tmp_path: Path) -> None:
    """The issue: 16 idle streams held all 16 handler threads and readiness timed out. With
    6 threads, at most 4 Forward/ForwardStream calls are admitted; the rest are refused at
    once, and health and GetInfo keep answering."""
    with (
        running_server(tiny_config(tmp_path), rpc_threads=6) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        sessions = [c.open_stream() for _ in range(10)]
        calls = [s._responses for s in sessions]
        _wait(lambda: sum(call.done() for call in calls) == 6)
        refused = [call for call in calls if call.done()]
        assert {call.code() for call in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "max_forward_calls" in refused[0].details()
        assert c.health(timeout=2) == "SERVING"
        assert c.info(timeout=2).info.vocab_size == 512
        with pytest.raises(grpc.RpcError) as err:  # a unary Forward is refused, not left waiting
            c.forward(_extend(1, 1, 1), timeout=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in sessions:
            s._outbox.put(s._END)
        _wait(lambda: all(call.done() for call in calls))
        assert c.forward(_extend(1, 1, 1)).next_token_ids.shape == (1,)  # places are given back


@pytest.mark.slow
def test_an_idle_stream_is_closed_and_a_busy_one_is_not(tmp_path: Path) -> None:
    with (
        running_server(tiny_config(tmp_path), stream_idle_timeout_s=0.5) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        busy = c.open_stream()
        for step in range(4):  # each step well inside the idle timeout
            busy.send(_extend(1 + step, 1, 1 + step))
            assert busy.recv().next_token_ids.shape == (1,)
            time.sleep(0.2)
        busy.close()
        idle = c.open_stream()
        with pytest.raises(grpc.RpcError) as err:
            idle.recv()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stream_idle_timeout_s" in err.value.details()


def test_unary_back_pressure_fires_when_the_device_is_behind(tmp_path: Path) -> None:
    """The issue: a flood of Forwards all waited and RESOURCE_EXHAUSTED never fired. A batch
    still queued after queue_wait_s is dropped (never run) and answered RESOURCE_EXHAUSTED."""
    with running_server(tiny_config(tmp_path), queue_wait_s=0.3) as srv:
        with (
            DeviceGate(srv) as gate,
            ExecutorClient(f"127.0.0.1:{srv.port}") as c,
            ThreadPoolExecutor(1) as pool,
        ):
            running = pool.submit(c.forward, _extend(1, 1, 1))
            _wait(gate.entered.is_set)
            with pytest.raises(grpc.RpcError) as err:
                c.forward(_extend(2, 2, 10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue_wait_s" in err.value.details()
            gate.open.set()
            assert running.result(10).next_token_ids.shape == (1,)  # running: always answered
        assert _resident(srv)[2] == 0 and gate.calls == 1


@pytest.mark.slow
def test_the_reference_scheduler_retries_with_the_same_batch_id(tmp_path: Path) -> None:
    """Every step's first answer is lost to a deadline while the step runs; the scheduler's
    retries under the same batch_id get the stored answers: the same tokens as in process,
    and each step applied exactly once."""
    from executor.client.scheduler import ReferenceScheduler, generate
    from executor.model_executor import ModelExecutor

    prompts = [[5, 6, 7], [40, 41]]
    ex = ModelExecutor(tiny_config(tmp_path))
    expected = generate(ex.forward, ex.limits, prompts, max_new_tokens=4, ignore_eos=True)
    with running_server(tiny_config(tmp_path)) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as c:
        assert srv.worker is not None
        real = srv.worker.executor.prepare
        applied: list[int] = []

        def slow(batch: ForwardBatch, clock: Any) -> Any:
            applied.append(batch.batch_size)
            time.sleep(0.4)  # longer than the call's deadline: the first answer is lost
            return real(batch, clock)

        srv.worker.executor.prepare = slow  # type: ignore[method-assign]
        remote = c.info()
        sched = ReferenceScheduler(
            c.retrying(timeout=0.25, attempts=8, backoff_s=0.05),
            remote.info.limits,
            remote.info.eos_token_ids,
        )
        reqs = [sched.add_request(p, max_new_tokens=4, ignore_eos=True) for p in prompts]
        steps = 0
        while sched.has_work():
            sched.step()
            steps += 1
        assert [r.output_ids for r in reqs] == expected
        assert len(applied) == steps  # one application per step, whatever the retries
