"""Injected faults (executor/errors.py) on a live server: the model's forward, the sampler or
the response encoder raises on a chosen step. The answer is INTERNAL, the server stays
SERVING, and the tokens afterwards are those of a run without the fault; for faults inside
the step the row table, resident lengths and K/V of live rows are exactly as before."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.errors import FaultInjector
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor
from executor.service.server import RunningServer
from tests.server_util import running_server, tiny_config
from tests.state_util import state_digest

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=7)]
STEPS = 6  # one EXTEND, then DECODE steps


class Script:
    """Two requests (one greedy, one seeded sampling) on `rows`, slots from `slot_base`."""

    def __init__(self, rows: list[int], slot_base: int) -> None:
        self.rows, self.next_slot = rows, slot_base
        self.tokens: list[list[int]] = [[], []]
        self.lens = [0, 0]

    def batch(self) -> ForwardBatch:
        if not self.lens[0]:
            locs, slot = [], self.next_slot
            for p in PROMPTS:
                locs.append(list(range(slot, slot + len(p))))
                slot += len(p)
            return make_extend_batch(
                input_ids=PROMPTS, req_pool_indices=self.rows, out_cache_loc=locs, sampling=SAMPLING
            )
        return make_decode_batch(
            input_ids=[t[-1] for t in self.tokens],
            req_pool_indices=self.rows,
            seq_lens=[n + 1 for n in self.lens],
            out_cache_loc=[self.next_slot, self.next_slot + 1],
            sampling=SAMPLING,
        )

    def accept(self, out: ForwardOutput) -> None:
        new = [len(p) for p in PROMPTS] if not self.lens[0] else [1, 1]
        self.next_slot += sum(new)
        self.lens = [n + k for n, k in zip(self.lens, new, strict=True)]
        for toks, t in zip(self.tokens, out.next_token_ids.tolist(), strict=True):
            toks.append(int(t))


def run(forward: Callable[[ForwardBatch], ForwardOutput], script: Script) -> list[list[int]]:
    for _ in range(STEPS):
        script.accept(forward(script.batch()))
    return script.tokens


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    executor = ModelExecutor(tiny_config(tmp_path_factory.mktemp("ref")))
    return run(executor.forward, Script([1, 2], 1))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tiny_config(tmp_path_factory.mktemp("cache"))) as running:
        yield running


CASES = [("forward", 0), ("forward", 3), ("sampler", 0), ("sampler", 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "site", "fault_step"), [(i, *c) for i, c in enumerate(CASES)])
def test_a_fault_inside_the_step_is_internal_and_leaves_nothing_behind(
    server: RunningServer, expected: list[list[int]], case: int, site: str, fault_step: int
) -> None:
    assert server.worker is not None
    executor = server.worker.executor
    faults = FaultInjector()
    executor.hooks.faults = faults
    script = Script([1 + 2 * case, 2 + 2 * case], 1 + 1000 * case)  # rows and slots of its own
    try:
        with ExecutorClient(f"127.0.0.1:{server.port}") as client:
            for step in range(STEPS):
                batch = script.batch()
                if step == fault_step:
                    before = state_digest(executor)
                    faults.arm(site)
                    with pytest.raises(grpc.RpcError) as err:
                        client.forward(batch)
                    assert err.value.code() == grpc.StatusCode.INTERNAL
                    assert f"injected {site} fault" in err.value.details()
                    assert state_digest(executor) == before  # rows, lengths, live K/V
                    assert client.health() == "SERVING"
                script.accept(client.forward(batch))  # the scheduler retries the same batch
    finally:
        executor.hooks.faults = None
    assert faults.fired == [site]
    assert script.tokens == expected


def test_an_encoder_fault_is_internal_and_the_server_keeps_serving(
    server: RunningServer, expected: list[list[int]]
) -> None:
    faults = FaultInjector()
    server.servicer.faults = faults
    try:
        with ExecutorClient(f"127.0.0.1:{server.port}") as client:
            doomed = Script([30, 31], 6000)
            faults.arm("encoder")
            with pytest.raises(grpc.RpcError) as err:
                client.forward(doomed.batch())
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "injected encoder fault" in err.value.details()
            assert client.health() == "SERVING"
            # On a stream: the first answer arrives, the second's encoding fails: INTERNAL.
            faults.arm("encoder", on_call=2)
            answers = client.stream(
                iter([Script([24, 25], 6100).batch(), Script([26, 27], 6200).batch()])
            )
            assert next(answers).next_token_ids.shape == (2,)
            with pytest.raises(grpc.RpcError) as err:
                next(answers)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert client.health() == "SERVING"
            # Fresh requests afterwards get the fault-free tokens.
            assert run(client.forward, Script([28, 29], 6300)) == expected
    finally:
        server.servicer.faults = None
    assert faults.fired == ["encoder", "encoder"]


def test_fault_sites_are_checked() -> None:
    faults = FaultInjector()
    with pytest.raises(ValueError, match="site must be one of"):
        faults.arm("tokenizer")
    with pytest.raises(ValueError, match="on_call"):
        faults.arm("forward", on_call=0)
