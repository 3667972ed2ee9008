"""The metric families read at scrape time, defined here (the recorded ones are
:mod:`executor.observability.metrics`'): the live-state gauges (queue depth, KV slots and rows
in use) and the process-wide host/device transfer counters. Nothing on the step path writes
them; a scrape reads them (`ExecutorMetrics` registers the collector)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ops.host_transfer import host_transfers

PREFIX = "model_executor_"


@dataclass
class LiveSources:
    """State read at scrape time (set once the model is loaded)."""

    queue_depth: Callable[[], int]
    kv_slots_used: Callable[[], int]
    req_rows_used: Callable[[], int]
    # LoRA (None: LoRA off): live rows per loaded adapter; loads and unloads by outcome.
    lora_running_rows: Callable[[], dict[str, int]] | None = None
    lora_operations: Callable[[], dict[str, int]] | None = None
    # How long the background graph capture now running has run (0: none runs).
    graph_capture_running_s: Callable[[], float] | None = None


class ScrapeTimeCollector(Collector):
    """Gauges of current state, and the process-wide device-to-host transfer counts."""

    def __init__(self) -> None:
        self.sources: LiveSources | None = None

    def describe(self) -> Iterator[Metric]:
        return self._families(with_values=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(with_values=True)

    def _families(self, *, with_values: bool) -> Iterator[Metric]:
        src = self.sources if with_values else None
        for name, doc, read in (
            ("queue_depth", "Batches waiting for the device (not counting the running one).",
             src.queue_depth if src else None),
            ("kv_slots_used", "KV slots referenced by live (unreleased) request rows (sum of "
             "their resident lengths; a prefix shared by several rows counts once per row).",
             src.kv_slots_used if src else None),
            ("req_rows_used", "Request rows holding at least one resident token, not released.",
             src.req_rows_used if src else None),
            ("graph_capture_running_seconds", "How long the background graph capture (a CPU "
             "server's compile or load while it serves) has run; 0 when none runs.",
             src.graph_capture_running_s if src else None),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(PREFIX + name, doc)
            if with_values:
                gauge.add_metric([], float(read() if read else 0))
            yield gauge
        syncs_doc = "Device-to-host transfers on the serving path, by reason (process-wide)."
        bytes_doc = "Bytes moved by device-to-host transfers, by reason (process-wide)."
        syncs = CounterMetricFamily(PREFIX + "d2h_syncs", syncs_doc, labels=["reason"])
        nbytes = CounterMetricFamily(PREFIX + "d2h_bytes", bytes_doc, labels=["reason"])
        if with_values:
            counts, sizes = host_transfers.snapshot()
            for reason in sorted(counts):
                syncs.add_metric([reason], counts[reason])
                nbytes.add_metric([reason], sizes[reason])
        yield syncs
        yield nbytes
        h2d_syncs = CounterMetricFamily(
            PREFIX + "h2d_syncs",
            "Host-to-device uploads that synchronize with the device (pageable memory or a "
            "blocking copy), by reason (process-wide). Expected: none on the serving path.",
            labels=["reason"],
        )
        h2d_copies = CounterMetricFamily(
            PREFIX + "h2d_copies",
            "Asynchronous host-to-device copies from pinned memory, by reason (process-wide): "
            "one staged copy per step.",
            labels=["reason"],
        )
        if with_values:
            sync_counts, copy_counts = host_transfers.h2d_snapshot()
            # `row_table` is always there (0 while the row table goes through the staged
            # copy), so the alert and the dashboard have a series from the first scrape.
            for reason in sorted({*sync_counts, "row_table"}):
                h2d_syncs.add_metric([reason], sync_counts.get(reason, 0))
            for reason in sorted(copy_counts):
                h2d_copies.add_metric([reason], copy_counts[reason])
        yield h2d_syncs
        yield h2d_copies
        yield from _lora_families(src)


LORA_OPERATIONS = ("loaded", "load_refused", "unloaded", "unload_refused")


def _lora_families(src: LiveSources | None) -> Iterator[Metric]:
    running = GaugeMetricFamily(
        PREFIX + "lora_running_rows",
        "Live (unreleased) request rows per loaded LoRA adapter (0 for a loaded, idle one).",
        labels=["adapter"],
    )
    ops = CounterMetricFamily(
        PREFIX + "lora_operations",
        "LoRA adapter loads and unloads (start-up, LoadLora, UnloadLora), by outcome.",
        labels=["operation"],
    )
    if src is not None and src.lora_running_rows is not None:
        for name, rows in sorted(src.lora_running_rows().items()):
            running.add_metric([name], float(rows))
    if src is not None and src.lora_operations is not None:
        counts = src.lora_operations()
        for op in LORA_OPERATIONS:
            ops.add_metric([op], counts.get(op, 0))
    yield running
    yield ops
