"""The pipelined step (issue 40): the device thread launches step N, admits and stages N+1
while N runs, then reads N. On a CPU device the forward is synchronous, so the tests turn the
pipeline on (`pipeline_steps=on`): the order of admission, staging, launch and read is the
pipelined one, with the real tiny-random model. Each test names the rule it checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.controls_types import DeferredMask, RowControl, SamplingControls, VocabMask
from executor.core.errors import BatchValidationError, FaultInjector, InjectedFault
from executor.core.extras_types import HiddenAsk, Pooling, RowOutputs
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingParams
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor
from executor.models.standin import standin_token
from executor.service.applied_batches import AppliedBatches
from executor.service.device_worker import DeviceWorker
from executor.service.jobs import Job, StreamFailedError, StreamState
from tests.server_util import tiny_config
from tests.state_util import state_digest

Outcome = ForwardOutput | BaseException


def _ids(t: list[int]) -> torch.Tensor:
    return torch.tensor(t, dtype=torch.int64)


def _future(fb: ForwardBatch, slots: list[int], released: list[int] = ()) -> ForwardBatch:  # type: ignore[assignment]
    return dataclasses.replace(
        fb,
        future_token_slots=_ids(slots),
        released_future_slots=_ids(list(released)) if released else None,
    )


def _verify(row: int, ids: list[int], slots: list[int], *, ngram: int = 0) -> ForwardBatch:
    """A VERIFY continuing from every token the row holds (extend_prefix_lens -1)."""
    fb = make_extend_batch(
        input_ids=[ids], req_pool_indices=[row], out_cache_loc=[slots], prefix_lens=[0]
    )
    return dataclasses.replace(
        fb,
        forward_mode=ForwardMode.VERIFY,
        extend_prefix_lens=_ids([-1]),
        ngram_draft=torch.tensor([ngram], dtype=torch.int32) if ngram else None,
    )


def _mask(vocab: int, allowed: list[int], rows: int) -> VocabMask:
    words = torch.zeros((rows, (vocab + 31) // 32), dtype=torch.int32)
    for t in allowed:
        words[:, t // 32] |= 1 << (t % 32)
    return VocabMask(words)


def feature_script(vocab: int) -> list[ForwardBatch]:
    """Steps whose inputs do not depend on earlier answers (future references aside), using
    every feature: controls, seeded sampling and logprobs, future tokens, MEAN pooling across
    chunks, prompt logprobs, a deferred mask, releases and row reuse, VERIFY, IDLE."""
    greedy, seeded = SamplingParams(), SamplingParams(temperature=0.9, top_k=30, seed=11)
    controls = SamplingControls(repetition_penalty=1.5, logit_bias=((7, 4.0),), min_tokens=3)
    mean = RowOutputs(row=3, prompt_logprobs=True, hidden=HiddenAsk(pooling=Pooling.MEAN))
    step0 = make_extend_batch(
        input_ids=[[5, 6, 7, 8], [40, 41], [9, 9, 9, 9, 9]],
        req_pool_indices=[1, 2, 4],
        out_cache_loc=[[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]],
        sampling=[greedy, seeded, greedy],
        return_logprob=True,
        top_logprobs_num=2,
    )
    step0 = _future(dataclasses.replace(step0, row_controls=(RowControl(1, controls),)), [1, 2, 3])
    step1 = make_extend_batch(
        input_ids=[[20, 21, 22, 23]], req_pool_indices=[3], out_cache_loc=[[12, 13, 14, 15]]
    )
    step1 = dataclasses.replace(step1, row_outputs=(mean,))
    step2 = make_decode_batch(
        input_ids=[-1, -2],
        req_pool_indices=[1, 2],
        seq_lens=[5, 3],
        out_cache_loc=[16, 17],
        sampling=[greedy, seeded],
    )
    step2 = _future(step2, [4, 5])  # a slot is released by a batch after the one reading it
    step3 = make_extend_batch(
        input_ids=[[24, 25]], req_pool_indices=[3], out_cache_loc=[[18, 19]], prefix_lens=[4]
    )
    step3 = dataclasses.replace(step3, row_outputs=(mean,))  # MEAN sees step 1's pooled count
    step4 = make_decode_batch(
        input_ids=[-4, -5],
        req_pool_indices=[1, 2],
        seq_lens=[6, 4],
        out_cache_loc=[20, 21],
        sampling=[greedy, seeded],
    )
    mask = DeferredMask(4)
    mask.fulfill(_mask(vocab, [3, 7, 50, 51], rows=2))
    step4 = dataclasses.replace(_future(step4, [6, 7], released=[1, 2]), deferred_mask=mask)
    step5 = make_extend_batch(  # row 2 released and reused by a new request, its slots too
        input_ids=[[60, 61, 62]], req_pool_indices=[2], out_cache_loc=[[5, 6, 17]]
    )
    step5 = dataclasses.replace(
        step5, released_req_pool_indices=_ids([2]), released_future_slots=_ids([4, 5, 7])
    )
    step6 = _verify(4, [9, 9, 9], [22, 23, 24])  # scheduler drafts
    step7 = _verify(4, [9, 0, 0, 0], [25, 26, 27, 28], ngram=2)  # the executor's drafts
    step8 = make_decode_batch(
        input_ids=[-6], req_pool_indices=[1], seq_lens=[7], out_cache_loc=[29]
    )
    step8 = _future(step8, [8], released=[3])
    idle = dataclasses.replace(
        make_decode_batch(input_ids=[], req_pool_indices=[], seq_lens=[], out_cache_loc=[]),
        forward_mode=ForwardMode.IDLE,
        released_req_pool_indices=_ids([3]),
    )
    return [step0, step1, step2, step3, step4, step5, step6, step7, step8, idle]


class Log:
    """The order the device thread prepared and read batches in (by batch_id)."""

    def __init__(self, ex: ModelExecutor) -> None:
        self.events: list[tuple[str, int]] = []
        prepare, finish = ex.prepare, ex.finish
        ids: dict[int, int] = {}

        def logged_prepare(batch: ForwardBatch, clock: object) -> object:
            self.events.append(("prepare", self.current))  # refused or not
            sb = prepare(batch, clock)  # type: ignore[arg-type]
            ids[id(sb)] = self.current
            return sb

        def logged_finish(sb: object) -> ForwardOutput:
            self.events.append(("read", ids.get(id(sb), -1)))
            return finish(sb)  # type: ignore[arg-type]

        ex.prepare = logged_prepare  # type: ignore[method-assign]
        ex.finish = logged_finish  # type: ignore[method-assign]
        self.current = 0

    def ahead(self) -> list[int]:
        """Batches prepared before the batch before them was read."""
        out = []
        for i, (kind, n) in enumerate(self.events):
            if kind == "prepare" and ("read", n - 1) in self.events[i:]:
                out.append(n)
        return out


def run_worker(
    ex: ModelExecutor,
    batches: list[ForwardBatch],
    *,
    streams: list[StreamState | None] | None = None,
    ids: list[int] | None = None,
    applied: AppliedBatches | None = None,
) -> tuple[list[Outcome], Log]:
    """Every batch queued before the device thread starts, so each step finds the next one
    waiting: the pipeline's order."""
    log = Log(ex)
    worker = DeviceWorker(ex, queue_size=len(batches) + 1, applied=applied)
    jobs: list[Job] = []
    for i, batch in enumerate(batches):
        batch_id = ids[i] if ids is not None else i + 1
        jobs.append(
            worker.submit(
                batch,
                batch_id,
                stream=None if streams is None else streams[i],
                fingerprint=str(batch_id).encode(),
            )
        )
    real_prepare = ex.prepare

    def prepare(batch: ForwardBatch, clock: object) -> object:
        log.current = next(j.batch_id for j in jobs if j.batch is batch)
        return real_prepare(batch, clock)  # type: ignore[arg-type]

    ex.prepare = prepare  # type: ignore[method-assign]
    worker.start()
    assert worker.wait_idle(120)
    worker.stop(10)
    outcomes: list[Outcome] = []
    for job in jobs:
        exc = job.future.exception()
        outcomes.append(exc if exc is not None else job.future.result())
    return outcomes, log


def serial(ex: ModelExecutor, batches: list[ForwardBatch]) -> list[Outcome]:
    out: list[Outcome] = []
    for batch in batches:
        try:
            out.append(ex.forward(batch))
        except Exception as exc:
            out.append(exc)
    return out


def same(a: Outcome, b: Outcome) -> None:
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        assert type(a) is type(b) and str(a) == str(b), (a, b)
        return
    for name in ("next_token_ids", "next_token_logprobs", "top_logprobs", "top_logprob_ids",
                 "accepted_tokens", "accepted_lengths"):  # fmt: skip
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert (a.extras is None) == (b.extras is None)
    if a.extras is not None and b.extras is not None:
        for name, ragged in vars(a.extras).items():
            other = getattr(b.extras, name)
            assert (ragged is None) == (other is None), name
            if ragged is not None:
                assert torch.equal(ragged.values, other.values), name


@pytest.fixture
def executors(tmp_path: Path) -> Iterator[Callable[..., ModelExecutor]]:
    def make(**overrides: object) -> ModelExecutor:
        values: dict[str, object] = {"max_reqs": 8, "kv_slots": 256, "max_context_len": 64}
        values.update(overrides)
        return ModelExecutor(tiny_config(tmp_path, **values))

    yield make


def test_every_feature_gives_the_same_answers_pipelined_and_serial(
    executors: Callable[..., ModelExecutor],
) -> None:
    """Rule: admission of N+1 runs against the state N leaves (apply-time effects: rows,
    releases, future slots, controls, pooled counts; VERIFY's lengths only at its read)."""
    ex_serial, ex_pipe = executors(), executors(pipeline_steps="on")
    batches = feature_script(ex_serial.limits.vocab_size)
    expected = serial(ex_serial, batches)
    assert not [o for o in expected if isinstance(o, BaseException)], expected
    got, log = run_worker(ex_pipe, batches)
    for a, b in zip(expected, got, strict=True):
        same(a, b)
        # Rule: no new host sync: each step transfers what it does one step at a time.
        assert isinstance(a, ForwardOutput) and isinstance(b, ForwardOutput)
        assert (b.stats.d2h_syncs, b.stats.h2d_syncs) == (a.stats.d2h_syncs, a.stats.h2d_syncs)
    assert state_digest(ex_pipe) == state_digest(ex_serial)
    # Each step was prepared while the one before ran, except after a VERIFY (its read
    # changes the row lengths the next admission reads): steps 7 and 8 follow steps 6 and 7.
    assert log.ahead() == [2, 3, 4, 5, 6, 7, 10]


def test_a_cpu_device_runs_one_step_at_a_time_by_default(
    executors: Callable[..., ModelExecutor],
) -> None:
    ex = executors()
    assert not ex.pipelines
    batches = feature_script(ex.limits.vocab_size)[:3]
    _, log = run_worker(ex, batches)
    assert log.ahead() == []


def _fault_script() -> list[ForwardBatch]:
    """A, then N, then N+1 that continues N (its references and lengths), then N+2 apart."""
    a = _future(
        make_extend_batch(input_ids=[[5, 6, 7], [8, 9]], req_pool_indices=[1, 2],
                          out_cache_loc=[[1, 2, 3], [4, 5]]),
        [1, 2],
    )  # fmt: skip
    n = _future(
        make_decode_batch(input_ids=[-1, -2], req_pool_indices=[1, 2], seq_lens=[4, 3],
                          out_cache_loc=[6, 7]),
        [3, 4],
    )  # fmt: skip
    n1 = _future(
        make_decode_batch(input_ids=[-3, -4], req_pool_indices=[1, 2], seq_lens=[5, 4],
                          out_cache_loc=[8, 9]),
        [5, 6], released=[1, 2],
    )  # fmt: skip
    n2 = make_extend_batch(
        input_ids=[[30, 31, 32]], req_pool_indices=[5], out_cache_loc=[[40, 41, 42]]
    )
    return [a, n, n1, n2]


@pytest.mark.parametrize("site", ["admit", "stage", "forward", "sampler", "read"])
def test_a_fault_at_any_phase_of_n_leaves_n_plus_1_as_if_n_had_been_refused(
    executors: Callable[..., ModelExecutor], site: str
) -> None:
    """Rules: a refused batch changes nothing (admit); if N fails, nothing prepared for N+1
    survives and N+1 is admitted again against the restored state (stage, forward, sampler:
    the launch; read). N+1 continues N: it is refused as it is when N never ran; N+2 runs."""
    a, n, n1, n2 = _fault_script()
    ref = executors()
    expected = serial(ref, [a, n1, n2])  # N refused: never applied
    assert isinstance(expected[1], BatchValidationError)
    ex = executors(pipeline_steps="on")
    faults = FaultInjector()
    ex.hooks.faults = faults
    faults.arm(site, on_call=2)  # A's is the first call of every site
    got, log = run_worker(ex, [a, n, n1, n2])
    assert faults.fired == [site]
    same(got[0], expected[0])
    assert isinstance(got[1], InjectedFault)
    same(got[2], expected[1])
    same(got[3], expected[2])
    assert state_digest(ex) == state_digest(ref)
    assert (ex.future.assigned == ref.future.assigned).all()
    # N's sampled ids were stored on the device at its launch: its failure restored them.
    assert torch.equal(ex.future.tokens, ref.future.tokens)
    if site == "read":  # N+1 was prepared while N ran, undone, and admitted again
        assert [e for e in log.events if e == ("prepare", 3)] == [("prepare", 3)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("site", ["stage", "read"])
def test_on_a_stream_the_batch_after_a_failed_one_is_not_run(
    executors: Callable[..., ModelExecutor], site: str
) -> None:
    """Rule: the stream rule: N fails, so N+1 of its stream is answered StreamFailedError
    (though it was prepared ahead); N+2 of another stream runs against the restored state."""
    a, n, n1, n2 = _fault_script()
    ref = executors()
    expected = serial(ref, [a, n2])
    ex = executors(pipeline_steps="on")
    ex.hooks.faults = FaultInjector()
    ex.hooks.faults.arm(site, on_call=2)
    stream = StreamState()
    got, _ = run_worker(ex, [a, n, n1, n2], streams=[stream, stream, stream, None])
    same(got[0], expected[0])
    assert isinstance(got[1], InjectedFault) and isinstance(got[2], StreamFailedError)
    same(got[3], expected[1])
    assert state_digest(ex) == state_digest(ref)


def test_a_retry_queued_behind_its_batch_applies_nothing_twice(
    executors: Callable[..., ModelExecutor],
) -> None:
    """Rule: a retried batch_id applies nothing twice, also when the retry waits in the queue
    while its batch runs: it is not prepared ahead, and is answered from the retry memory."""
    a, n, _, n2 = _fault_script()
    ref = executors()
    expected = serial(ref, [a, n, n2])
    ex = executors(pipeline_steps="on")
    got, log = run_worker(ex, [a, n, n, n2], ids=[1, 2, 2, 3], applied=AppliedBatches(8))
    same(got[1], expected[1])
    same(got[2], expected[1])
    same(got[3], expected[2])
    assert state_digest(ex) == state_digest(ref)
    assert log.events.count(("prepare", 2)) == 1  # the retry was answered, never prepared


def test_the_stand_in_accelerator_answers_by_its_documented_rule(
    executors: Callable[..., ModelExecutor],
) -> None:
    ex = executors(simulated_step_ms=1.0)
    assert ex.pipelines
    vocab = ex.limits.vocab_size
    prompt = [5, 6, 7, 8]
    out = ex.forward(
        make_extend_batch(input_ids=[prompt], req_pool_indices=[1], out_cache_loc=[[1, 2, 3, 4]])
    )
    first = int(out.next_token_ids[0])
    assert first == standin_token(8, 3, vocab) and out.stats.path == "simulated"
    assert out.stats.device_busy_ns == 1_000_000
    out = ex.forward(
        make_decode_batch(input_ids=[first], req_pool_indices=[1], seq_lens=[5], out_cache_loc=[5])
    )
    assert int(out.next_token_ids[0]) == standin_token(first, 4, vocab)


def test_the_stand_in_gives_the_same_tokens_pipelined_and_serial(
    executors: Callable[..., ModelExecutor],
) -> None:
    ex_serial, ex_pipe = executors(simulated_step_ms=1.0), executors(simulated_step_ms=1.0)
    batches = feature_script(ex_serial.limits.vocab_size)
    expected = serial(ex_serial, batches)
    got, log = run_worker(ex_pipe, batches)
    for a, b in zip(expected, got, strict=True):
        same(a, b)
    assert log.ahead() == [2, 3, 4, 5, 6, 7, 10]
    gaps = [o.stats.host_gap_ns for o in got if isinstance(o, ForwardOutput)]
    assert all(g >= 0 for g in gaps)


def test_occupancy_is_busy_over_busy_plus_gap_in_its_window() -> None:
    """`model_executor_forward_occupancy`: the steps that ended in the window only; 1 when
    none did (time with nothing queued counts on neither side)."""
    from executor.observability.occupancy import Occupancy

    occ = Occupancy(window_s=10.0)
    assert occ.value(now=0.0) == 1.0
    occ.record(busy_ns=2_000_000, gap_ns=2_000_000, now=1.0)  # one step at a time: D / (D + D)
    assert occ.value(now=1.0) == 0.5
    for t in range(2, 10):
        occ.record(busy_ns=2_000_000, gap_ns=0, now=float(t))  # pipelined: no gap
    assert occ.value(now=10.0) == pytest.approx(18 / 20)
    assert occ.value(now=11.5) == 1.0  # the gapped step left the window
    assert occ.value(now=30.0) == 1.0


def test_the_stand_in_timeline_counts_the_gap_only_while_a_batch_waited() -> None:
    """The host gap before a step: the device idle while the batch was queued (launch minus
    the later of the device's free time and the batch's queueing); busy is D."""
    from executor.core.clock import StepClock
    from executor.core.step_batch import InFlight, StepBatch
    from executor.step.timeline import DeviceTimeline

    timeline = DeviceTimeline(torch.device("cpu"), simulated_step_ms=2.0)
    assert timeline.asynchronous

    def step(launched_ns: int, queued_ns: int) -> StepBatch:
        sb = StepBatch(make_decode_batch(input_ids=[1], req_pool_indices=[1], seq_lens=[2],
                                         out_cache_loc=[3]), StepClock())  # fmt: skip
        sb.flight = InFlight(None, None, [], None, launched_ns)  # type: ignore[arg-type]
        timeline.launched(sb.flight)
        timeline.read(sb, queued_ns)
        return sb

    ms = 1_000_000
    first = step(launched_ns=10 * ms, queued_ns=9 * ms)  # queued 1 ms before its launch
    assert (first.device_busy_ns, first.host_gap_ns) == (2 * ms, 1 * ms)
    ahead = step(launched_ns=11 * ms, queued_ns=9 * ms)  # launched while the first ran
    assert ahead.flight is not None and ahead.flight.ready_ns == 14 * ms  # after the first
    assert ahead.host_gap_ns == 0
    late = step(launched_ns=15 * ms, queued_ns=9 * ms)  # device free at 14: waited 1 ms
    assert late.host_gap_ns == 1 * ms
    idle = step(launched_ns=40 * ms, queued_ns=39 * ms)  # nothing queued from 17 to 39
    assert idle.host_gap_ns == 1 * ms


def test_a_step_is_answered_after_the_next_prepared_batch_is_launched(
    executors: Callable[..., ModelExecutor],
) -> None:
    """The device does not wait for the host's answer to N: N+1 (prepared while N ran) is
    launched first; a batch not prepared ahead (nothing queued) gets N's answer at once."""
    ex = executors(simulated_step_ms=1.0)
    events: list[str] = []
    launch = ex.launch

    def logged_launch(sb: object) -> None:
        events.append(f"launch {len(events)}")
        launch(sb)  # type: ignore[arg-type]

    ex.launch = logged_launch  # type: ignore[method-assign]
    worker = DeviceWorker(ex, queue_size=8)
    batches = feature_script(ex.limits.vocab_size)[:3]
    jobs = [worker.submit(b, i + 1) for i, b in enumerate(batches)]
    for i, job in enumerate(jobs):
        job.future.add_done_callback(lambda _, i=i: events.append(f"answer {i}"))
    worker.start()
    assert worker.wait_idle(60)
    worker.stop(10)
    order = [e.split()[0] for e in events]
    assert order == ["launch", "launch", "answer", "launch", "answer", "answer"], events


def test_the_next_batch_is_launched_behind_a_step_before_that_step_is_read(
    executors: Callable[..., ModelExecutor],
) -> None:
    """The device starts N+1 the moment N ends: N+1 (queued while N ran) is launched before N
    is read, so no host work sits between the two on the device; not under tensor
    parallelism (`launches_ahead`)."""
    ex = executors(simulated_step_ms=1.0)
    assert ex.launches_ahead
    events: list[str] = []
    launch, finish = ex.launch, ex.finish

    def logged_launch(sb: object) -> None:
        events.append("launch")
        launch(sb)  # type: ignore[arg-type]

    def logged_finish(sb: object) -> object:
        events.append("read")
        return finish(sb)  # type: ignore[arg-type]

    ex.launch, ex.finish = logged_launch, logged_finish  # type: ignore[method-assign]
    worker = DeviceWorker(ex, queue_size=8)
    jobs = [worker.submit(b, i + 1) for i, b in enumerate(feature_script(ex.limits.vocab_size)[:3])]
    worker.start()
    assert worker.wait_idle(60)
    worker.stop(10)
    assert all(job.future.result() is not None for job in jobs)
    assert events == ["launch", "launch", "read", "launch", "read", "read"], events


@pytest.mark.parametrize("pipeline", [{"simulated_step_ms": 1.0}, {"pipeline_steps": "on"}])
def test_a_batch_whose_mask_follows_the_answer_before_it_is_not_held_behind_it(
    executors: Callable[..., ModelExecutor], pipeline: dict[str, object]
) -> None:
    """Liveness: N+1's deferred mask is sent once N's tokens are read (a grammar's next
    state), so neither N's answer nor the device thread may wait for N+1's mask. Without
    the rule N+1 waits out deferred_mask_timeout_s and fails."""
    ex = executors(deferred_mask_timeout_s=30.0, **pipeline)
    a, n = _fault_script()[:2]
    mask = DeferredMask(2)
    n = dataclasses.replace(n, deferred_mask=mask)
    worker = DeviceWorker(ex, queue_size=4)
    jobs = [worker.submit(a, 1), worker.submit(n, 2)]
    allowed = _mask(ex.limits.vocab_size, [3, 7, 50, 51], rows=2)
    jobs[0].future.add_done_callback(lambda _: mask.fulfill(allowed))
    worker.start()
    assert worker.wait_idle(20), "N+1 waited for a mask that follows N's answer"
    worker.stop(10)
    tokens = jobs[1].future.result().next_token_ids.tolist()
    assert set(tokens) <= {3, 7, 50, 51}
