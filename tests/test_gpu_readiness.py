"""Issue 15: what a GPU would show, tested on CPU where it can be.

- The executor's device is current on every thread that touches it (ops.device_scope).
- A poisoned capture stops capturing for good; a clean out-of-memory error skips one bucket,
  and its batches replay the next larger captured bucket.

The `gpu` tests repeat the device and capture checks with CUDA (skipped here with a reason).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attention.torch_paged import TorchPagedBackend
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.graphs.graph import GraphCapturePoisoned, GraphFactory
from executor.model_executor import ModelExecutor
from executor.models.llama import LlamaDecoderLayer
from ops import device_scope as ds

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
def test_every_thread_runs_device_work_inside_the_executors_device_scope(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, torch.device | None]] = []
    real_forward = TorchPagedBackend.forward
    real_new = GraphFactory.new

    def forward(self: TorchPagedBackend, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((threading.current_thread().name, ds.current_scope()))
        return real_forward(self, *args, **kwargs)

    def new(self: GraphFactory) -> Any:
        seen.append((threading.current_thread().name, ds.current_scope()))
        return real_new(self)

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
    _in_thread(lambda: ex.apply_toggles(graph_mode="both"), "runtime-toggle")
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
def test_a_clean_oom_skips_only_its_bucket_and_its_batches_replay_a_larger_one(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = LlamaDecoderLayer.post_attention
    oom_at = {"rows": 2}

    def post_attention(
        self: LlamaDecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attn_out.shape[0] == oom_at["rows"]:
            raise torch.OutOfMemoryError("injected: no room for bucket 2")
        return real(self, attn_out, residual)

    monkeypatch.setattr(LlamaDecoderLayer, "post_attention", post_attention)
    ex = make_executor(graph_mode="decode", graph_batch_sizes="1,2,4")
    oom_at["rows"] = -1  # capture is over: eager and replays run normally
    [report] = ex.capture_reports
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


def test_a_poisoned_capture_stops_every_later_capture_and_every_replay(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor(graph_mode="decode", graph_batch_sizes="1,2")
    assert sorted(ex.capture_reports[0].captured) == [1, 2]
    ex.forward(make_extend_batch(input_ids=[[3, 4]], req_pool_indices=[1], out_cache_loc=[[1, 2]]))
    decode = make_decode_batch(input_ids=[7], req_pool_indices=[1], seq_lens=[3], out_cache_loc=[5])
    assert ex.forward(decode).stats.path == "full_graph"
    real = LlamaDecoderLayer.post_attention

    def unsafe(
        self: LlamaDecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attn_out.sum().item() == float("inf"):  # a host read: poisons a capture
            raise AssertionError("unreachable")
        return real(self, attn_out, residual)

    monkeypatch.setattr(LlamaDecoderLayer, "post_attention", unsafe)
    [report] = ex.set_graph_mode("both")  # the piecewise runner captures now, and poisons
    assert report.kind == "piecewise" and report.poisoned is not None
    assert len(report.failed) == 1 and report.captured == []
    assert ex.info.graph_capture_disabled == report.poisoned
    monkeypatch.setattr(LlamaDecoderLayer, "post_attention", real)
    # The decode graphs captured before are not replayed any more: eager, with the reason.
    out = ex.forward(
        make_decode_batch(input_ids=[8], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[6])
    )
    assert (out.stats.path, out.stats.graph_fallback) == ("eager", "decode:capture_poisoned")
    # No later pass captures anything on this factory.
    again = ex.runner.decode_graphs
    assert again is not None
    recapture = again.capture(progress=False)
    assert recapture.captured == [] and recapture.poisoned == report.poisoned


# --- on a GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_poisoned_capture_restores_the_stream_and_stops_capturing() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    with ds.device_scope(device):
        factory = GraphFactory(device, "cuda")
        stream_before = torch.cuda.current_stream(device)
        x = torch.ones(4, device=device)

        def host_read() -> None:
            if float(x.sum()) < 0:  # a synchronizing read: forbidden under capture
                raise AssertionError("unreachable")

        graph = factory.new()
        with pytest.raises(GraphCapturePoisoned):
            graph.capture(host_read)
        assert torch.cuda.current_stream(device) == stream_before
        torch.cuda.empty_cache()  # asserted inside the allocator while a capture is "underway"
        torch.cuda.synchronize(device)


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
