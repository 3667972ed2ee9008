"""Issue 15: what a GPU would show, tested on CPU where it can be.

- The executor's device is current on every thread that touches it (ops.device_scope).
- A poisoned capture stops capturing for good; a clean out-of-memory error skips one bucket,
  and its batches replay the next larger captured bucket.
- A step uploads its inputs in one staged copy from a pinned, double-buffered buffer; every
  synchronizing upload is counted; the capture guard refuses pageable uploads and syncs.

The `gpu` tests repeat the device and capture checks with CUDA (skipped here with a reason).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from attention.torch_paged import TorchPagedBackend
from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.core.errors import ToggleRefusedError
from executor.core.forward_batch import SamplingParams
from executor.core.runner_output import GraphFallback
from executor.graphs.capture_rules import HostReadError, HostReadGuard
from executor.graphs.factory import GraphFactory
from executor.graphs.graph import (
    CpuGraph,
    GraphCaptureError,
    GraphCapturePoisoned,
    begin_capture,
)
from executor.kv_cache import ReqToTokenPool
from executor.model_executor import ModelExecutor
from executor.models.blocks import DecoderLayer
from ops import device_scope as ds
from ops import h2d_staging
from ops.h2d_staging import H2DStaging, StagedField
from ops.host_reads import declare_pinned
from ops.host_transfer import host_transfers, to_device
from tests.lock_util import is_held

MakeExecutor = Callable[..., ModelExecutor]


def _in_thread(fn: Callable[[], Any], name: str) -> Any:
    result: list[Any] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return result[0]


# --- the device is current on every thread ------------------------------------------------
@pytest.mark.slow
def test_every_thread_runs_device_work_inside_the_executors_device_scope(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, torch.device | None]] = []
    real_forward = TorchPagedBackend.forward
    real_new = GraphFactory.new

    def forward(self: TorchPagedBackend, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((threading.current_thread().name, ds.current_scope()))
        return real_forward(self, *args, **kwargs)

    def new(self: GraphFactory, **kwargs: Any) -> Any:
        seen.append((threading.current_thread().name, ds.current_scope()))
        return real_new(self, **kwargs)

    monkeypatch.setattr(TorchPagedBackend, "forward", forward)
    monkeypatch.setattr(GraphFactory, "new", new)
    ex: ModelExecutor = _in_thread(
        lambda: make_executor(graph_mode="decode", graph_batch_sizes="1,2"), "loader"
    )
    _in_thread(ex.warmup, "warmup")
    _in_thread(
        lambda: ex.forward(
            make_extend_batch(
                input_ids=[[3, 4, 5]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
            )
        ),
        "device-worker",
    )
    _in_thread(lambda: ex.control.apply_toggles(graph_mode="both"), "runtime-toggle")
    threads = {name for name, _ in seen}
    assert threads == {"loader", "warmup", "device-worker", "runtime-toggle"}
    assert {scope for _, scope in seen} == {ex.device}
    assert ds.current_scope() is None  # nothing leaks onto the test's thread


class _FakeCuda:
    """Two CUDA devices as far as torch.cuda's current-device calls can tell."""

    def __init__(self) -> None:
        self.current = 0
        self.calls: list[int] = []

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.calls.append(index)
        self.current = index


def test_device_scope_makes_cuda_n_current_and_launch_checks_refuse_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    dev1 = torch.device("cuda", 1)
    with pytest.raises(ds.DeviceScopeError, match="outside its device scope"):
        ds.check_device(dev1, "triton attention")  # a thread that never entered the scope
    with ds.device_scope(dev1):
        assert fake.current == 1
        ds.check_device(dev1, "triton attention")  # passes
        with ds.device_scope(torch.device("cuda", 0)):  # nested: innermost wins, then back
            assert fake.current == 0
        assert fake.current == 1
        fake.current = 0  # someone switched CUDA's current device behind the scope's back
        with pytest.raises(ds.DeviceScopeError, match="current device is cuda:0"):
            ds.check_device(dev1, "triton attention")
        fake.current = 1
    assert fake.current == 0 and fake.calls == [1, 0, 1, 0]
    # `cuda` alone resolves to the current index, so scopes and streams agree on it.
    assert ds.resolve_index(torch.device("cuda")) == torch.device("cuda", 0)


# --- capture failures: poisoned (stop for good) vs a clean out-of-memory (skip one) --------
@pytest.mark.slow
def test_a_clean_oom_skips_only_its_bucket_and_its_batches_replay_a_larger_one(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = DecoderLayer.post_attention
    oom_at = {"rows": 2}

    def post_attention(
        self: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attn_out.shape[0] == oom_at["rows"]:
            raise torch.OutOfMemoryError("injected: no room for bucket 2")
        return real(self, attn_out, residual)

    monkeypatch.setattr(DecoderLayer, "post_attention", post_attention)
    ex = make_executor(graph_mode="decode", graph_batch_sizes="1,2,4")
    oom_at["rows"] = -1  # capture is over: eager and replays run normally
    [report] = ex.control.capture_reports
    assert report.poisoned is None and ex.info.graph_capture_disabled == ""
    assert sorted(report.captured) == [1, 4] and list(report.failed) == [2]
    assert "OutOfMemoryError" in report.failed[2] or "GraphCaptureOOM" in report.failed[2]
    ex.forward(
        make_extend_batch(
            input_ids=[[3, 4], [5, 6]], req_pool_indices=[1, 2], out_cache_loc=[[1, 2], [3, 4]]
        )
    )
    out = ex.forward(
        make_decode_batch(
            input_ids=[7, 8], req_pool_indices=[1, 2], seq_lens=[3, 3], out_cache_loc=[5, 6]
        )
    )
    # The smallest fitting bucket (2) failed; bucket 4 exists, so the batch replays it.
    assert (out.stats.path, out.stats.padded_batch_size, out.stats.graph_fallback) == (
        "full_graph",
        4,
        None,
    )


@pytest.mark.slow
def test_a_poisoned_capture_stops_every_later_capture_and_every_replay(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor(graph_mode="decode", graph_batch_sizes="1,2")
    assert sorted(ex.control.capture_reports[0].captured) == [1, 2]
    ex.forward(make_extend_batch(input_ids=[[3, 4]], req_pool_indices=[1], out_cache_loc=[[1, 2]]))
    decode = make_decode_batch(input_ids=[7], req_pool_indices=[1], seq_lens=[3], out_cache_loc=[5])
    assert ex.forward(decode).stats.path == "full_graph"
    real = DecoderLayer.post_attention

    def unsafe(
        self: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attn_out.sum().item() == float("inf"):  # a host read: poisons a capture
            raise AssertionError("unreachable")
        return real(self, attn_out, residual)

    monkeypatch.setattr(DecoderLayer, "post_attention", unsafe)
    [report] = ex.control.set_graph_mode("both")  # the piecewise runner captures now, and poisons
    assert report.kind == "piecewise" and report.poisoned is not None
    assert len(report.failed) == 1 and report.captured == []
    assert ex.info.graph_capture_disabled == report.poisoned
    monkeypatch.setattr(DecoderLayer, "post_attention", real)
    # The decode graphs captured before are not replayed any more: eager, with the reason.
    out = ex.forward(
        make_decode_batch(input_ids=[8], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[6])
    )
    assert (out.stats.path, out.stats.graph_fallback) == (
        "eager",
        GraphFallback("decode", "capture_poisoned"),
    )
    # No later pass captures anything on this factory.
    again = ex.runner.decode_graphs
    assert again is not None
    recapture = again.capture(progress=False)
    assert recapture.captured == [] and recapture.poisoned == report.poisoned


# --- on a GPU -----------------------------------------------------------------------------
class BeginFails:
    """A stand-in `torch.cuda.CUDAGraph` whose `capture_begin` fails after CUDA's allocator
    routed to the pool (as the pinned-memory allocator's check did on torch 2.11)."""

    def __init__(self, end_fails: bool = False) -> None:
        self.ended = 0
        self.end_fails = end_fails

    def capture_begin(self, pool: Any, capture_error_mode: str) -> None:
        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")

    def capture_end(self) -> None:
        self.ended += 1
        if self.end_fails:
            raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("registered", [True, False])
def test_a_capture_that_failed_to_start_is_undone_in_the_allocator(
    monkeypatch: pytest.MonkeyPatch, registered: bool
) -> None:
    """The allocator's routing to the pool is ended (it would otherwise believe a capture is
    under way for good), and only this bucket is lost: not a poisoning."""
    ended: list[tuple[int, Any]] = []

    def end_allocate_to_pool(index: int, pool: Any) -> None:
        if not registered:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        ended.append((index, pool))

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate_to_pool, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graph = BeginFails()
    with pytest.raises(GraphCaptureError, match="did not start") as info:
        begin_capture(graph, (0, 7), torch.device("cuda", 3))
    assert not isinstance(info.value, GraphCapturePoisoned)
    assert ended == ([(3, (0, 7))] if registered else []) and graph.ended == 0


@pytest.mark.parametrize("end_fails", [False, True])
def test_a_stream_capture_that_started_before_the_failure_is_ended(
    monkeypatch: pytest.MonkeyPatch, end_fails: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    graph = BeginFails(end_fails=end_fails)
    expected = GraphCapturePoisoned if end_fails else GraphCaptureError
    with pytest.raises(expected) as info:
        begin_capture(graph, (0, 7), torch.device("cuda", 0))
    assert graph.ended == 1
    assert isinstance(info.value, GraphCapturePoisoned) == end_fails


def test_graphs_captured_after_all_were_dropped_go_into_a_new_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release drops every graph; the resume's captures must not reuse the dropped graphs'
    pool id (CUDA's pinned-memory allocator keeps the id's entry with no user, and a capture
    into it fails in `capture_begin`: the H200 run of 2026-11-28)."""
    handles = iter(range(1, 10))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    factory = GraphFactory(torch.device("cuda", 0), "cuda")
    first, second = factory.new(), factory.new()
    assert first._pool == second._pool == (0, 1)  # one round's graphs share a pool
    factory.new_round()
    assert factory.new()._pool == (0, 2)


def test_a_runner_that_drops_its_graphs_starts_a_new_pool_round(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor(graph_mode="decode", graph_batch_sizes="1,2")
    rounds: list[int] = []
    monkeypatch.setattr(ex.runner.graph_factory, "new_round", lambda: rounds.append(1))
    assert ex.runner.decode_graphs is not None
    ex.runner.drop_graphs()
    assert ex.runner.decode_graphs is None and ex.runner.piecewise is None and rounds == [1]


@pytest.mark.gpu
def test_cuda_poisoned_capture_restores_the_stream_and_stops_capturing() -> None:
    """In a process of its own: a capture that did not end leaves CUDA's caching allocator
    believing one is under way for the process's life (`ops.allocator`)."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_poisoned_capture)
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the child failed (exit {child.exitcode}): see its stderr"


def _poisoned_capture() -> None:
    from executor.graphs import factory as factory_module
    from executor.graphs.capture import capture_buckets

    device = torch.device("cuda", torch.cuda.current_device())
    with ds.device_scope(device):
        factory = GraphFactory(device, "cuda")
        stream_before = torch.cuda.current_stream(device)
        x = torch.ones(4, device=device)
        tried: list[int] = []

        def capture_one(size: int) -> None:
            tried.append(size)

            def host_read() -> None:
                if float(x.sum()) < 0:  # a synchronizing read: forbidden under capture
                    raise AssertionError("unreachable")

            factory.new().capture(host_read)

        report = capture_buckets("decode", [1, 2, 4], capture_one, factory, progress=False)
        assert report.poisoned is not None and tried == [4]  # the pass ended at once
        assert torch.cuda.current_stream(device) == stream_before  # restored
        assert factory.poisoned == report.poisoned
        again = capture_buckets("piecewise", [8], capture_one, factory, progress=False)
        assert again.captured == [] and tried == [4]  # nothing captured after a poisoning
        assert float((x + 1).sum().cpu()) == 8.0  # eager work still runs on the device
    assert factory_module._cuda_poisoned  # for the process's life


@pytest.mark.gpu
def test_cuda_n_executor_runs_on_its_own_device(make_executor: MakeExecutor) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices to place the executor on cuda:1")
    ex = make_executor(device="cuda:1", graph_mode="decode", graph_batch_sizes="1,2")
    out = _in_thread(
        lambda: ex.forward(
            make_extend_batch(
                input_ids=[[3, 4, 5]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
            )
        ),
        "device-worker",
    )
    assert out.next_token_ids.shape == (1,)
    assert ex.kv_pool.k.device == torch.device("cuda", 1)


# --- one staged host-to-device copy per step, honest counts --------------------------------
def test_every_step_uploads_its_inputs_in_one_staged_copy_and_no_sync(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor()
    steps = [
        make_extend_batch(
            input_ids=[[3, 4, 5], [6, 7]],
            req_pool_indices=[1, 2],
            out_cache_loc=[[1, 2, 3], [4, 5]],
            sampling=[SamplingParams(temperature=0.7, top_k=5, seed=3), SamplingParams()],
            return_logprob=True,
        ),
        make_extend_batch(  # a shared prefix: prefix_cache_loc cells staged too
            input_ids=[[9]],
            req_pool_indices=[3],
            out_cache_loc=[[6]],
            prefix_lens=[3],
            prefix_cache_loc=[[1, 2, 3]],
        ),
        make_decode_batch(
            input_ids=[8, 9], req_pool_indices=[1, 2], seq_lens=[4, 3], out_cache_loc=[7, 8]
        ),
    ]
    for fb in steps:
        stats = ex.forward(fb).stats
        assert (stats.h2d_copies, stats.h2d_syncs) == (1, 0), stats.mode
    # The table holds what the staged cells said (prefix cells included).
    table = ex.req_to_token_pool.req_to_token
    assert table[1, :4].tolist() == [1, 2, 3, 7]
    assert table[2, :3].tolist() == [4, 5, 8]
    assert table[3, :4].tolist() == [1, 2, 3, 6]


def test_the_row_table_write_without_staged_cells_counts_its_three_uploads() -> None:
    pool = ReqToTokenPool(4, 16, torch.device("cpu"), kv_slots=32)
    fb = complete_batch(
        make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[1], out_cache_loc=[9]),
        needs_cpu_seq_lens=False,
        max_context_len=16,
    )
    _, h2d_syncs0, copies0 = host_transfers.totals()
    pool.write_batch(fb)
    _, h2d_syncs1, copies1 = host_transfers.totals()
    assert (h2d_syncs1 - h2d_syncs0, copies1 - copies0) == (3, 0)
    assert int(pool.req_to_token[1, 0]) == 9


def test_staging_packs_dtypes_and_shapes_and_double_buffers() -> None:
    staging = H2DStaging(torch.device("cpu"))
    a = torch.arange(5, dtype=torch.int64)
    b = torch.tensor([0.5, 1.5], dtype=torch.float32)
    c = torch.tensor([True, False, True])
    first = staging.stage(
        [
            StagedField("a", a, torch.int64),
            StagedField("a32", a, torch.int32),  # converted while packing
            StagedField("b", b, torch.float32),
            StagedField("c", c, torch.bool),
            StagedField("empty", torch.zeros(0, dtype=torch.int64), torch.int64),
        ]
    )
    a64, a32, b2, c2, empty = first  # the views come back in the fields' order
    assert torch.equal(a64, a) and a32.dtype == torch.int32
    assert a32.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(b2, b) and torch.equal(c2, c)
    assert empty.shape == (0,)
    assert all(v.data_ptr() % h2d_staging.ALIGN == 0 for v in first if v.numel())
    # The next step writes the other buffer: the first step's views stay intact.
    (second,) = staging.stage([StagedField("a", a + 100, torch.int64)])
    assert torch.equal(a64, a) and torch.equal(second, a + 100)
    assert a64.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    # A step larger than the buffer grows it.
    big = torch.arange(10_000, dtype=torch.int64)
    (third,) = staging.stage([StagedField("big", big, torch.int64)])
    assert torch.equal(third, big) and staging.copies == 3


def test_staging_reuses_a_signature_layout_and_repacks_every_call() -> None:
    """Steps of one shape reuse their layout (offsets and views computed once per buffer),
    and each call still copies that call's values; a new shape gets its own layout."""
    staging = H2DStaging(torch.device("cpu"))

    def step(i: int, n: int = 3) -> tuple[torch.Tensor, ...]:
        ids = torch.arange(n, dtype=torch.int64) + 10 * i
        lens = torch.full((n,), i, dtype=torch.int32)
        return staging.stage(
            [StagedField("ids", ids, torch.int64), StagedField("lens", lens, torch.int64)]
        )

    views = [step(i) for i in range(6)]
    for i in (4, 5):  # the last two calls' views hold their own values
        ids, lens = views[i]
        assert ids.tolist() == [10 * i, 10 * i + 1, 10 * i + 2]
        assert lens.tolist() == [i] * 3 and lens.dtype == torch.int64
    pairs = [p for p in staging._pairs if p is not None]
    assert len(pairs) == 2 and all(len(p.layouts) == 1 for p in pairs)
    wider = step(7, n=5)
    assert wider[0].tolist() == [70, 71, 72, 73, 74]
    assert sum(len(p.layouts) for p in pairs) == 3


def test_the_capture_guard_refuses_pageable_uploads_and_synchronize() -> None:
    pageable = torch.ones(4)
    pinned = torch.ones(16)
    declare_pinned(pinned)
    out = torch.zeros(4)
    with HostReadGuard(capture=True):
        to_device(pinned[4:8], out, "staged_inputs")  # a view of a pinned buffer: allowed
        with pytest.raises(HostReadError, match="pageable"):
            to_device(pageable, out, "row_table")
        with pytest.raises(HostReadError, match=r"torch.cuda.synchronize\(\)"):
            torch.cuda.synchronize()
    assert torch.equal(out, torch.ones(4))
    # Outside a capture both are fine again (CPU: synchronize refuses for want of CUDA).
    to_device(pageable, out, "row_table")
    assert not hasattr(torch.cuda.synchronize, "__wrapped__")

    def uploads() -> None:  # fine eagerly (the warm-up runs), poisons a capture
        to_device(pageable, out, "row_table")

    with pytest.raises(GraphCapturePoisoned, match="pageable"):
        CpuGraph().capture(uploads)


@pytest.mark.gpu
def test_cuda_staged_copy_is_one_async_copy_from_pinned_memory() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    with ds.device_scope(device):
        staging = H2DStaging(device)
        a = torch.arange(1000, dtype=torch.int64)
        _, syncs0, copies0 = host_transfers.totals()
        views = [staging.stage([StagedField("a", a + i, torch.int64)]) for i in range(4)]
        _, syncs1, copies1 = host_transfers.totals()
        assert (syncs1 - syncs0, copies1 - copies0) == (0, 4)
        torch.cuda.synchronize(device)
        # Buffers alternate: the last two steps' views hold their own values.
        assert torch.equal(views[2][0].cpu(), a + 2) and torch.equal(views[3][0].cpu(), a + 3)
        pair = staging._pairs[0]
        assert pair is not None and pair.host.is_pinned()


def test_the_metrics_show_the_staged_copies_and_the_synchronizing_uploads(
    make_executor: MakeExecutor,
) -> None:
    from executor.observability.metrics import ExecutorMetrics

    def values() -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for family in ExecutorMetrics().registry.collect():
            for sample in family.samples:
                if sample.name.startswith("model_executor_h2d_"):
                    out[(sample.name, sample.labels["reason"])] = sample.value
        return out

    ex = make_executor()
    before = values()
    ex.forward(make_extend_batch(input_ids=[[3, 4]], req_pool_indices=[1], out_cache_loc=[[1, 2]]))
    ex.req_to_token_pool.write_batch(  # outside the staging: three counted syncs
        complete_batch(
            make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[3], out_cache_loc=[3]),
            needs_cpu_seq_lens=False,
            max_context_len=1024,
        )
    )
    after = values()

    def delta(name: str, reason: str) -> float:
        return after.get((name, reason), 0) - before.get((name, reason), 0)

    assert delta("model_executor_h2d_copies_total", "staged_inputs") == 1
    assert delta("model_executor_h2d_syncs_total", "row_table") == 3


# --- a runtime graph-mode change captures in the background --------------------------------
class _BetweenBuckets:
    """Stands in for the factory's stop event: the capture loop asks it before every bucket
    (outside the step lock); the second time, it holds the capture thread there."""

    def __init__(self) -> None:
        self.calls = 0
        self.reached = threading.Event()
        self.go = threading.Event()

    def is_set(self) -> bool:
        self.calls += 1
        if self.calls == 2:
            self.reached.set()
            assert self.go.wait(30)
        return False

    def set(self) -> None:  # the factory's interface; nothing sets it here
        raise AssertionError("unexpected stop")


def _gated_executor(make_executor: MakeExecutor) -> tuple[ModelExecutor, _BetweenBuckets]:
    """An executor without graphs whose next capture waits between its two buckets."""
    ex = make_executor(graph_mode="none", piecewise_token_sizes="8,16")
    gate = _BetweenBuckets()
    ex.runner.graph_factory.stop = gate  # type: ignore[assignment]
    return ex, gate


@pytest.mark.slow
def test_a_runtime_graph_mode_captures_in_the_background_while_eager_serves(
    make_executor: MakeExecutor,
) -> None:
    ex, gate = _gated_executor(make_executor)
    ended: list[str] = []
    ex.control.graph_mode_listener = lambda: ended.append(ex.toggles.graph_capture)
    ex.control.apply_toggles(graph_mode="extend", background_capture=True)
    assert gate.reached.wait(30)  # bucket 16 captured; the thread waits before bucket 8
    assert (ex.toggles.graph_mode, ex.toggles.graph_capture) == (
        "none",
        "capturing graph_mode=extend",
    )
    # Serving goes on, eagerly, between two buckets.
    out = ex.forward(
        make_extend_batch(input_ids=[[3, 4, 5]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]])
    )
    assert (out.stats.path, out.stats.graph_fallback) == ("eager", None)
    # Graph-mode changes wait for the capture to end (refused, nothing changed).
    with pytest.raises(ToggleRefusedError, match="capture is in progress"):
        ex.control.apply_toggles(graph_mode="decode", background_capture=True)
    ex.control.apply_toggles(
        eager_input_no_copy=True, background_capture=True
    )  # others still apply
    gate.go.set()
    assert ex.control.wait_for_capture(30)
    assert (ex.toggles.graph_mode, ex.toggles.graph_capture, ended) == ("extend", "idle", ["idle"])
    assert ex.toggles.needs_cpu_seq_lens  # the piecewise path's host lengths, decided at install
    assert sorted(ex.control.capture_reports[-1].captured) == [8, 16]
    out = ex.forward(
        make_extend_batch(input_ids=[[6, 7]], req_pool_indices=[2], out_cache_loc=[[4, 5]])
    )
    assert out.stats.path == "piecewise"


@pytest.mark.slow
def test_a_background_capture_builds_its_registries_holding_the_step_lock(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building a runner's registry writes pooled input buffers (the padded `seq_lens` fill)
    that a live eager step may be reading: it must not overlap a step."""
    from executor.graphs import decode_runner, piecewise_runner

    ex = make_executor(graph_mode="none", graph_batch_sizes="1,2", piecewise_token_sizes="8")
    held: list[tuple[str, bool]] = []
    for module, name in (
        (decode_runner, "build_decode_registry"),
        (piecewise_runner, "build_prefill_registry"),
    ):
        real = getattr(module, name)

        def recording(*args: object, _real=real, _name=name, **kwargs: object) -> object:
            held.append((_name, is_held(ex.control.step_lock)))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    ex.control.apply_toggles(graph_mode="both", background_capture=True)
    assert ex.control.wait_for_capture(60)
    assert ex.toggles.graph_mode == "both"
    assert held == [("build_decode_registry", True), ("build_prefill_registry", True)]


@pytest.mark.slow
def test_the_start_up_report_counts_piecewise_graphs(make_executor: MakeExecutor) -> None:
    ex = make_executor(graph_mode="extend", piecewise_token_sizes="8,16")
    [report] = ex.control.capture_reports
    layers = len(ex.model.decoder_layers)
    assert report.graphs == 2 * (layers + 1) and report.graphs_per_bucket == layers + 1


# --- torch_paged refuses DECODE graphs on CUDA ----------------------------------------------
@pytest.mark.slow
def test_torch_paged_refuses_cuda_decode_graphs_with_the_reason(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attention.torch_paged import cuda_graph_refusal

    assert cuda_graph_refusal(torch.device("cpu"), 8192) is None
    reason = cuda_graph_refusal(torch.device("cuda", 0), 8192)
    assert reason is not None and "8192" in reason and "triton" in reason
    ex = make_executor(graph_mode="none", graph_batch_sizes="1,2")
    # What the backend says on a CUDA device.
    monkeypatch.setattr(ex.attn_backend, "graph_capture_refusal", lambda: reason)
    with pytest.raises(ToggleRefusedError, match="use attention_backend=triton"):
        ex.control.set_graph_mode("decode")
    assert ex.toggles.graph_mode == "none"
    ex.control.set_graph_mode("extend")  # the piecewise path runs attention eagerly: allowed
    assert ex.runner.decode_graphs is None


@pytest.mark.slow
def test_the_runtime_config_says_capturing_until_the_background_capture_ends(
    make_executor: MakeExecutor,
) -> None:
    from executor.service.runtime_config import RuntimeConfigUpdate, RuntimeControl

    ex, gate = _gated_executor(make_executor)
    published: list[tuple[str, str]] = []
    control = RuntimeControl(
        ex,
        trace_sample_ratio=0.0,
        set_trace_sample_ratio=lambda _: None,
        on_change=lambda c: published.append((c.graph_mode, c.graph_capture)),
    )
    answer = control.update(RuntimeConfigUpdate(graph_mode="extend"))
    assert (answer.graph_mode, answer.graph_capture) == ("none", "capturing graph_mode=extend")
    gate.go.set()
    assert ex.control.wait_for_capture(30)
    assert (control.current().graph_mode, control.current().graph_capture) == ("extend", "idle")
    assert published[-1] == ("extend", "idle")  # the gauges follow when the capture ends


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_server_asked_for_cuda_without_a_gpu_refuses_to_start_and_says_why(
    cache_dir: Path,
) -> None:
    """The chart's GPU pods name `cuda` (not `auto`): a pod that cannot see its GPU does not
    start (`serve` prints the reason and exits; readiness never says SERVING) instead of
    serving on the CPU."""
    from executor.service.server import start_server
    from executor.service.server_config import ServerConfig
    from tests.server_util import tiny_config

    with pytest.raises(ValueError, match="device 'cuda' was asked for but CUDA is not available"):
        start_server(
            tiny_config(cache_dir, device="cuda"),
            ServerConfig(host="127.0.0.1", port=0, metrics_port=0),
        )
