"""OpenTelemetry traces: one server span per RPC, continuing the caller's W3C `traceparent`.

Each server owns a `Tracing` (its own TracerProvider, never the global one, so tests can
attach an in-memory exporter). Under an RPC's span (a stream adds one `step` span per batch):
`decode` and `encode` are timed live on the RPC thread; `queue`, `validate`, `stage`,
`forward` (attribute `model_executor.path`) and `sample` ran on the device thread and are
drawn afterwards from the step clock's records (`StepStats.started_ns` / `timings_ns`,
each phase's wall-clock start and duration), so the device thread creates no spans.

Sampling is `parentbased_traceidratio`: a caller's sampled flag is honoured, RPCs without a
sampled caller are kept with probability `trace_sample_ratio` (a runtime toggle). With no
exporter nothing is recorded, but spans still get ids, which the logs carry.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

import executor

if TYPE_CHECKING:
    from opentelemetry.trace.span import TraceState

    from executor.core.outputs import StepStats

TRACE_EXPORTERS = ("none", "console", "otlp")
STEP_PHASES = ("queue", "validate", "stage", "forward", "sample")  # drawn after the step
_PROPAGATOR = TraceContextTextMapPropagator()
_NO_SPAN = nullcontext()  # reusable


class RuntimeRatioSampler(Sampler):
    """`ParentBased(TraceIdRatioBased(ratio))` whose ratio can change while serving; drops
    everything when no exporter would receive the spans."""

    def __init__(self, ratio: float, *, exporting: bool) -> None:
        self.exporting = exporting
        self.set_ratio(ratio)

    def set_ratio(self, ratio: float) -> None:
        self.ratio = ratio
        self._delegate: Sampler = ParentBased(TraceIdRatioBased(ratio))

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        sampler = self._delegate if self.exporting else ALWAYS_OFF
        return sampler.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"RuntimeRatioSampler{{{self.ratio}, exporting={self.exporting}}}"


def make_exporter(kind: str, endpoint: str) -> SpanExporter | None:
    """The exporter `trace_exporter` names: none, console (stderr), or OTLP over gRPC."""
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter(out=sys.stderr)  # stdout carries the JSON logs
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"trace_exporter must be one of {', '.join(TRACE_EXPORTERS)}, got {kind!r}")


class Tracing:
    """One server's tracer provider, sampler and exporters."""

    def __init__(
        self,
        exporter: str = "none",
        endpoint: str = "",
        sample_ratio: float = 1.0,
        *,
        extra_exporter: SpanExporter | None = None,
    ) -> None:
        configured = make_exporter(exporter, endpoint)
        self.sampler = RuntimeRatioSampler(
            sample_ratio, exporting=configured is not None or extra_exporter is not None
        )
        resource = Resource.create(
            {"service.name": "model-executor", "service.version": executor.__version__}
        )
        self.provider = TracerProvider(
            sampler=self.sampler, resource=resource, shutdown_on_exit=False
        )
        if configured is not None:
            # OTLP batches off the RPC threads; console writes as spans end (a debugging aid).
            batch = exporter == "otlp"
            processor = BatchSpanProcessor(configured) if batch else SimpleSpanProcessor(configured)
            self.provider.add_span_processor(processor)
        if extra_exporter is not None:  # tests: spans visible as soon as they end
            self.provider.add_span_processor(SimpleSpanProcessor(extra_exporter))
        self.tracer = self.provider.get_tracer("model_executor", executor.__version__)

    def set_sample_ratio(self, ratio: float) -> None:
        self.sampler.set_ratio(ratio)

    def shutdown(self) -> None:
        """Flush and stop the exporters."""
        self.provider.shutdown()

    def server_span(self, full_method: str, metadata: Sequence[Any] | None) -> trace.Span:
        """Start the server span of one RPC, child of the caller's `traceparent` if any."""
        parent = None
        if metadata and any(str(m[0]).lower() == "traceparent" for m in metadata):
            carrier = {str(m[0]).lower(): m[1] for m in metadata}
            parent = _PROPAGATOR.extract(carrier)
        if not self.sampler.exporting:
            # Nothing would see the span: only its ids (for the logs), without the SDK's
            # span machinery - every RPC pays this.
            caller = trace.get_current_span(parent).get_span_context() if parent else None
            ids = self.provider.id_generator
            trace_id = caller.trace_id if caller and caller.is_valid else ids.generate_trace_id()
            return trace.NonRecordingSpan(
                trace.SpanContext(trace_id, ids.generate_span_id(), is_remote=False)
            )
        service, _, method = full_method.rpartition("/")
        return self.tracer.start_span(
            full_method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        )


class SpanScope:
    """A span (an RPC's, or a stream's per-batch `step`) and the children drawn under it.

    Children are created only when the span records, so an unsampled RPC costs no more
    than its own span.
    """

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context = trace.set_span_in_context(span)
        self.recording = span.is_recording()

    def log_ids(self) -> dict[str, Any]:
        """`trace_id` / `span_id` for log lines about this span."""
        ctx = self.span.get_span_context()
        if not ctx.is_valid:
            return {}
        return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}

    def step(self, batch_id: int) -> SpanScope:
        """A `step` child for one batch of a stream."""
        if not self.recording:
            return SpanScope(self.tracer, trace.NonRecordingSpan(self.span.get_span_context()))
        span = self.tracer.start_span(
            "step", context=self.context, attributes={"model_executor.batch_id": batch_id}
        )
        return SpanScope(self.tracer, span)

    def child(self, name: str) -> AbstractContextManager[object]:
        """Time a live child span (decode, encode)."""
        return self._child(name) if self.recording else _NO_SPAN

    @contextmanager
    def _child(self, name: str) -> Iterator[None]:
        span = self.tracer.start_span(name, context=self.context)
        try:
            yield
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:512]))
            raise
        finally:
            span.end()

    def record_step(self, stats: StepStats, batch_id: int) -> None:
        """Attributes of the finished step, and its device-thread phases as child spans."""
        if not self.recording:
            return
        self.span.set_attributes(
            {
                "model_executor.batch_id": batch_id,
                "model_executor.mode": stats.mode,
                "model_executor.path": stats.path,
                "model_executor.batch_size": stats.batch_size,
                "model_executor.padded_batch_size": stats.padded_batch_size,
                "model_executor.num_tokens": stats.num_tokens,
                "model_executor.padded_num_tokens": stats.padded_num_tokens,
                "model_executor.fill_copies": stats.fill_tensors,
                "model_executor.fill_bytes": stats.fill_bytes,
                "model_executor.d2h_syncs": stats.d2h_syncs,
                "model_executor.h2d_syncs": stats.h2d_syncs,
                "model_executor.h2d_copies": stats.h2d_copies,
            }
        )
        for phase in STEP_PHASES:
            start = stats.started_ns.get(phase)
            duration = stats.timings_ns.get(phase)
            if start is None or duration is None:
                continue
            attributes = {"model_executor.path": stats.path} if phase == "forward" else None
            span = self.tracer.start_span(
                phase, context=self.context, start_time=start, attributes=attributes
            )
            span.end(end_time=start + duration)

    def finish(self, code_name: str, code_value: int, message: str = "") -> None:
        """End the span with the RPC's gRPC status."""
        self.span.set_attribute("rpc.grpc.status_code", code_value)
        if code_name != "OK":
            self.span.set_status(Status(StatusCode.ERROR, f"{code_name}: {message}"[:512]))
        self.span.end()
