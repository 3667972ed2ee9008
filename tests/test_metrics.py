"""Prometheus metrics of a live server, scraped over HTTP and parsed with prometheus-client."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.outputs import ForwardOutput, StepStats
from executor.observability.metrics import ExecutorMetrics
from executor.observability.single_writer_metrics import SingleWriterCounter, SingleWriterHistogram
from executor.service.codec import batch_to_proto
from executor.service.runtime_config import RuntimeConfigUpdate
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import Scrape, running_server, tiny_config


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tiny_config(tmp_path_factory.mktemp("cache"))) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[ExecutorClient]:
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        yield c


class Request:
    """One request in its own row, prefilled, then decoded step by step."""

    def __init__(self, client: ExecutorClient, row: int, prompt: list[int]) -> None:
        self.client, self.row = client, row
        self.base = row * 200  # the row's own slots
        self.seq = len(prompt)
        out = client.forward(
            make_extend_batch(
                input_ids=[prompt],
                req_pool_indices=[row],
                out_cache_loc=[list(range(self.base, self.base + self.seq))],
            )
        )
        self.token = int(out.next_token_ids[0])

    def decode(self) -> ForwardOutput:
        self.seq += 1
        out = self.client.forward(
            make_decode_batch(
                input_ids=[self.token],
                req_pool_indices=[self.row],
                seq_lens=[self.seq],
                out_cache_loc=[self.base + self.seq - 1],
            )
        )
        self.token = int(out.next_token_ids[0])
        return out


def _step_count(scrape: Scrape, path: str, mode: str) -> float:
    return scrape.get("model_executor_forward_seconds_count", path=path, mode=mode)


def test_no_copy_toggle_moves_steps_between_paths_and_stops_fill_copies(
    server: RunningServer, client: ExecutorClient
) -> None:
    req = Request(client, 1, [5, 6, 7, 8])
    phases = [(False, 3), (True, 4), (False, 2)]  # off, on, off again: one live server
    try:
        for no_copy, steps in phases:
            config = client.update_runtime_config(RuntimeConfigUpdate(eager_input_no_copy=no_copy))
            assert config.eager_input_no_copy is no_copy
            before = Scrape(server)
            assert before.get("model_executor_toggle_eager_input_no_copy") == int(no_copy)
            outs = [req.decode() for _ in range(steps)]
            after = Scrape(server)
            path = "eager_no_copy" if no_copy else "eager"
            other = "eager" if no_copy else "eager_no_copy"
            assert {o.stats.path for o in outs} == {path}
            assert _step_count(after, path, "decode") - _step_count(before, path, "decode") == steps
            assert _step_count(after, other, "decode") == _step_count(before, other, "decode")
            copies = after.get("model_executor_fill_copies_total", registry="eager_decode") - (
                before.get("model_executor_fill_copies_total", registry="eager_decode")
            )
            assert copies == sum(o.stats.fill_tensors for o in outs)
            if no_copy:
                assert copies == 0  # stops increasing...
            else:
                assert copies >= 5 * steps  # ...and resumes: ids, positions, slots, rows, lens
            calls = after.get("model_executor_fill_copy_calls_total", registry="eager_decode")
            calls -= before.get("model_executor_fill_copy_calls_total", registry="eager_decode")
            assert calls == sum(o.stats.fill_copy_calls for o in outs)
            assert (
                after.get("model_executor_tokens_total", mode="decode")
                - before.get("model_executor_tokens_total", mode="decode")
                == steps
            )
    finally:
        client.update_runtime_config(RuntimeConfigUpdate(eager_input_no_copy=False))


def test_extend_steps_count_under_their_mode(server: RunningServer, client: ExecutorClient) -> None:
    before = Scrape(server)
    Request(client, 2, [9, 10, 11])
    Request(client, 3, [12, 13])
    after = Scrape(server)
    assert _step_count(after, "eager", "extend") - _step_count(before, "eager", "extend") == 2
    assert (
        after.get("model_executor_tokens_total", mode="extend")
        - before.get("model_executor_tokens_total", mode="extend")
        == 5
    )
    assert (
        after.get("model_executor_batch_size_count", mode="extend")
        - before.get("model_executor_batch_size_count", mode="extend")
        == 2
    )
    assert after.get("model_executor_fill_copies_total", registry="eager_extend") > before.get(
        "model_executor_fill_copies_total", registry="eager_extend"
    )
    assert (
        after.get("model_executor_queue_wait_seconds_count")
        - before.get("model_executor_queue_wait_seconds_count")
        == 2
    )


def test_needs_cpu_seq_lens_moves_its_gauge_and_never_adds_a_copy(
    server: RunningServer, client: ExecutorClient
) -> None:
    assert server.worker is not None
    req = Request(client, 4, [1, 2, 3])

    def one_step() -> tuple[int, float]:
        before = Scrape(server)
        out = req.decode()
        after = Scrape(server)
        copies = after.get("model_executor_fill_copies_total", registry="eager_decode")
        copies -= before.get("model_executor_fill_copies_total", registry="eager_decode")
        assert copies == out.stats.fill_tensors
        return out.stats.fill_tensors, after.get("model_executor_toggle_needs_cpu_seq_lens")

    try:
        base, gauge = one_step()  # auto: torch_paged reads no host lengths
        assert gauge == 0
        config = client.update_runtime_config(RuntimeConfigUpdate(needs_cpu_seq_lens="on"))
        assert config.needs_cpu_seq_lens == "on" and config.needs_cpu_seq_lens_effective
        assert one_step() == (base, 1)  # the host mirror is carried, not copied to the device
        for mode in ("auto", "off"):
            config = client.update_runtime_config(RuntimeConfigUpdate(needs_cpu_seq_lens=mode))
            assert not config.needs_cpu_seq_lens_effective
            assert one_step() == (base, 0)
    finally:
        client.update_runtime_config(RuntimeConfigUpdate(needs_cpu_seq_lens="auto"))


def test_one_sampled_tokens_sync_per_step(server: RunningServer, client: ExecutorClient) -> None:
    reqs = [Request(client, row, [3, row]) for row in (5, 6)]
    before = Scrape(server)
    steps = 5
    for _ in range(steps):
        seq = [r.seq + 1 for r in reqs]
        out = client.forward(
            make_decode_batch(
                input_ids=[r.token for r in reqs],
                req_pool_indices=[r.row for r in reqs],
                seq_lens=seq,
                out_cache_loc=[r.base + s - 1 for r, s in zip(reqs, seq, strict=True)],
            )
        )
        assert out.stats.d2h_syncs == 1
        for r, s, t in zip(reqs, seq, out.next_token_ids.tolist(), strict=True):
            r.seq, r.token = s, t
    after = Scrape(server)
    name = "model_executor_d2h_syncs_total"
    assert after.get(name, reason="sampled_tokens") - before.get(name, reason="sampled_tokens") == (
        steps
    )
    nbytes = after.get("model_executor_d2h_bytes_total", reason="sampled_tokens")
    nbytes -= before.get("model_executor_d2h_bytes_total", reason="sampled_tokens")
    assert nbytes == steps * 2 * 8  # two int64 token ids per step


def test_requests_total_counts_status_codes(server: RunningServer, client: ExecutorClient) -> None:
    bad = batch_to_proto(
        make_extend_batch(input_ids=[[1, 2]], req_pool_indices=[0], out_cache_loc=[[1, 2]])
    )  # row 0 is reserved
    before = Scrape(server)
    with (
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        pb_grpc.ModelExecutorStub(channel).Forward(pb.ForwardRequest(batch_id=9, batch=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    Request(client, 7, [4, 4])
    after = Scrape(server)

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert delta("model_executor_requests_total", method="Forward", code="INVALID_ARGUMENT") == 1
    assert delta("model_executor_requests_total", method="Forward", code="OK") == 1
    assert delta("model_executor_rpc_seconds_count", method="Forward") == 2
    # A refused batch is not a step.
    assert delta("model_executor_forward_seconds_count", path="eager", mode="extend") == 1


def test_state_gauges_and_build_info(server: RunningServer, client: ExecutorClient) -> None:
    info = client.info().info
    before = Scrape(server)
    Request(client, 8, [1, 2, 3, 4, 5, 6])
    after = Scrape(server)
    assert after.get("model_executor_ready") == 1
    assert after.get("model_executor_queue_depth") == 0
    assert after.get("model_executor_kv_slots_total") == info.limits.kv_slots
    assert (
        after.get("model_executor_req_rows_used") - before.get("model_executor_req_rows_used") == 1
    )
    assert (
        after.get("model_executor_kv_slots_used") - before.get("model_executor_kv_slots_used") == 6
    )
    labels = {
        "version": info.version,
        "model": info.model_name,
        "device": info.device,
        "dtype": info.dtype,
        "attention_backend": info.attention_backend,
        "quantization": "none",
        "linear_kernel": info.linear_kernel,
        "tp_size": "1",
        "rank": "0",
    }
    assert after.get("model_executor_build_info", **labels) == 1
    assert info.quantization == "none" and info.weight_bytes > 0
    # The test server runs float32 on CPU: its linears are packed (auto).
    assert info.linear_kernel == ("onednn" if torch.backends.mkldnn.is_available() else "aten")
    modes = {m: after.get("model_executor_toggle_graph_mode_info", mode=m) for m in
             ("none", "decode", "extend", "both")}  # fmt: skip
    assert modes == {"none": 1, "decode": 0, "extend": 0, "both": 0}


def test_graph_hooks_reach_the_metrics(server: RunningServer) -> None:
    assert server.worker is not None
    observer = server.worker.executor.observer
    assert observer is server.telemetry.metrics  # the executor reports to this server's metrics
    before = Scrape(server)
    observer.on_graph_capture("decode", 1.5, True)
    observer.on_graph_capture("decode", 0.5, False)
    observer.on_graph_fallback("decode", "batch_too_large")
    observer.on_graph_fallback("decode", "batch_too_large")
    after = Scrape(server)

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert delta("model_executor_graph_captures_total", kind="decode") == 1
    assert delta("model_executor_graph_capture_failures_total", kind="decode") == 1
    assert delta("model_executor_graph_capture_seconds_count", kind="decode") == 1
    assert delta("model_executor_graph_capture_seconds_sum", kind="decode") == 1.5
    fallbacks = delta(
        "model_executor_graph_fallbacks_total", kind="decode", reason="batch_too_large"
    )
    assert fallbacks == 2


def test_metrics_port_can_be_turned_off(tmp_path: pytest.TempPathFactory) -> None:
    with running_server(tiny_config(tmp_path), metrics_port=-1) as srv:  # type: ignore[arg-type]
        assert srv.metrics_port is None


def test_the_endpoint_closes_with_the_server(tmp_path: pytest.TempPathFactory) -> None:
    with running_server(tiny_config(tmp_path)) as srv:  # type: ignore[arg-type]
        port = srv.metrics_port
        assert port and Scrape(srv).get("model_executor_ready") == 1
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


# --- units: the metrics object and the single-writer families ---


def _stats(path: str, mode: str, **kw: object) -> StepStats:
    values: dict[str, object] = {
        "batch_size": 3,
        "padded_batch_size": 4,
        "num_tokens": 3,
        "padded_num_tokens": 4,
        "timings_ns": {"total": 2_000_000, "queue": 50_000},
        "fill_registry": "graph_decode",
        "fill_tensors": 6,
        "fill_bytes": 96,
        "fill_copy_calls": 2,
    }
    values.update(kw)
    return StepStats(path=path, mode=mode, **values)  # type: ignore[arg-type]


def _parse(metrics: ExecutorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_observe_step_records_every_step_metric() -> None:
    m = ExecutorMetrics()
    m.observe_step(_stats("full_graph", "decode"))
    m.observe_step(_stats("full_graph", "decode", timings_ns={"total": 20_000_000}))
    got = _parse(m)
    fs = "model_executor_forward_seconds"
    labels = (("mode", "decode"), ("path", "full_graph"))
    assert got[(fs + "_count", labels)] == 2
    assert got[(fs + "_bucket", (("le", "0.0025"), *labels))] == 1  # 2 ms
    assert got[(fs + "_bucket", (("le", "0.025"), *labels))] == 2  # 20 ms
    assert got[(fs + "_bucket", (("le", "+Inf"), *labels))] == 2
    assert got[(fs + "_sum", labels)] == pytest.approx(0.022)
    assert got[("model_executor_padding_tokens_total", (("path", "full_graph"),))] == 2
    assert got[("model_executor_tokens_total", (("mode", "decode"),))] == 6
    assert (
        got[("model_executor_padded_batch_size_bucket", (("le", "4.0"), ("path", "full_graph")))]
        == 2
    )
    assert (
        got[("model_executor_padded_batch_size_bucket", (("le", "2.0"), ("path", "full_graph")))]
        == 0
    )
    assert got[("model_executor_fill_copies_total", (("registry", "graph_decode"),))] == 12
    assert got[("model_executor_fill_bytes_total", (("registry", "graph_decode"),))] == 192
    assert got[("model_executor_fill_copy_calls_total", (("registry", "graph_decode"),))] == 4
    assert got[("model_executor_queue_wait_seconds_count", ())] == 1  # one step had a queue time


def test_each_metrics_object_has_its_own_registry() -> None:
    a, b = ExecutorMetrics(), ExecutorMetrics()
    a.observe_step(_stats("eager", "extend"))
    a.observe_rpc("Forward", "OK", 0.01)
    assert (
        _parse(a)[("model_executor_requests_total", (("code", "OK"), ("method", "Forward")))] == 1
    )
    assert ("model_executor_requests_total", (("code", "OK"), ("method", "Forward"))) not in _parse(
        b
    )
    assert _parse(b)[("model_executor_tokens_total", (("mode", "extend"),))] == 0


def test_single_writer_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    h = SingleWriterHistogram("h_seconds", "doc", ("k",), reg, buckets=(1.0, 2.0))
    c = SingleWriterCounter("c", "doc", (), reg)
    for v in (0.5, 1.0, 1.5, 3.0):
        h.labels("x").observe(v)
    c.labels().inc(2)
    with pytest.raises(ValueError, match="expected labels"):
        h.labels()
    got = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(generate_latest(reg).decode())
        for s in f.samples
    }
    assert got[("h_seconds_bucket", "1.0")] == 2  # 0.5 and 1.0 (le is inclusive)
    assert got[("h_seconds_bucket", "2.0")] == 3
    assert got[("h_seconds_bucket", "+Inf")] == 4
    assert got[("h_seconds_count", None)] == 4
    assert got[("h_seconds_sum", None)] == 6.0
    assert got[("c_total", None)] == 2
