"""The compiled CPU graph backends (`graph_backend=compiled`, the CPU default, and
`compiled_step`) and the KV-length buckets of captured DECODE graphs.

The compile tests are few and small (tiny-random, three decode and two token buckets): the
stand-in stays the backend the rest of the graph tests use. Each compiles with dynamo's eager
backend in the gate and with inductor in `make test-long` (the `graph_compiler` fixture).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from attention.torch_paged import TorchPagedBackend
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.buckets import kv_bucket
from executor.core.names import INDUCTOR
from executor.core.runner_output import GraphFallback
from executor.graphs import step_graph
from executor.graphs.factory import GraphFactory
from executor.graphs.graph import CompiledGraph, GraphCaptureError
from executor.graphs.settings import resolve_graph_backend
from executor.graphs.step_graph import StepCall, StepCompiledGraph
from executor.model_executor import ModelExecutor
from tests.test_graphs import _prefill

MakeExecutor = Callable[..., ModelExecutor]
LOGIT_TOL = 1e-4  # inductor fuses the elementwise ops: float32 rounding may differ slightly


def test_graph_backend_setting_resolves_and_refuses_what_cannot_run() -> None:
    cpu = torch.device("cpu")
    # graph_mode=auto: a server compiles whole DECODE steps in the background (compiled_step).
    assert resolve_graph_backend(ExecutorConfig(), cpu) == "compiled_step"
    assert resolve_graph_backend(ExecutorConfig(graph_mode="none"), cpu) == "compiled"
    assert resolve_graph_backend(ExecutorConfig(tp_size=2, graph_mode="decode"), cpu) == "compiled"
    assert resolve_graph_backend(ExecutorConfig(graph_backend="standin"), cpu) == "standin"
    with pytest.raises(ValueError, match="graph_backend 'cuda' needs a CUDA device"):
        resolve_graph_backend(ExecutorConfig(graph_backend="cuda"), cpu)
    with pytest.raises(ValueError, match="graph_backend must be one of"):
        ExecutorConfig(graph_backend="xla")
    with pytest.raises(ValueError, match="graph backend must be one of"):
        GraphFactory(cpu, "xla")
    with pytest.raises(ValueError, match=r"'compiled_step' needs tp_size 1.*tp_size=2"):
        ExecutorConfig(graph_backend="compiled_step", tp_size=2)


def test_compiled_step_compiles_whole_decode_steps_and_regional_pieces() -> None:
    """`compiled_step`: the DECODE runner's whole-step graphs compile as one graph each, and
    so cannot share a twin's capture; the piecewise runner's pieces compile as `compiled`."""
    factory = GraphFactory(torch.device("cpu"), "compiled_step")
    assert isinstance(factory.new(whole_step=True), StepCompiledGraph)
    assert isinstance(factory.new(), CompiledGraph)
    assert not factory.shares_twin_captures
    assert GraphFactory(torch.device("cpu"), "compiled").shares_twin_captures
    assert isinstance(
        GraphFactory(torch.device("cpu"), "compiled").new(whole_step=True), CompiledGraph
    )


@pytest.mark.slow
def test_compiled_graphs_give_eager_tokens_on_every_bucket_and_fall_back_outside(
    make_executor: MakeExecutor, tmp_path: Path, graph_compiler: str
) -> None:
    eager = make_executor(graph_mode="none")
    compiled = make_executor(
        graph_mode="both",
        graph_backend="compiled",
        graph_batch_sizes="1,4",  # few buckets: inductor compiles one graph set per bucket
        piecewise_token_sizes="16",
        cache_dir=str(tmp_path),
    )
    assert all(not r.failed for r in compiled.control.capture_reports), (
        compiled.control.capture_reports
    )
    decode = compiled.runner.decode_graphs
    assert decode is not None and set(decode.captured) == {1, 4}
    assert all(
        isinstance(c.graph, CompiledGraph) for kv in decode.captured.values() for c in kv.values()
    )
    if graph_compiler == INDUCTOR:
        # inductor's caches live under --cache-dir, so a restart loads instead of compiling
        assert any((tmp_path / "inductor").rglob("*"))

    slot = 1
    # EXTEND: 5, 8 and 12 tokens pad to 16 (piecewise); 20 is past the largest bucket.
    for row, n in zip((1, 2, 3, 4), (5, 8, 12, 20), strict=True):
        batch = make_extend_batch(
            input_ids=[[(7 * row + j) % 200 + 3 for j in range(n)]],
            req_pool_indices=[row],
            out_cache_loc=[list(range(slot, slot + n))],
        )
        slot += n
        a = eager.forward(batch, return_logits=True)
        b = compiled.forward(batch, return_logits=True)
        if n <= 16:
            assert b.stats.path == "piecewise", n
        else:
            assert (b.stats.path, b.stats.graph_fallback) == (
                "eager",
                GraphFallback("piecewise", "batch_too_large"),
            )
        assert a.logits is not None and b.logits is not None
        assert float((a.logits - b.logits).abs().max()) <= LOGIT_TOL, n
        assert torch.equal(a.next_token_ids, b.next_token_ids), n

    # DECODE: every batch size 1..4 on a bucket (2 and 3 pad to 4); 5 runs eagerly, saying why.
    for bs in range(1, 6):
        rows = list(range(10, 10 + bs))
        lens = [3 + (5 * r) % 11 for r in rows]
        first = 100 * bs
        assert _prefill(eager, rows, lens, first) == _prefill(compiled, rows, lens, first)
        batch = make_decode_batch(
            input_ids=[7 + r for r in rows],
            req_pool_indices=rows,
            seq_lens=[n + 1 for n in lens],
            out_cache_loc=[first + 90 + i for i in range(bs)],
        )
        a = eager.forward(batch, return_logits=True)
        b = compiled.forward(batch, return_logits=True)
        if bs <= 4:
            assert (b.stats.path, b.stats.padded_batch_size) == ("full_graph", 1 if bs == 1 else 4)
        else:
            assert (b.stats.path, b.stats.graph_fallback) == (
                "eager",
                GraphFallback("decode", "batch_too_large"),
            )
        assert a.logits is not None and b.logits is not None
        assert float((a.logits - b.logits).abs().max()) <= LOGIT_TOL, bs
        assert torch.equal(a.next_token_ids, b.next_token_ids), bs


@pytest.mark.slow
def test_decode_graphs_attend_over_the_kv_bucket_the_batch_needs(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = make_executor(graph_mode="none")
    graph = make_executor(graph_mode="decode", graph_batch_sizes="1,2")
    backend = graph.attn_backend
    assert isinstance(backend, TorchPagedBackend)
    decode = graph.runner.decode_graphs
    assert decode is not None
    assert decode.kv_buckets == [256, 1024]  # max_context_len 1024
    assert kv_bucket(300, 1024) == 1024 and kv_bucket(None, 1024) == 1024
    # One graph per (batch size, KV bucket), its gather as wide as its KV bucket.
    for bs, by_kv in decode.captured.items():
        for (_, kv), captured in by_kv.items():  # keyed (with LoRA, KV bucket)
            assert tuple(captured.view.attn_metadata.kv_slots.shape) == (bs, kv)

    replayed: list[int] = []
    real_replay = backend.init_forward_metadata_replay

    def spy(md, bs: int, fb_view, seq_lens_cpu=None) -> None:  # type: ignore[no-untyped-def]
        replayed.append(md.kv_bound)
        real_replay(md, bs, fb_view, seq_lens_cpu)

    monkeypatch.setattr(backend, "init_forward_metadata_replay", spy)
    for row, context in ((1, 20), (2, 400)):  # 21 keys -> bucket 256; 401 keys -> 1024
        _decode_matches_eager(eager, graph, row, context, tol=1e-5)
    assert replayed == [256, 1024]


def _decode_matches_eager(
    eager: ModelExecutor, graph: ModelExecutor, row: int, context: int, *, tol: float
) -> None:
    """Prefill `context` tokens into `row` on both executors, then one DECODE step: the graph
    executor runs it as a full graph, with the eager logits (within `tol`) and tokens."""
    first = 1 + 500 * (row - 1)
    assert _prefill(eager, [row], [context], first) == _prefill(graph, [row], [context], first)
    batch = make_decode_batch(
        input_ids=[9],
        req_pool_indices=[row],
        seq_lens=[context + 1],
        out_cache_loc=[first + context],
    )
    a = eager.forward(batch, return_logits=True)
    b = graph.forward(batch, return_logits=True)
    assert b.stats.path == "full_graph"
    assert a.logits is not None and b.logits is not None
    assert float((a.logits - b.logits).abs().max()) <= tol
    assert torch.equal(a.next_token_ids, b.next_token_ids)


@pytest.mark.slow
def test_compiled_decode_capture_runs_only_the_smallest_kv_bucket(
    make_executor: MakeExecutor,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    graph_compiler: str,
) -> None:
    """A batch size's larger KV buckets are its smallest one's twins: captured without a run
    (the compiled halves never see the KV length), and still replayed at their own width."""
    seen: list[int] = []
    real_forward = TorchPagedBackend.forward

    def spy(self, q, k, v, layer_id, fb):  # type: ignore[no-untyped-def]
        if layer_id == 0:
            seen.append(fb.attn_metadata.kv_bound)
        return real_forward(self, q, k, v, layer_id, fb)

    monkeypatch.setattr(TorchPagedBackend, "forward", spy)
    eager = make_executor(graph_mode="none")
    graph = make_executor(
        graph_mode="decode",
        graph_backend="compiled",
        graph_batch_sizes="1,2",
        cache_dir=str(tmp_path),
    )
    decode = graph.runner.decode_graphs
    assert decode is not None and set(decode.captured) == {1, 2}
    assert all(set(by_kv) == {(False, 256), (False, 1024)} for by_kv in decode.captured.values())
    assert seen and set(seen) == {256}, seen  # no capture run at 1024 keys

    for row, context in ((1, 20), (2, 400)):  # 21 keys -> bucket 256; 401 keys -> 1024
        _decode_matches_eager(eager, graph, row, context, tol=LOGIT_TOL)
        assert seen[-1] == (256 if context < 256 else 1024)  # the graph's step ran last


@pytest.mark.slow
def test_compiled_step_graphs_give_eager_tokens_and_write_the_kv_cache_in_place(
    make_executor: MakeExecutor, tmp_path: Path, graph_compiler: str
) -> None:
    """Two whole-step graphs (bs 1 and 2) in one process: each replays its own code (the
    guards are skipped, so a graph picking up the other's would give wrong rows), the KV
    write inside the graph lands in the pool itself (the next step reads it), and tokens and
    logits are the eager ones."""
    eager = make_executor(graph_mode="none", max_context_len=256)
    graph = make_executor(
        graph_mode="decode",
        graph_backend="compiled_step",
        graph_batch_sizes="1,2",
        max_context_len=256,
        cache_dir=str(tmp_path),
    )
    assert all(not r.failed for r in graph.control.capture_reports), graph.control.capture_reports
    decode = graph.runner.decode_graphs
    assert decode is not None and set(decode.captured) == {1, 2}
    assert all(
        isinstance(c.graph, StepCompiledGraph)
        for kv in decode.captured.values()
        for c in kv.values()
    )
    pool, eager_pool = graph.attn_backend.kv_pool, eager.attn_backend.kv_pool
    pool_ptr = pool.k.data_ptr()

    for rows in ([1], [2, 3], [4]):  # back to bs 1 after bs 2: each graph keeps its own code
        bs = len(rows)
        lens = [5 + 3 * r for r in rows]
        assert _prefill(eager, rows, lens, 1 + 60 * rows[0]) == _prefill(
            graph, rows, lens, 1 + 60 * rows[0]
        )
        ids = [7 + r for r in rows]
        for step in range(3):  # each step attends over the keys the previous one wrote
            locs = [1 + 60 * r + 40 + step for r in rows]
            batch = make_decode_batch(
                input_ids=ids,
                req_pool_indices=rows,
                seq_lens=[n + 1 + step for n in lens],
                out_cache_loc=locs,
            )
            a = eager.forward(batch, return_logits=True)
            b = graph.forward(batch, return_logits=True)
            assert (b.stats.path, b.stats.padded_batch_size) == ("full_graph", bs)
            assert a.logits is not None and b.logits is not None
            assert float((a.logits - b.logits).abs().max()) <= LOGIT_TOL, (bs, step)
            assert torch.equal(a.next_token_ids, b.next_token_ids), (bs, step)
            written = torch.tensor(locs)
            assert torch.allclose(pool.k[:, written], eager_pool.k[:, written], atol=1e-5)
            assert torch.allclose(pool.v[:, written], eager_pool.v[:, written], atol=1e-5)
            ids = a.next_token_ids.tolist()
    assert pool.k.data_ptr() == pool_ptr


@pytest.mark.parametrize(
    ("dtype", "error", "kept"),
    [
        (torch.bfloat16, 0.16, True),  # SmolLM2's bfloat16 step at the capture's padded request
        (torch.bfloat16, 0.9, False),  # a graph traced from other inputs
        (torch.float32, 0.16, False),  # float32 differs by rounding only
        (torch.float32, 1e-5, True),
    ],
)
def test_the_compiled_steps_check_allows_half_precision_rounding_not_a_wrong_graph(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, error: float, kept: bool
) -> None:
    """A compiled step whose output is `error` (relative to its norm) off the eager step's:
    kept within its dtype's tolerance, refused (GraphCaptureError, naming the dtype) beyond."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = torch.empty_like(x)
    # x.roll(1, 1) has x's norm: the compiled output is `error` off, up to rounding.
    monkeypatch.setattr(
        step_graph,
        "compile_step",
        lambda call, compiler: lambda x, out: out.copy_(x + error * x.roll(1, 1)),
    )
    call = StepCall(lambda x, out: out.copy_(x), (x, out), out, "decode-bs4-kv64")
    graph = StepCompiledGraph(store=None)
    if kept:
        graph.capture(call)
        return
    with pytest.raises(GraphCaptureError, match=str(dtype).removeprefix("torch.")):
        graph.capture(call)
