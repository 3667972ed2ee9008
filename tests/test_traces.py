"""OpenTelemetry spans of a live server, collected by an in-memory exporter."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.observability.tracing import Tracing, make_exporter
from executor.service.codec import batch_to_proto
from executor.service.runtime_config import RuntimeConfigUpdate
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import running_server, tiny_config

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
FORWARD = "model_executor.v1.ModelExecutor/Forward"
STEP_CHILDREN = {"decode", "queue", "validate", "stage", "forward", "sample", "encode"}


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, exporter: InMemorySpanExporter
) -> Iterator[RunningServer]:
    with running_server(
        tiny_config(tmp_path_factory.mktemp("cache")), span_exporter=exporter
    ) as running:
        yield running


@pytest.fixture
def stub(
    server: RunningServer, exporter: InMemorySpanExporter
) -> Iterator[pb_grpc.ModelExecutorStub]:
    exporter.clear()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.ModelExecutorStub(channel)


def traceparent(sampled: bool = True) -> list[tuple[str, str]]:
    return [("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-{'01' if sampled else '00'}")]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    return {
        s.name: s
        for s in spans
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }


def test_forward_span_continues_the_callers_trace_with_every_phase(
    stub: pb_grpc.ModelExecutorStub, exporter: InMemorySpanExporter
) -> None:
    batch = make_extend_batch(
        input_ids=[[5, 6, 7]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
    )
    stub.Forward(
        pb.ForwardRequest(batch_id=41, batch=batch_to_proto(batch)), metadata=traceparent()
    )
    spans = list(exporter.get_finished_spans())
    [server] = [s for s in spans if s.name == FORWARD]
    assert server.kind is SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == CALLER_SPAN
    attrs = dict(server.attributes or {})
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.method"] == "Forward"
    assert attrs["rpc.grpc.status_code"] == 0
    assert attrs["model_executor.batch_id"] == 41
    assert attrs["model_executor.mode"] == "extend"
    assert attrs["model_executor.batch_size"] == 1
    assert attrs["model_executor.padded_batch_size"] == 1
    assert attrs["model_executor.fill_copies"] > 0
    assert attrs["model_executor.d2h_syncs"] == 1
    kids = children(spans, server)
    assert set(kids) == STEP_CHILDREN
    assert dict(kids["forward"].attributes or {})["model_executor.path"] == "eager"
    # The device-thread phases were drawn from the step's recorded start times: in order, and
    # inside the server span.
    starts = [kids[n].start_time or 0 for n in ("decode", "queue", "validate", "stage")]
    starts += [kids[n].start_time or 0 for n in ("forward", "sample", "encode")]
    assert starts == sorted(starts)
    assert all((server.start_time or 0) <= (s.start_time or 0) for s in kids.values())
    assert all((s.end_time or 0) <= (server.end_time or 0) for s in kids.values())


def test_stream_has_one_step_span_per_batch(
    stub: pb_grpc.ModelExecutorStub, exporter: InMemorySpanExporter
) -> None:
    prefill = make_extend_batch(input_ids=[[8, 9]], req_pool_indices=[2], out_cache_loc=[[20, 21]])
    decode = make_decode_batch(
        input_ids=[3], req_pool_indices=[2], seq_lens=[3], out_cache_loc=[22]
    )
    requests = [
        pb.ForwardRequest(batch_id=i + 1, batch=batch_to_proto(b))
        for i, b in enumerate((prefill, decode))
    ]
    answers = list(stub.ForwardStream(iter(requests), metadata=traceparent()))
    assert len(answers) == 2
    spans = list(exporter.get_finished_spans())
    [server] = [s for s in spans if s.name == "model_executor.v1.ModelExecutor/ForwardStream"]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    steps = [
        s
        for s in spans
        if s.name == "step" and s.parent and s.parent.span_id == server.context.span_id
    ]
    assert sorted(dict(s.attributes or {})["model_executor.batch_id"] for s in steps) == [1, 2]
    for step in steps:
        assert set(children(spans, step)) == STEP_CHILDREN
    modes = {dict(s.attributes or {})["model_executor.mode"] for s in steps}
    assert modes == {"extend", "decode"}


def test_a_refused_batch_ends_its_span_with_the_status(
    stub: pb_grpc.ModelExecutorStub, exporter: InMemorySpanExporter
) -> None:
    bad = make_extend_batch(input_ids=[[5]], req_pool_indices=[0], out_cache_loc=[[9]])
    with pytest.raises(grpc.RpcError):
        stub.Forward(
            pb.ForwardRequest(batch_id=5, batch=batch_to_proto(bad)), metadata=traceparent()
        )
    [server] = [s for s in exporter.get_finished_spans() if s.name == FORWARD]
    attrs = dict(server.attributes or {})
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not server.status.is_ok and "INVALID_ARGUMENT" in (server.status.description or "")


def test_sample_ratio_is_a_runtime_toggle_and_a_sampled_caller_wins(
    server: RunningServer, stub: pb_grpc.ModelExecutorStub, exporter: InMemorySpanExporter
) -> None:
    def spans_of_one_forward(row: int, metadata: list[tuple[str, str]]) -> int:
        exporter.clear()
        batch = make_extend_batch(
            input_ids=[[1]], req_pool_indices=[row], out_cache_loc=[[row * 10]]
        )
        stub.Forward(
            pb.ForwardRequest(batch_id=row, batch=batch_to_proto(batch)), metadata=metadata
        )
        return len(exporter.get_finished_spans())

    with ExecutorClient(f"127.0.0.1:{server.port}") as client:
        try:
            assert spans_of_one_forward(10, []) > 0  # ratio 1: every RPC is a root
            client.update_runtime_config(RuntimeConfigUpdate(trace_sample_ratio=0.0))
            assert client.get_runtime_config().trace_sample_ratio == 0.0
            assert spans_of_one_forward(11, []) == 0
            assert spans_of_one_forward(12, traceparent(sampled=False)) == 0
            assert spans_of_one_forward(13, traceparent(sampled=True)) > 0
        finally:
            client.update_runtime_config(RuntimeConfigUpdate(trace_sample_ratio=1.0))


def test_without_an_exporter_spans_keep_ids_but_record_nothing() -> None:
    tracing = Tracing("none")
    span = tracing.server_span(FORWARD, traceparent())
    ctx = span.get_span_context()
    assert not span.is_recording()
    assert ctx.is_valid and format(ctx.trace_id, "032x") == TRACE_ID  # logs still correlate
    root = tracing.server_span(FORWARD, ()).get_span_context()
    assert root.is_valid and format(root.trace_id, "032x") != TRACE_ID
    tracing.shutdown()


def test_exporters_from_config() -> None:
    assert make_exporter("none", "") is None
    assert isinstance(make_exporter("console", ""), ConsoleSpanExporter)
    otlp = make_exporter("otlp", "http://127.0.0.1:4317")  # connects lazily
    assert isinstance(otlp, OTLPSpanExporter)
    otlp.shutdown()
    with pytest.raises(ValueError, match="trace_exporter"):
        make_exporter("zipkin", "")
