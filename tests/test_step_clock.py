"""`StepClock`: host timers on CPU; on CUDA the forward and sample phases timed by device
events (a fake event class stands in for `torch.cuda.Event`), so GPU time lands in the phase
that spent it, read after the step."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
import torch

from executor.core.clock import StepClock


class FakeEvent:
    """A timing event on a fake stream: `record` stamps the stream's time; `synchronize`
    counts the waits (the stream's time is fixed by the test, as a GPU's would be)."""

    stream_ms = 0.0
    made: ClassVar[list[FakeEvent]] = []

    def __init__(self) -> None:
        self.at: float | None = None
        self.synced = 0
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.at = FakeEvent.stream_ms

    def synchronize(self) -> None:
        self.synced += 1

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.at is not None and end_event.at is not None
        return end_event.at - self.at


@pytest.fixture(autouse=True)
def fresh_events() -> None:
    FakeEvent.stream_ms = 0.0
    FakeEvent.made = []


def test_device_phases_take_the_stream_time_between_their_events() -> None:
    clock = StepClock(events=FakeEvent)
    with clock.phase("total"):
        with clock.phase("validate"):
            pass
        with clock.phase("forward"):
            FakeEvent.stream_ms += 7.5  # the GPU ran the forward's kernels for 7.5 ms
        with clock.phase("sample"):
            FakeEvent.stream_ms += 0.25
    # The host saw the forward as a quick enqueue; the events give the GPU its 7.5 ms.
    assert clock.durations_ns["forward"] == 7_500_000
    assert clock.durations_ns["sample"] == 250_000
    assert set(clock.durations_ns) == {"total", "validate", "forward", "sample"}
    assert set(clock.started_ns) == set(clock.durations_ns)
    assert len(FakeEvent.made) == 4  # two a device phase, none for host phases
    assert [e.synced for e in FakeEvent.made] == [0, 1, 0, 1]  # each end once, when read


def test_a_failed_device_phase_is_not_recorded_and_a_phase_is_recorded_once() -> None:
    clock = StepClock(events=FakeEvent)
    with pytest.raises(RuntimeError), clock.phase("forward"):
        raise RuntimeError("boom")
    assert clock.durations_ns == {}
    with clock.phase("sample"):
        pass
    with pytest.raises(ValueError, match="'sample' was already recorded"), clock.phase("sample"):
        pass


def test_cpu_steps_keep_the_host_clock() -> None:
    clock = StepClock()
    clock.use_device_events(torch.device("cpu"))
    assert clock.events is None
    with clock.phase("forward"):
        time.sleep(0.002)
    assert clock.durations_ns["forward"] >= 2_000_000
    clock.use_device_events(torch.device("cuda", 0))  # no CUDA needed to choose events
    assert clock.events is not None


@pytest.mark.gpu
def test_a_cuda_step_times_its_forward_on_the_device(make_executor: Any) -> None:
    """On CUDA the forward phase is the GPU's time (events), not the enqueue: it is the
    larger part of the step on a model whose kernels outlast their launches."""
    from executor.batch_prep import make_extend_batch

    ex = make_executor(device="cuda", dtype="float32", graph_mode="none")
    batch = make_extend_batch(
        input_ids=[[3 + i % 500 for i in range(512)]],
        req_pool_indices=[1],
        out_cache_loc=[list(range(1, 513))],
    )
    timings = ex.forward(batch).stats.timings_ns
    assert {"forward", "sample", "total"} <= timings.keys()
    assert 0 < timings["forward"] <= timings["total"]
    assert 0 < timings["sample"] <= timings["total"]
