"""Helpers for tests that run a real server on loopback."""

from __future__ import annotations

import socket
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client.parser import text_string_to_metric_families

from executor.config import ExecutorConfig
from executor.service import heap
from executor.service.server import RunningServer, start_server
from executor.service.server_config import ServerConfig
from executor.service.tls import is_loopback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(port: int, cache_dir: Path, *flags: str) -> list[str]:
    """`python -m executor serve` on tiny-random with JSON logs, plus `flags`."""
    return [
        sys.executable,
        "-m",
        "executor",
        "serve",
        "--model",
        "tiny-random",
        "--port",
        str(port),
        "--cache-dir",
        str(cache_dir),
        "--log-format",
        "json",
        "--dtype",
        "float32",
        *flags,
    ]


def tiny_config(cache_dir: Path, **overrides: object) -> ExecutorConfig:
    values: dict[str, object] = {
        "model": "tiny-random",
        "device": "cpu",  # the CPU suite stays on the CPU where a GPU exists too
        "max_reqs": 32,
        "kv_slots": 8192,
        "max_context_len": 1024,
        "cache_dir": str(cache_dir),
        "graph_backend": "standin",  # captures in milliseconds; compiling has its own tests
        "dtype": "float32",  # auto is bfloat16 on CPUs with native bfloat16
        "allow_input_embeds": True,  # tests send embeddings; the default refuses them
    }
    values.update(overrides)
    return ExecutorConfig(**values)  # type: ignore[arg-type]


@contextmanager
def running_server(
    config: ExecutorConfig,
    *,
    span_exporter: SpanExporter | None = None,
    freeze_heap: bool = False,
    **server_overrides: object,
) -> Iterator[RunningServer]:
    """A server on loopback, drained at the end. `freeze_heap` as `serve` does it (this
    process's heap is thawed again at the end)."""
    values: dict[str, object] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,  # never the fixed default: tests run servers side by side
        "drain_grace_s": 10.0,
    }
    values.update(server_overrides)
    guarded = {"runtime_config_token_file", "allowed_operator_identities"} & values.keys()
    if not guarded and is_loopback(str(values["host"])):
        # tests change the runtime toggles without a token (loopback only)
        values.setdefault("operator_calls_open", True)
    running = start_server(
        config,
        ServerConfig(**values),  # type: ignore[arg-type]
        block_until_ready=True,
        span_exporter=span_exporter,
        freeze_heap=freeze_heap,
    )
    try:
        yield running
    finally:
        if not running.servicer.draining.is_set():
            running.drain()
        if freeze_heap:
            heap.thaw()


class Scrape:
    """One scrape of a server's `/metrics`, parsed with prometheus-client's text parser."""

    def __init__(self, running: RunningServer) -> None:
        assert running.metrics_port is not None, "the server has no metrics endpoint"
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            self.text = response.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels: str) -> float:
        """A sample's value; 0 for a series that does not exist (yet)."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def has(self, name: str, **labels: str) -> bool:
        return (name, tuple(sorted(labels.items()))) in self.samples
