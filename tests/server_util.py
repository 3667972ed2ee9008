"""Helpers for tests that run a real server on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from executor.config import ExecutorConfig
from executor.server import RunningServer, start_server
from executor.server_config import ServerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_config(cache_dir: Path, **overrides: object) -> ExecutorConfig:
    values: dict[str, object] = {
        "model": "tiny-random",
        "max_reqs": 32,
        "kv_slots": 8192,
        "max_context_len": 1024,
        "cache_dir": str(cache_dir),
    }
    values.update(overrides)
    return ExecutorConfig(**values)  # type: ignore[arg-type]


@contextmanager
def running_server(config: ExecutorConfig, **server_overrides: object) -> Iterator[RunningServer]:
    values: dict[str, object] = {"host": "127.0.0.1", "port": 0, "drain_grace_s": 10.0}
    values.update(server_overrides)
    running = start_server(config, ServerConfig(**values), block_until_ready=True)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        if not running.servicer.draining.is_set():
            running.drain()
