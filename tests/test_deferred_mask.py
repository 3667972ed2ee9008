"""The deferred vocab mask on ForwardStream: a batch sent with `vocab_mask_deferred` samples
under the mask that follows it on the same stream, and nothing else reaches it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch

from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient, ForwardSession
from executor.core.controls_types import DeferredMask, VocabMask
from executor.core.forward_batch import ForwardBatch
from executor.service.codec import batch_to_proto, tensor_to_proto
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from ops.logit_controls import pack_bitmask
from tests.server_util import running_server, tiny_config
from tests.state_util import state_digest

PROMPT = [5, 17, 33, 2, 400, 12, 17]
ALLOWED = [40, 41, 97, 300]
TIMEOUT_S = 1.0  # the server's deferred_mask_timeout_s
VOCAB = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    config = tiny_config(tmp_path_factory.mktemp("cache"), deferred_mask_timeout_s=TIMEOUT_S)
    # No mask-wait budget: these tests time the timeout itself (tests/test_call_security.py
    # tests the budget).
    with running_server(config, deferred_mask_budget_s=0) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[ExecutorClient]:
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        yield c


def _prefill(rows: Sequence[int], deferred: bool = False) -> ForwardBatch:
    """One request per row, each with its own KV slots (row r: slots 100r..)."""
    batch = make_extend_batch(
        input_ids=[PROMPT] * len(rows),
        req_pool_indices=list(rows),
        out_cache_loc=[list(range(100 * r, 100 * r + len(PROMPT))) for r in rows],
    )
    return dataclasses.replace(batch, deferred_mask=DeferredMask(0)) if deferred else batch


def _mask(rows: Sequence[int] | None, m: int) -> VocabMask:
    allowed = torch.zeros((m, VOCAB), dtype=torch.bool)
    allowed[:, ALLOWED] = True
    return VocabMask(
        pack_bitmask(allowed), None if rows is None else torch.tensor(rows, dtype=torch.int64)
    )


def _idle_digest(server: RunningServer) -> str:
    assert server.executor is not None and server.servicer.worker is not None
    assert server.servicer.worker.wait_idle(10)
    return state_digest(server.executor)


def test_a_late_mask_gives_the_tokens_of_the_same_mask_inline(client: ExecutorClient) -> None:
    """The mask comes 0.3 s after its batch, for the second request only (vocab_mask_rows):
    the tokens equal those of the same batch with the mask inline on unary Forward."""
    session = client.open_stream()
    batch_id = session.send(_prefill([1, 2], deferred=True))
    time.sleep(0.3)  # the device waits at sampling meanwhile
    session.send_mask(batch_id, _mask([1], 1))
    late = session.recv()
    session.close()
    inline = client.forward(dataclasses.replace(_prefill([3, 4]), vocab_mask=_mask([1], 1)))
    plain = client.forward(_prefill([5, 6]))
    assert late.next_token_ids.tolist() == inline.next_token_ids.tolist()
    assert int(late.next_token_ids[1]) in ALLOWED
    assert int(late.next_token_ids[0]) == int(plain.next_token_ids[0])  # unmasked row
    assert int(plain.next_token_ids[1]) not in ALLOWED  # so the mask did the work
    assert late.stats.control_rows.get("vocab_mask") == 1


@pytest.mark.slow
def test_a_mask_that_never_comes_fails_the_batch_and_applies_nothing(
    server: RunningServer, client: ExecutorClient
) -> None:
    before = _idle_digest(server)
    session = client.open_stream()
    batch = _prefill([7], deferred=True)
    batch_id = session.send(batch)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        session.recv()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (err.value.details() or "").startswith(f"batch_id {batch_id}: vocab_mask_deferred")
    assert time.monotonic() - t0 >= TIMEOUT_S * 0.9
    assert _idle_digest(server) == before  # the row table and the K/V as they were
    # Not applied, so a resend of the same batch under the same id runs (with its mask).
    again = client.open_stream()
    again.send(batch, batch_id=batch_id)
    again.send_mask(batch_id, _mask(None, 1))
    assert int(again.recv().next_token_ids[0]) in ALLOWED
    again.close()


def test_unary_forward_refuses_both_halves(client: ExecutorClient) -> None:
    deferred = pb.ForwardRequest(batch_id=11, batch=batch_to_proto(_prefill([8], deferred=True)))
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Forward(deferred)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocab_mask_deferred: is for ForwardStream only" in (err.value.details() or "")
    mask = _mask(None, 1)
    alone = pb.ForwardRequest(
        deferred_mask=pb.DeferredMask(batch_id=11, vocab_mask=tensor_to_proto(mask.words))
    )
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Forward(alone)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "deferred_mask: is for ForwardStream only" in (err.value.details() or "")


def test_a_mask_for_no_waiting_batch_is_ignored(client: ExecutorClient) -> None:
    session = client.open_stream()
    session.send_mask(987654321, _mask(None, 1))  # no such batch on this stream
    session.send(_prefill([9]))
    assert session.recv().next_token_ids.shape == (1,)
    session.close()


def test_a_retried_batch_gets_its_stored_answer_and_a_later_mask_is_ignored(
    client: ExecutorClient,
) -> None:
    first = client.open_stream()
    batch = _prefill([10], deferred=True)
    batch_id = first.send(batch)
    first.send_mask(batch_id, _mask(None, 1))
    answer = first.recv()
    first.close()
    retry = client.open_stream()
    retry.send(batch, batch_id=batch_id)  # answered from memory: it waits for no mask
    assert retry.recv().next_token_ids.tolist() == answer.next_token_ids.tolist()
    retry.send_mask(batch_id, _mask(None, 1))  # ignored, the stream goes on
    retry.send(_prefill([11]))
    assert retry.recv().next_token_ids.shape == (1,)
    retry.close()


@pytest.mark.parametrize(
    ("words", "code", "rule"),
    [
        ((40, 16), grpc.StatusCode.RESOURCE_EXHAUSTED, "must be <= max_batch_size rows"),
        ((1, 17), grpc.StatusCode.INVALID_ARGUMENT, "deferred_mask.vocab_mask"),
    ],
)
def test_a_refused_mask_ends_the_stream_at_once_and_applies_nothing(
    server: RunningServer,
    client: ExecutorClient,
    words: tuple[int, int],
    code: grpc.StatusCode,
    rule: str,
) -> None:
    """Oversized (refused from its header by the stream reader) or the wrong width (refused
    by the step): the waiting batch fails with the mask's status, well before the timeout."""
    before = _idle_digest(server)
    session = client.open_stream()
    batch_id = session.send(_prefill([12], deferred=True))
    t0 = time.monotonic()
    session.send_mask(batch_id, VocabMask(torch.full(words, -1, dtype=torch.int32)))
    with pytest.raises(grpc.RpcError) as err:
        session.recv()
    assert err.value.code() == code
    details = err.value.details() or ""
    assert details.startswith(f"batch_id {batch_id}: deferred_mask.vocab_mask") and rule in details
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    assert _idle_digest(server) == before


def test_a_stream_closed_before_the_mask_fails_its_batch_at_once(
    server: RunningServer, client: ExecutorClient
) -> None:
    before = _idle_digest(server)
    session = ForwardSession(client)
    batch_id = session.send(_prefill([13], deferred=True))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        session.close()  # half-closes, then drains the answers
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(f"batch_id {batch_id}: vocab_mask_deferred")
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    assert _idle_digest(server) == before


def test_a_mask_behind_a_full_window_of_batches_is_routed_when_read(
    server: RunningServer, client: ExecutorClient
) -> None:
    """The waiting batch and three more fill the stream's window (4): the mask, read after
    them, goes to the device at once instead of queueing behind batches that cannot run."""
    assert server.server_config.stream_window == 4
    session = client.open_stream()
    batch_id = session.send(_prefill([14], deferred=True))
    for row in (15, 16, 17):
        session.send(_prefill([row]))
    t0 = time.monotonic()
    session.send_mask(batch_id, _mask(None, 1))
    outs = [session.recv() for _ in range(4)]
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    assert int(outs[0].next_token_ids[0]) in ALLOWED
    session.close()


@pytest.mark.slow
def test_a_cancelled_stream_releases_the_device_waiting_for_a_mask(
    server: RunningServer, client: ExecutorClient
) -> None:
    """The caller goes away while its batch waits for a mask: the device stops waiting at
    once (not after the timeout) and applies nothing."""
    before = _idle_digest(server)
    session = client.open_stream()
    session.send(_prefill([18], deferred=True))
    time.sleep(0.1)  # the batch reaches the device and waits at sampling
    t0 = time.monotonic()
    session.cancel()
    assert server.servicer.worker is not None
    assert server.servicer.worker.wait_idle(TIMEOUT_S / 2)
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    assert _idle_digest(server) == before
