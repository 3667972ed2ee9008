"""Counter and histogram families for the device thread: no locks on the write path.

prometheus-client's own metrics take a lock per update (a histogram observation costs about
a microsecond). The per-step metrics have exactly one writer, the device thread, so these
families keep plain Python numbers that it updates (tens of nanoseconds each) and build the
exposition when scraped. Reading while the device thread writes is safe under the GIL: a
scrape may see a histogram's `_sum` one observation behind its buckets, never a torn number.

One writer at a time: only the thread that runs steps may call `inc` / `observe` on the step
families, and the RPC families are written under `ExecutorMetrics`' lock (one lock per RPC for
both of its series). `labels` may be called anywhere.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # the first bound >= value
        self.sum += value


class _Family(ABC, Collector):
    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()  # creation only: two threads never make two children
        registry.register(self)

    def _child(self, values: tuple[str, ...], make: Callable[[], object]) -> object:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            with self._lock:
                child = self._children.setdefault(values, make())
        return child

    def _items(self) -> list[tuple[tuple[str, ...], object]]:
        return list(self._children.items())  # one C-level copy: safe against inserts

    def describe(self) -> Iterator[Metric]:
        yield self._empty()

    @abstractmethod
    def _empty(self) -> Metric:
        """This family's metric with no samples (its type and help)."""


class SingleWriterCounter(_Family):
    """A counter family; `name` without `_total` (the exposition adds it)."""

    def labels(self, *values: str) -> CounterChild:
        child = self._child(values, CounterChild)
        assert isinstance(child, CounterChild)
        return child

    def _empty(self) -> Metric:
        return CounterMetricFamily(self.name, self.doc, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in self._items():
            assert isinstance(child, CounterChild)
            family.add_metric(values, child.value)
        yield family


class SingleWriterHistogram(_Family):
    """A histogram family with fixed upper bounds (`le`), plus +Inf."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        super().__init__(name, doc, labelnames, registry)

    def labels(self, *values: str) -> HistogramChild:
        child = self._child(values, lambda: HistogramChild(self.bounds))
        assert isinstance(child, HistogramChild)
        return child

    def _empty(self) -> Metric:
        return HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for values, child in self._items():
            assert isinstance(child, HistogramChild)
            total = child.sum
            counts = list(child.counts)  # a snapshot, then cumulative
            cumulative, buckets = 0, []
            for le, n in zip(les, counts, strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric(values, buckets, sum_value=total)
        yield family
