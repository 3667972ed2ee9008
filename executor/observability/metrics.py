"""The Prometheus metrics the executor records, defined here; the families read only when
scraped (live-state gauges, process-wide transfer counts) are defined in
:mod:`executor.observability.scrape_metrics`. Together the two are every metric it exports.

Names are an API (dashboards and alerts use them; `docs/metrics.md` lists each one): prefix
`model_executor_`, base units, `_total` counters. Each server owns one `ExecutorMetrics` with
its own `CollectorRegistry` (never the process-global one), so several servers can live in
one process, and serves it on its own HTTP port (`/metrics`).

Per-step recording (`observe_step`) sits on the device thread, so the step families are
single-writer ones (:mod:`executor.observability.single_writer_metrics`: no lock per update) and their
series are resolved once per label set; `benchmarks/metrics_overhead.py` measures the cost. The
per-RPC families are of the same kind, written under one lock per RPC (`observe_rpc`).
Gauges that describe state (queue depth, KV slots, rows) and the process-wide device-to-host
counts (`ops.host_transfer.host_transfers`) are read when scraped, not on the hot path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from executor.config import RUNTIME_GRAPH_MODES
from executor.core.controls_types import CONTROL_ROWS
from executor.core.names import FILL_REGISTRIES, MODES, Path
from executor.observability.occupancy import Occupancy
from executor.observability.scrape_metrics import PREFIX, LiveSources, ScrapeTimeCollector
from executor.observability.single_writer_metrics import (
    CounterChild,
    HistogramChild,
    SingleWriterCounter,
    SingleWriterHistogram,
)
from executor.observability.weight_metrics import WeightMetrics

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from executor.core.outputs import StepStats
    from executor.info import ExecutorInfo
    from executor.service.runtime_config import RuntimeConfig

PATHS = tuple(Path)  # the `path` label's values
# 100 us .. 10 s: a CPU decode step of a tiny model is ~1 ms, a long prefill seconds.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
KV_DIRECTIONS = ("export", "import", "push")  # the KV data plane's `direction` label
SIZE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # requests per batch
CAPTURE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class _StepSeries:
    """The series one (path, mode) pair updates each step, resolved once."""

    forward_seconds: HistogramChild
    batch_size: HistogramChild
    padded_batch_size: HistogramChild
    tokens: CounterChild
    padding_tokens: CounterChild


@dataclass
class _FillSeries:
    copies: CounterChild
    bytes: CounterChild
    calls: CounterChild


class ExecutorMetrics:
    """One server's metrics: its registry, the recording calls, and its `/metrics` endpoint.

    Implements `executor.core.observer.ExecutorObserver` (graph captures and fallbacks).
    """

    def __init__(self) -> None:
        # NOTE: process-wide: no `*_created` series next to counters and histograms (they
        # double the series count and no dashboard reads them).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def histogram(
            name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
        ) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets)

        def step_counter(name: str, doc: str, labels: tuple[str, ...]) -> SingleWriterCounter:
            return SingleWriterCounter(PREFIX + name, doc, labels, r)

        def step_histogram(
            name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
        ) -> SingleWriterHistogram:
            return SingleWriterHistogram(PREFIX + name, doc, labels, r, buckets)

        # Steps (recorded on the device thread only: single-writer families).
        self.forward_seconds = step_histogram(
            "forward_seconds",
            "Time of one step on the device thread (validate, stage, forward, sample), by path and mode.",
            ("path", "mode"), LATENCY_BUCKETS,
        )  # fmt: skip
        self.allreduce_seconds = step_histogram(
            "allreduce_seconds",
            "Tensor parallel: time one step spent in all-reduces (rank 0's host clock), by rank.",
            ("rank",), LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_wait_seconds = step_histogram(
            "queue_wait_seconds", "Time a batch waited in the device queue.", (), LATENCY_BUCKETS
        )
        self.batch_size = step_histogram(
            "batch_size", "Requests per step, by mode.", ("mode",), SIZE_BUCKETS
        )
        self.padded_batch_size = step_histogram(
            "padded_batch_size", "Requests per step after padding to a graph bucket, by path.",
            ("path",), SIZE_BUCKETS,
        )  # fmt: skip
        self.padding_tokens = step_counter(
            "padding_tokens", "Padding tokens run (padded minus real tokens), by path.", ("path",)
        )
        self.tokens = step_counter("tokens", "Tokens run (real, not padding), by mode.", ("mode",))
        self.fill_copies = step_counter(
            "fill_copies",
            "Tensors copied by input staging (fill_from), by registry.",
            ("registry",),
        )
        self.fill_bytes = step_counter(
            "fill_bytes", "Bytes copied by input staging, by registry.", ("registry",)
        )
        self.future_tokens_resolved = step_counter(
            "future_tokens_resolved",
            "Input ids resolved on the device from the future-token table (overlap scheduling).",
            (),
        )
        self.sampling_control_rows = step_counter(
            "sampling_control_rows",
            "Rows a sampling control touched, summed over steps, by control (penalties, "
            "logit_bias, min_tokens, token_ids, vocab_mask).",
            ("control",),
        )
        self.draft_tokens = step_counter(
            "draft_tokens", "VERIFY: draft tokens scored (the executor's and the scheduler's).", ()
        )
        self.accepted_drafts = step_counter("accepted_drafts", "VERIFY: draft tokens accepted.", ())
        self.accepted_length = step_histogram(
            "accepted_length",
            "VERIFY: tokens a row gained per step (accepted drafts plus the bonus token).",
            (), SIZE_BUCKETS,
        )  # fmt: skip
        self.device_idle_seconds = step_counter(
            "device_idle_seconds",
            "Time the device waited for the host with a batch queued: the host gap before each "
            "step (admission, staging, the answer before it, where no step ran to hide them).",
            (),
        )
        self.fill_copy_calls = step_counter(
            "fill_copy_calls", "Copy calls made by input staging (one grouped copy counts once), "
            "by registry.", ("registry",),
        )  # fmt: skip
        # RPCs (recorded by the gRPC handler threads, one at a time under `_rpc_lock`: one
        # lock per RPC for both series, where prometheus-client's take one per update).
        self.rpc_seconds = step_histogram(
            "rpc_seconds", "Time from receiving an RPC to its answer, by method.", ("method",),
            LATENCY_BUCKETS,
        )  # fmt: skip
        self.requests = step_counter(
            "requests", "RPCs answered, by method and gRPC status code.", ("method", "code")
        )
        self.batches_replayed = counter(
            "batches_replayed",
            "Retried batches answered from the retry memory (their batch_id was already "
            "applied), not applied again.",
        )
        # Deferred vocab masks (the device thread, while a batch waits for its mask).
        self.deferred_mask_wait_seconds = histogram(
            "deferred_mask_wait_seconds",
            "Time the device waited for one batch's deferred vocab mask (every other batch "
            "waits meanwhile).",
            (), LATENCY_BUCKETS,
        )  # fmt: skip
        self.deferred_mask_waits_cut = counter(
            "deferred_mask_waits_cut",
            "Waits for a deferred vocab mask cut short by the stream's mask-wait budget "
            "(deferred_mask_budget_s); the batch failed DEADLINE_EXCEEDED.",
        )
        # The KV data plane (recorded by the handler threads of ExportKV/ImportKV/PushKV).
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes",
            "KV bytes moved by completed transfers, by direction (export, import, push).",
            ("direction",),
        )
        self.kv_transfers = counter(
            "kv_transfers",
            "KV transfers, by direction and outcome (ok, failed).",
            ("direction", "outcome"),
        )
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds",
            "Time of one KV transfer (header to last byte written or sent), by direction.",
            ("direction",), LATENCY_BUCKETS,
        )  # fmt: skip
        for direction in KV_DIRECTIONS:  # every series exists from the start, at 0
            self.kv_transfer_bytes.labels(direction)
            self.kv_transfer_seconds.labels(direction)
            for outcome in ("ok", "failed"):
                self.kv_transfers.labels(direction, outcome)
        # Graph runners (through the ExecutorObserver hooks).
        self.graph_captures = counter(
            "graph_captures", "Graph captures that succeeded, by kind.", ("kind",)
        )
        self.graph_capture_failures = counter(
            "graph_capture_failures", "Graph captures that failed, by kind.", ("kind",)
        )
        self.graph_capture_seconds = histogram(
            "graph_capture_seconds", "Time of a successful graph capture, by kind.", ("kind",),
            CAPTURE_BUCKETS,
        )  # fmt: skip
        self.graph_fallbacks = counter(
            "graph_fallbacks", "Batches run eagerly although their graph mode is on, by kind "
            "and reason.", ("kind", "reason"),
        )  # fmt: skip
        self.graph_capture_disabled = gauge(
            "graph_capture_disabled",
            "1 after a poisoned graph capture stopped capturing for good (graph paths run "
            "eagerly; the reason is in the logs and GetInfo), else 0.",
        )
        # State.
        self.ready = gauge("ready", "1 when the executor takes batches, else 0.")
        self.kv_slots_total = gauge("kv_slots_total", "KV slots the cache holds (1..kv_slots).")
        self.build_info = gauge(
            "build_info", "Always 1; the labels describe the running executor.",
            ("version", "model", "device", "dtype", "attention_backend", "quantization",
             "linear_kernel", "tp_size", "rank"),
        )  # fmt: skip
        self.toggle_eager_input_no_copy = gauge(
            "toggle_eager_input_no_copy", "1 when eager steps skip input staging (no-copy), else 0."
        )
        self.toggle_needs_cpu_seq_lens = gauge(
            "toggle_needs_cpu_seq_lens",
            "1 when batches carry the host copy of seq_lens (the effective value), else 0.",
        )
        self.toggle_graph_mode_info = gauge(
            "toggle_graph_mode_info", "1 for the current graph mode, 0 for the others.", ("mode",)
        )
        self.weights = WeightMetrics(r)  # weight updates, version, released memory
        self._scrape_time = ScrapeTimeCollector()
        r.register(self._scrape_time)
        self.occupancy = Occupancy()  # model_executor_forward_occupancy, read at scrape time
        r.register(self.occupancy)
        self._http: tuple[WSGIServer, threading.Thread] | None = None

        # Series children resolved once per label set. NOTE: no lock: `labels()` is
        # thread-safe and returns the same child, so a racing double insert is harmless.
        self._steps: dict[tuple[str, str], _StepSeries] = {}
        self._fills: dict[str, _FillSeries] = {}
        self._rpcs: dict[tuple[str, str], tuple[HistogramChild, CounterChild]] = {}
        self._rpc_lock = threading.Lock()
        # Series that exist from the start (at 0), so rate() and absent() behave from the
        # first scrape; the rest appear with their first event.
        for registry in FILL_REGISTRIES:
            self._fill_series(registry)
        for mode in MODES:
            self.tokens.labels(mode)
        for path in PATHS:
            self.padding_tokens.labels(path)
        self._queue_wait = self.queue_wait_seconds.labels()
        self._device_idle = self.device_idle_seconds.labels()
        self._future_resolved = self.future_tokens_resolved.labels()
        for control in CONTROL_ROWS:
            self.sampling_control_rows.labels(control)
        # Exported at zero before the first VERIFY step (dashboards divide by them).
        self._draft_tokens = self.draft_tokens.labels()
        self._accepted_drafts = self.accepted_drafts.labels()
        self._accepted_length = self.accepted_length.labels()
        self._allreduce: Any = None  # rank 0's series, made when a tensor-parallel model loads

    # --- recording ---

    def observe_step(self, stats: StepStats) -> None:
        """One finished step. Call it from the device thread only (the step families have
        one writer), before the step's answer is released."""
        series = self._steps.get((stats.path, stats.mode)) or self._step_series(stats)
        timings = stats.timings_ns
        series.forward_seconds.observe(timings.get("total", 0) * 1e-9)
        series.batch_size.observe(stats.batch_size)
        series.padded_batch_size.observe(stats.padded_batch_size)
        series.tokens.inc(stats.num_tokens)
        padding = stats.padded_num_tokens - stats.num_tokens
        if padding > 0:
            series.padding_tokens.inc(padding)
        if self._allreduce is not None:
            self._allreduce.observe(stats.allreduce_ns * 1e-9)
        queue = timings.get("queue")
        if queue is not None:
            self._queue_wait.observe(queue * 1e-9)
        self._device_idle.inc(stats.host_gap_ns * 1e-9)
        self.occupancy.record(stats.device_busy_ns, stats.host_gap_ns)
        if stats.future_refs:
            self._future_resolved.inc(stats.future_refs)
        if stats.draft_tokens or stats.mode == "verify":
            self._draft_tokens.inc(stats.draft_tokens)
            self._accepted_drafts.inc(stats.accepted_drafts)
            for n in stats.accept_lengths:
                self._accepted_length.observe(n)
        for control, rows in stats.control_rows.items():
            self.sampling_control_rows.labels(control).inc(rows)
        if stats.fill_registry is not None:
            fill = self._fills.get(stats.fill_registry) or self._fill_series(stats.fill_registry)
            fill.copies.inc(stats.fill_tensors)
            fill.bytes.inc(stats.fill_bytes)
            fill.calls.inc(stats.fill_copy_calls)

    def count_replay(self) -> None:
        """A retried batch answered from the retry memory."""
        self.batches_replayed.inc()

    def observe_deferred_mask_wait(self, seconds: float, cut: bool) -> None:
        """The device waited `seconds` for a deferred mask; `cut`: the stream's budget ended it."""
        self.deferred_mask_wait_seconds.observe(seconds)
        if cut:
            self.deferred_mask_waits_cut.inc()

    def observe_kv_transfer(self, direction: str, nbytes: int, seconds: float, ok: bool) -> None:
        """One KV transfer ended (`executor.service.kv_service`)."""
        self.kv_transfers.labels(direction, "ok" if ok else "failed").inc()
        self.kv_transfer_seconds.labels(direction).observe(seconds)
        if ok:
            self.kv_transfer_bytes.labels(direction).inc(nbytes)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """One answered RPC; `code` is the gRPC status code's name (OK, INVALID_ARGUMENT, ...)."""
        pair = self._rpcs.get((method, code))
        if pair is None:
            pair = (self.rpc_seconds.labels(method), self.requests.labels(method, code))
            self._rpcs[(method, code)] = pair
        with self._rpc_lock:
            pair[0].observe(seconds)
            pair[1].inc()

    def _step_series(self, stats: StepStats) -> _StepSeries:
        series = _StepSeries(
            forward_seconds=self.forward_seconds.labels(stats.path, stats.mode),
            batch_size=self.batch_size.labels(stats.mode),
            padded_batch_size=self.padded_batch_size.labels(stats.path),
            tokens=self.tokens.labels(stats.mode),
            padding_tokens=self.padding_tokens.labels(stats.path),
        )
        self._steps[(stats.path, stats.mode)] = series
        return series

    def _fill_series(self, registry: str) -> _FillSeries:
        series = _FillSeries(
            self.fill_copies.labels(registry),
            self.fill_bytes.labels(registry),
            self.fill_copy_calls.labels(registry),
        )
        self._fills[registry] = series
        return series

    # --- ExecutorObserver ---

    def on_graph_capture(self, kind: str, seconds: float, ok: bool) -> None:
        if ok:
            self.graph_captures.labels(kind).inc()
            self.graph_capture_seconds.labels(kind).observe(seconds)
        else:
            self.graph_capture_failures.labels(kind).inc()

    def on_graph_fallback(self, kind: str, reason: str) -> None:
        self.graph_fallbacks.labels(kind, reason).inc()

    def on_graph_capture_disabled(self, reason: str) -> None:
        self.graph_capture_disabled.set(1)

    # --- state ---

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def set_executor(self, info: ExecutorInfo, sources: LiveSources) -> None:
        """The model is loaded: describe it, and read live state from `sources` at scrape time."""
        self.build_info.labels(
            info.version,
            info.model_name,
            info.device,
            info.dtype,
            info.attention_backend,
            info.quantization,
            info.linear_kernel,
            str(info.tp_size),
            "0",  # the metrics are served by rank 0, which owns gRPC
        ).set(1)
        # The series exists at tp_size 1 too (no observations), so the dashboard's panel and
        # any rule over it see a series on every executor.
        allreduce = self.allreduce_seconds.labels("0")
        if info.tp_size > 1:
            self._allreduce = allreduce
        self.kv_slots_total.set(info.limits.kv_slots)
        self._scrape_time.sources = sources

    def set_runtime_config(self, config: RuntimeConfig) -> None:
        """Show the runtime toggles (after start-up and after every accepted change)."""
        self.toggle_eager_input_no_copy.set(1 if config.eager_input_no_copy else 0)
        self.toggle_needs_cpu_seq_lens.set(1 if config.needs_cpu_seq_lens_effective else 0)
        for mode in RUNTIME_GRAPH_MODES:
            self.toggle_graph_mode_info.labels(mode).set(1 if mode == config.graph_mode else 0)

    # --- the /metrics endpoint ---

    def serve(self, host: str, port: int) -> int:
        """Serve `/metrics` on `host:port` (0: a free port) in a daemon thread; the port."""
        self._http = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http[0].server_address[1])

    def close(self) -> None:
        if self._http is not None:
            httpd, thread = self._http
            httpd.shutdown()
            httpd.server_close()
            thread.join()
            self._http = None
