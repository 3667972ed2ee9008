"""The byte budget of queued and running batches: a burst of maximum-size batches against a
stalled device takes at most the budget; the rest is RESOURCE_EXHAUSTED before decode."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch

from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.forward_batch import ForwardBatch
from executor.service.admission import BatchClaim, ByteBudget, CapacityError
from executor.service.codec import batch_to_proto
from executor.service.wire_limits import batch_budget_bytes
from tests.server_util import running_server, tiny_config

TOKENS = 8192  # max_tokens_per_batch of the tiny config: the largest batch it takes


def _largest_batch() -> ForwardBatch:
    """All max_tokens_per_batch tokens (8 prompts of max_context_len), with client
    embeddings: about 2.2 MiB on the wire."""
    per = TOKENS // 8
    batch = make_extend_batch(
        input_ids=[[7] * per] * 8,
        req_pool_indices=list(range(1, 9)),
        out_cache_loc=[list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(8)],
    )
    return dataclasses.replace(batch, input_ids=None, input_embeds=torch.randn(TOKENS, 64))


@pytest.mark.slow
def test_a_burst_of_maximum_size_batches_stays_within_the_budget(tmp_path: Path) -> None:
    size = batch_to_proto(_largest_batch()).ByteSize()
    budget_mib = 6  # two of these batches fit, the third does not
    assert 2 * size <= budget_mib << 20 < 3 * size
    release = threading.Event()
    peak = [0]

    @contextmanager
    def stalled() -> Iterator[None]:  # the device holds the first batch until released
        release.wait(20)
        yield

    with running_server(tiny_config(tmp_path), batch_budget_mib=budget_mib) as srv:
        budget = srv.servicer.byte_budget
        assert budget.limit == budget_mib << 20 and srv.executor is not None
        srv.executor.hooks.device_step_guard = stalled
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                peak[0] = max(peak[0], budget.taken)
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ExecutorClient(f"127.0.0.1:{srv.port}") as c, ThreadPoolExecutor(10) as pool:

            def send(row: int) -> grpc.StatusCode:
                try:
                    c.forward(_largest_batch(), timeout=30)
                    return grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert "batch_budget_mib" in (exc.details() or "")
                    return exc.code()

            futures = [pool.submit(send, row) for row in range(1, 11)]
            try:
                # While the device is stalled, the batches beyond the budget are answered at once.
                deadline = time.monotonic() + 20
                while sum(f.done() for f in futures) < 8 and time.monotonic() < deadline:
                    time.sleep(0.01)
                early = [f.result() for f in futures if f.done()]
                assert early == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 8
                assert 2 * size < budget.taken <= budget.limit  # one running, one queued
            finally:
                release.set()  # (an assertion that failed above must not leave calls hanging)
                watching.set()
            codes = [f.result(timeout=60) for f in futures]
        watcher.join()
        assert peak[0] <= budget.limit
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 8  # only two fit at once
        assert codes.count(grpc.StatusCode.OK) >= 1
        assert budget.taken == 0  # every byte given back


def test_the_budget_takes_and_gives_back() -> None:
    budget = ByteBudget(100)
    budget.take(60, 1)
    with pytest.raises(CapacityError, match=r"batch_id 2 .*batch_budget_mib"):
        budget.take(41, 2)
    budget.take(40, 3)
    budget.give(60)
    budget.give(40)
    assert budget.taken == 0
    with pytest.raises(ValueError, match="exceeds"):
        budget.give(1)
    ByteBudget(0).take(1 << 40, 4)  # no budget: anything goes
    assert batch_budget_bytes(0, 5 << 20) == 0
    assert batch_budget_bytes(1, 5 << 20) == 5 << 20  # raised to one largest batch
    assert batch_budget_bytes(8, 5 << 20) == 8 << 20


class _Arrivals:
    def __init__(self, holds: bool) -> None:
        self.holds, self.arrived, self.left = holds, 0, 0

    def batch_arrived(self) -> bool:
        self.arrived += 1
        return self.holds

    def batch_left(self) -> None:
        self.left += 1


def test_batch_claim_gives_back_what_it_took_once_and_nothing_when_refused() -> None:
    budget, arrivals = ByteBudget(100), _Arrivals(holds=True)
    claim = BatchClaim(budget, lambda: 60, 1, arrivals)
    assert claim.holds and budget.taken == 60 and arrivals.arrived == 1
    with pytest.raises(CapacityError, match="batch_id 2"):  # 60 + 50 > 100
        BatchClaim(budget, lambda: 50, 2, arrivals)
    assert budget.taken == 60 and arrivals.arrived == 1  # the refused one holds nothing
    claim.end()
    assert budget.taken == 0 and arrivals.left == 1
    # No budget and nothing held back (off a CPU): nothing to give, no size asked for.
    unlimited = BatchClaim(ByteBudget(0), lambda: pytest.fail("sized"), 3, _Arrivals(False))
    assert not unlimited.holds
