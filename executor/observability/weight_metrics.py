"""The weight and memory calls' metrics: updates recorded as they end, the weight version and
the released memory read at scrape time. `ExecutorMetrics` builds one on its registry
(`docs/metrics.md` lists each family)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from executor.observability.scrape_metrics import PREFIX

TRANSPORTS = ("stream", "path", "group")  # the `transport` label's values
MEMORY_TAGS = ("weights", "kv_cache")
# 1 ms .. 10 min: a tiny model's update is milliseconds, a large one's minutes.
UPDATE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)


@dataclass(frozen=True)
class WeightState:
    """What a scrape reads: the weights' version, the released tags, the KV epoch."""

    version: str
    released: tuple[str, ...]
    kv_epoch: int


class _StateCollector(Collector):
    def __init__(self) -> None:
        self.read: Callable[[], WeightState | None] = lambda: None

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.read())

    def _families(self, state: WeightState | None) -> Iterator[Metric]:
        version = GaugeMetricFamily(
            PREFIX + "weight_version_info",
            "Always 1; the label is the version of the weights in use (ForwardResponse."
            "weight_version).",
            labels=["version"],
        )
        released = GaugeMetricFamily(
            PREFIX + "memory_released",
            "1 while the tag's memory is released (batches refused), else 0.",
            labels=["tag"],
        )
        epoch = GaugeMetricFamily(
            PREFIX + "kv_epoch", "Times the KV cache came back empty (ResumeMemory of kv_cache)."
        )
        if state is not None:
            version.add_metric([state.version], 1.0)
            for tag in MEMORY_TAGS:
                released.add_metric([tag], 1.0 if tag in state.released else 0.0)
            epoch.add_metric([], float(state.kv_epoch))
        yield version
        yield released
        yield epoch


class WeightMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.updates = Counter(
            PREFIX + "weight_updates",
            "Weight updates that ended, by transport (stream, path, group) and outcome (ok: "
            "swapped in; failed: refused or failed, nothing changed).",
            ("transport", "outcome"),
            registry=registry,
        )
        self.update_bytes = Counter(
            PREFIX + "weight_update_bytes",
            "Bytes of the weight updates swapped in, by transport (in the dtypes they came in).",
            ("transport",),
            registry=registry,
        )
        self.update_seconds = Histogram(
            PREFIX + "weight_update_seconds",
            "Time of a weight update swapped in, from its call to its answer (staging while "
            "steps run, then the swap), by transport.",
            ("transport",),
            registry=registry,
            buckets=UPDATE_BUCKETS,
        )
        self.swap_seconds = Histogram(
            PREFIX + "weight_swap_seconds",
            "How long steps waited for a weight update's swap (between two steps).",
            registry=registry,
            buckets=UPDATE_BUCKETS,
        )
        for transport in TRANSPORTS:
            self.update_bytes.labels(transport)
            self.update_seconds.labels(transport)
            for outcome in ("ok", "failed"):
                self.updates.labels(transport, outcome)
        self._state = _StateCollector()
        registry.register(self._state)

    def bind(self, read: Callable[[], WeightState | None]) -> None:
        """Where a scrape reads the state from (None while the model loads)."""
        self._state.read = read

    def observe_update(
        self, transport: str, nbytes: int, seconds: float, swap_seconds: float | None
    ) -> None:
        """One update ended: swapped in (`swap_seconds` set) or not (None)."""
        ok = swap_seconds is not None
        self.updates.labels(transport, "ok" if ok else "failed").inc()
        if swap_seconds is not None:
            self.update_bytes.labels(transport).inc(nbytes)
            self.update_seconds.labels(transport).observe(seconds)
            self.swap_seconds.observe(swap_seconds)
