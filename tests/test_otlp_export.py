"""OpenTelemetry export for real: an OTLP/gRPC receiver built from the opentelemetry-proto
service definitions, in this test, receives the spans of a Forward call under the caller's
trace id (the server configured with trace_exporter=otlp, as in production)."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from executor.batch_prep import make_extend_batch
from executor.service.codec import batch_to_proto
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import running_server, tiny_config

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span with its resource attributes."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.received = threading.Event()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, str, str]]:
        """(name, trace id hex, parent span id hex) of every span received."""
        return [
            (span.name, span.trace_id.hex(), span.parent_span_id.hex())
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]


@pytest.mark.slow
def test_forward_spans_reach_an_otlp_collector_under_the_callers_trace(tmp_path: Path) -> None:
    receiver = Receiver()
    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    try:
        with running_server(
            tiny_config(tmp_path),
            trace_exporter="otlp",
            trace_otlp_endpoint=f"http://127.0.0.1:{port}",
        ) as server:
            batch = make_extend_batch(
                input_ids=[[5, 6]], req_pool_indices=[1], out_cache_loc=[[1, 2]]
            )
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                pb_grpc.ModelExecutorStub(channel).Forward(
                    pb.ForwardRequest(batch_id=1, batch=batch_to_proto(batch)),
                    metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN}-01")],
                    timeout=30,
                )
        # drain() shut the tracer provider down, which flushes the batch processor.
        assert receiver.received.wait(30), "no export reached the collector"
    finally:
        collector.stop(grace=None)
    spans = receiver.spans()
    ours = [s for s in spans if s[1] == TRACE_ID]
    names = {name for name, _, _ in ours}
    assert "model_executor.v1.ModelExecutor/Forward" in names, spans
    [server_span] = [s for s in ours if s[0] == "model_executor.v1.ModelExecutor/Forward"]
    assert server_span[2] == PARENT_SPAN  # a child of the caller's span
    assert len(ours) > 1  # and the step's phases below it
    resource = receiver.requests[0].resource_spans[0].resource
    assert any(a.key == "service.name" for a in resource.attributes)
