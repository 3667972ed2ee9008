"""Full-graph DECODE and piecewise EXTEND compute what eager computes, and padding is harmless.

Everything here runs on CPU through the graph stand-in, whose capture refuses what CUDA
capture refuses; the `gpu` tests repeat the equality check with real CUDA graphs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.errors import ToggleRefusedError
from executor.core.forward_batch import ForwardBatch
from executor.core.runner_output import GraphFallback
from executor.graphs.graph import CpuGraph, GraphCaptureError
from executor.graphs.settings import graph_settings
from executor.model_executor import ModelExecutor
from executor.models.blocks import DecoderLayer
from executor.models.llama import LlamaForCausalLM
from ops.host_transfer import to_host
from tests.random_batches import BatchGenerator

MakeExecutor = Callable[..., ModelExecutor]
LOGIT_TOL = 1e-5
GRAPHS = {"graph_batch_sizes": "1,2,4,8", "piecewise_token_sizes": "8,16,32,64,128"}


def _prefill(
    ex: ModelExecutor, rows: list[int], lens: list[int], first_slot: int
) -> list[list[int]]:
    locs, slot = [], first_slot
    for n in lens:
        locs.append(list(range(slot, slot + n)))
        slot += n
    ids = [[(11 * r + j) % 500 + 3 for j in range(n)] for r, n in zip(rows, lens, strict=True)]
    ex.forward(make_extend_batch(input_ids=ids, req_pool_indices=rows, out_cache_loc=locs))
    return locs


# --- the CPU stand-in refuses what CUDA capture refuses ------------------------------------
def test_capture_refuses_a_host_read_and_names_it() -> None:
    x = torch.arange(4.0)

    def reads_the_host() -> None:
        x.sum().item()

    with pytest.raises(GraphCaptureError, match=r"Tensor\.item\(\)"):
        CpuGraph().capture(reads_the_host)


def test_capture_refuses_data_dependent_sizes_and_counted_transfers() -> None:
    x = torch.tensor([0, 3, 0, 5])

    def data_dependent_size() -> None:
        x.nonzero()

    def counted_transfer() -> None:
        to_host(x, "sampled_tokens")

    with pytest.raises(GraphCaptureError, match=r"aten\.nonzero"):
        CpuGraph().capture(data_dependent_size)
    with pytest.raises(GraphCaptureError, match="to_host"):
        CpuGraph().capture(counted_transfer)


def test_replay_reads_the_static_buffers_of_the_moment() -> None:
    src, dst = torch.zeros(3), torch.zeros(3)

    def double() -> None:
        dst.copy_(src * 2)

    graph = CpuGraph()
    graph.capture(double)
    src.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert dst.tolist() == [2.0, 4.0, 6.0]


# --- equality with eager -----------------------------------------------------------------
@pytest.mark.slow
def test_every_decode_batch_size_equals_eager(make_executor: MakeExecutor) -> None:
    eager = make_executor(graph_mode="none")
    graph = make_executor(graph_mode="decode", **GRAPHS)
    for bs in range(1, 9):  # 3, 5, 6 and 7 are padded up to a bucket
        rows = list(range(1, bs + 1))
        lens = [3 + (5 * r) % 11 for r in rows]
        locs = _prefill(eager, rows, lens, first_slot=100 * bs)
        assert _prefill(graph, rows, lens, first_slot=100 * bs) == locs
        batch = make_decode_batch(
            input_ids=[7 + r for r in rows],
            req_pool_indices=rows,
            seq_lens=[n + 1 for n in lens],
            out_cache_loc=[locs[-1][-1] + 1 + i for i in range(bs)],
        )
        a = eager.forward(batch, return_logits=True)
        b = graph.forward(batch, return_logits=True)
        assert b.stats.path == "full_graph" and b.stats.padded_batch_size == {
            3: 4,
            5: 8,
            6: 8,
            7: 8,
        }.get(bs, bs)
        assert b.stats.fill_registry == "graph_decode"
        assert a.logits is not None and b.logits is not None
        assert float((a.logits - b.logits).abs().max()) <= LOGIT_TOL, f"bs={bs}"
        assert torch.equal(a.next_token_ids, b.next_token_ids), f"bs={bs}"


@pytest.mark.slow
def test_100_random_steps_match_eager_on_graph_paths(make_executor: MakeExecutor) -> None:
    eager = make_executor(graph_mode="none", kv_slots=4096)
    graph = make_executor(graph_mode="both", kv_slots=4096, **GRAPHS)
    gen = BatchGenerator(seed=11, limits=eager.limits, max_batch_size=6)
    paths: Counter[str] = Counter()
    fallbacks: Counter[str] = Counter()
    for step in range(100):
        fb = gen.next_batch(step)
        a = eager.forward(fb, return_logits=True)
        b = graph.forward(fb, return_logits=True)
        where = f"step {step}: {fb.forward_mode.name} bs={fb.batch_size} T={fb.num_tokens} path={b.stats.path}"
        assert a.logits is not None and b.logits is not None
        if a.logits.numel():
            assert float((a.logits - b.logits).abs().max()) <= LOGIT_TOL, where
        assert torch.equal(a.next_token_ids, b.next_token_ids), where
        paths[b.stats.path] += 1
        if b.stats.graph_fallback:
            fallbacks[b.stats.graph_fallback] += 1
        if not fb.forward_mode.is_idle():
            gen.observe(fb, a.next_token_ids)
    assert paths["full_graph"] >= 10 and paths["piecewise"] >= 10, paths
    assert gen.kinds["chunk"] and gen.kinds["shared_prefix"], (
        gen.kinds
    )  # chunked prefill, shared prefixes
    assert GraphFallback("piecewise", "input_embeds") in fallbacks, (
        fallbacks
    )  # embeds batches run eagerly
    # Real slots hold the same K/V (slot 0, the padding sink, is written only by graph paths).
    for a_kv, b_kv in ((eager.kv_pool.k, graph.kv_pool.k), (eager.kv_pool.v, graph.kv_pool.v)):
        assert float((a_kv[:, 1:] - b_kv[:, 1:]).abs().max()) <= LOGIT_TOL


# --- padding never touches real state ----------------------------------------------------
def _snapshot(ex: ModelExecutor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ex.kv_pool.k.clone(), ex.kv_pool.v.clone(), ex.req_to_token_pool.req_to_token.clone()


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    diff = (before != after).flatten(2).any(-1).any(0)  # [slots + 1]
    return set(diff.nonzero().flatten().tolist())


@pytest.mark.slow
def test_padded_decode_rows_write_only_slot_zero(make_executor: MakeExecutor) -> None:
    ex = make_executor(graph_mode="decode", graph_batch_sizes="4")
    locs = _prefill(ex, [1, 2, 3], [5, 6, 7], first_slot=10)
    ex.kv_pool.k[:, 0] = 99.0  # poison the sink so a write to it shows
    ex.kv_pool.v[:, 0] = 99.0
    k0, v0, table0 = _snapshot(ex)
    new_slots = [200, 201, 202]
    batch = make_decode_batch(
        input_ids=[4, 5, 6], req_pool_indices=[1, 2, 3], seq_lens=[6, 7, 8], out_cache_loc=new_slots
    )
    out = ex.forward(batch)
    assert (out.stats.path, out.stats.padded_batch_size) == ("full_graph", 4)
    k1, v1, table1 = _snapshot(ex)
    assert _changed_slots(k0, k1) == _changed_slots(v0, v1) == {0, *new_slots}
    changed_cells = set(map(tuple, (table0 != table1).nonzero().tolist()))
    assert changed_cells == {(1, 5), (2, 6), (3, 7)}  # the real rows' new positions only
    assert int(table1[0].abs().sum()) == 0  # the padding row still names slot 0 only
    assert locs  # the prefill's slots are untouched (not in the changed set above)


@pytest.mark.slow
def test_padded_piecewise_tokens_never_write_kv(make_executor: MakeExecutor) -> None:
    ex = make_executor(graph_mode="extend", piecewise_token_sizes="8")
    ex.kv_pool.k[:, 0] = 99.0
    k0, v0, _ = _snapshot(ex)
    out_loc = [[30, 31, 32], [40, 41]]  # 5 real tokens in an 8-token bucket
    out = ex.forward(
        make_extend_batch(
            input_ids=[[3, 4, 5], [6, 7]], req_pool_indices=[1, 2], out_cache_loc=out_loc
        )
    )
    assert (out.stats.path, out.stats.padded_num_tokens) == ("piecewise", 8)
    k1, v1, _ = _snapshot(ex)
    assert _changed_slots(k0, k1) == _changed_slots(v0, v1) == {30, 31, 32, 40, 41}


# --- capture failures fall back to eager ---------------------------------------------------
@pytest.mark.slow
def test_a_capture_unsafe_op_fails_capture_by_name_and_runs_eagerly(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = make_executor(graph_mode="none")
    real = DecoderLayer.post_attention

    def unsafe(
        self: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attn_out.abs().sum().item() < 0:  # a host read: fine eagerly, refused in capture
            raise AssertionError("unreachable")
        return real(self, attn_out, residual)

    monkeypatch.setattr(DecoderLayer, "post_attention", unsafe)
    ex = make_executor(graph_mode="both", graph_batch_sizes="1,2", piecewise_token_sizes="8")
    reports = {r.kind: r for r in ex.control.capture_reports}
    # As on CUDA, the forbidden op poisons the capture: the largest bucket fails, nothing
    # after it is tried (not the smaller bucket, not the piecewise runner).
    assert reports["decode"].captured == [] and set(reports["decode"].failed) == {2}
    assert reports["piecewise"].captured == [] and reports["piecewise"].failed == {}
    assert reports["decode"].poisoned is not None and "Tensor.item()" in reports["decode"].poisoned
    assert reports["piecewise"].poisoned == reports["decode"].poisoned
    assert "Tensor.item()" in ex.info.graph_capture_disabled
    for fb_maker in (
        lambda: make_extend_batch(
            input_ids=[[3, 4, 5]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
        ),
        lambda: make_decode_batch(
            input_ids=[9], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[4]
        ),
    ):
        fb = fb_maker()
        a = reference.forward(fb, return_logits=True)
        b = ex.forward(fb, return_logits=True)
        assert b.stats.path == "eager" and b.stats.graph_fallback in (
            GraphFallback("piecewise", "capture_poisoned"),
            GraphFallback("decode", "capture_poisoned"),
        )
        assert torch.equal(a.logits, b.logits)


# --- capture and replay agree on num_token_non_padded ------------------------------------
@pytest.mark.slow
def test_capture_and_replay_agree_on_num_token_non_padded(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[int, torch.Tensor] = {}  # per bucket: what the graph's body read
    real = LlamaForCausalLM.forward

    def probe(
        self: LlamaForCausalLM,
        input_ids,
        positions,
        fb: ForwardBatch,
        attn,
        input_embeds=None,
        keep=None,
    ):  # type: ignore[no-untyped-def]
        if (
            fb.num_token_non_padded is not None
        ):  # graph views only; a device copy, recorded in the graph
            seen.setdefault(fb.batch_size, torch.zeros(1, dtype=torch.int32)).copy_(
                fb.num_token_non_padded
            )
        return real(self, input_ids, positions, fb, attn, input_embeds, keep)

    monkeypatch.setattr(LlamaForCausalLM, "forward", probe)
    ex = make_executor(graph_mode="decode", **GRAPHS)
    buckets = [1, 2, 4, 8]
    at_capture = {b: int(seen[b]) for b in buckets}
    assert at_capture == {b: b for b in buckets}
    for b in buckets:
        rows = list(range(1, b + 1))
        locs = _prefill(ex, rows, [2] * b, first_slot=50 * b)
        ex.forward(
            make_decode_batch(
                input_ids=[5] * b,
                req_pool_indices=rows,
                seq_lens=[3] * b,
                out_cache_loc=[locs[-1][-1] + 1 + i for i in range(b)],
            )
        )
        assert int(seen[b]) == at_capture[b], (
            f"bucket {b}: capture saw {at_capture[b]}, replay {int(seen[b])}"
        )
    # A padded batch carries its real count into the bucket's graph.
    locs = _prefill(ex, [1, 2, 3], [2, 2, 2], first_slot=900)
    out = ex.forward(
        make_decode_batch(
            input_ids=[5, 5, 5],
            req_pool_indices=[1, 2, 3],
            seq_lens=[3, 3, 3],
            out_cache_loc=[950, 951, 952],
        )
    )
    assert out.stats.padded_batch_size == 4 and int(seen[4]) == 3


# --- dispatch, fallbacks and the runtime switch --------------------------------------------
@pytest.mark.slow
def test_fallback_reasons(make_executor: MakeExecutor) -> None:
    ex = make_executor(graph_mode="both", graph_batch_sizes="1,2", piecewise_token_sizes="4")
    _prefill(ex, [1, 2, 3], [2, 2, 2], first_slot=1)
    big = make_decode_batch(
        input_ids=[5, 5, 5],
        req_pool_indices=[1, 2, 3],
        seq_lens=[3, 3, 3],
        out_cache_loc=[20, 21, 22],
    )
    assert ex.forward(big).stats.graph_fallback == GraphFallback("decode", "batch_too_large")
    long = make_extend_batch(
        input_ids=[[1] * 6], req_pool_indices=[4], out_cache_loc=[list(range(30, 36))]
    )
    assert ex.forward(long).stats.graph_fallback == GraphFallback("piecewise", "batch_too_large")
    # DECODE graphs with a backend that cannot be captured: refused at start-up, naming both.
    for mode in ("decode", "both"):
        with pytest.raises(ValueError, match=f"graph_mode={mode} and attention_backend=torch_n"):
            make_executor(attention_backend="torch_native", graph_mode=mode)
    native = make_executor(attention_backend="torch_native", graph_mode="auto")
    assert native.toggles.graph_mode == "none" and native.control.capture_reports == []
    [reason] = [c.reason for c in native.info.choices if c.setting == "graph_mode"]
    assert "torch_native cannot be captured" in reason


@pytest.mark.slow
def test_graph_mode_switches_at_runtime_and_refuses_what_it_cannot_honour(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor(graph_mode="none", graph_batch_sizes="1,2")
    _prefill(ex, [1], [2], first_slot=1)
    step = make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[3], out_cache_loc=[9])
    assert ex.forward(step).stats.path == "eager"
    reports = ex.control.set_graph_mode("decode")  # captured now, on first use
    assert [r.kind for r in reports] == ["decode"] and reports[0].captured == [2, 1]
    step = make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[10])
    assert ex.forward(step).stats.path == "full_graph"
    assert ex.control.set_graph_mode("none") == [] and ex.toggles.graph_mode == "none"
    assert ex.control.set_graph_mode("decode") == []  # already captured: no second capture
    native = make_executor(attention_backend="torch_native", graph_mode="none")
    with pytest.raises(ToggleRefusedError, match="cannot be captured"):
        native.control.set_graph_mode("decode")
    assert native.toggles.graph_mode == "none"
    off = make_executor(needs_cpu_seq_lens="off", graph_mode="none")
    with pytest.raises(ToggleRefusedError, match="needs_cpu_seq_lens"):
        off.control.set_graph_mode("extend")
    assert off.toggles.graph_mode == "none" and off.runner.piecewise is None


def test_bucket_lists_come_from_config_within_limits(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    s = graph_settings(ex.config.replace(graph_max_bs=20), ex.limits)
    assert s.decode_buckets == [1, 2, 4, 8, 16]  # cut at max_batch_size (16)
    limits = dataclasses.replace(ex.limits, max_tokens_per_batch=32)
    s = graph_settings(ex.config.replace(piecewise_token_sizes="64,8,16"), limits)
    assert s.piecewise_buckets == [8, 16]  # 64 exceeds the per-batch token limit
    cpu = graph_settings(ex.config, ex.limits, torch.device("cpu"))  # the CPU ladders
    assert cpu.decode_buckets == [1, 2, 4, 8, 16]
    assert cpu.piecewise_buckets == [16, 32, 64, 128, 256, 512, 1024]


@pytest.mark.gpu
def test_cuda_graphs_match_eager(make_executor: MakeExecutor) -> None:
    """Real CUDA graphs (the fixture's default is the CPU stand-in), full and piecewise,
    against eager; every step took a graph path where one applies."""
    eager = make_executor(device="cuda", dtype="float32", graph_mode="none", kv_slots=4096)
    graph = make_executor(
        device="cuda",
        dtype="float32",
        graph_mode="both",
        graph_backend="cuda",
        kv_slots=4096,
        **GRAPHS,
    )
    assert all(not r.failed for r in graph.control.capture_reports)
    gen = BatchGenerator(seed=5, limits=eager.limits, max_batch_size=6)
    for step in range(60):
        fb = gen.next_batch(step)
        a = eager.forward(fb, return_logits=True)
        b = graph.forward(fb, return_logits=True)
        assert a.logits is not None and b.logits is not None
        if a.logits.numel():
            assert float((a.logits - b.logits).abs().max()) <= 1e-4, f"step {step}"
        if not fb.forward_mode.is_idle():
            gen.observe(fb, a.next_token_ids)
