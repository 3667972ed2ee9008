"""How the gRPC server runs (as opposed to what the executor computes): ports, queues, drain."""

from __future__ import annotations

from dataclasses import dataclass

from executor.config import setting
from executor.logs import FORMATS, LEVELS


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in a container)")
    port: int = setting(50051, "gRPC port; 0 picks a free one")
    queue_size: int = setting(
        64, "batches that may wait for the device; more get RESOURCE_EXHAUSTED"
    )
    stream_window: int = setting(4, "batches one ForwardStream may have queued or running at once")
    drain_grace_s: float = setting(
        30.0, "on SIGTERM/SIGINT, seconds to finish queued and running batches"
    )
    rpc_threads: int = setting(16, "gRPC handler threads (the device itself is one thread)")
    log_level: str = setting("info", "debug | info | warning | error")
    log_format: str = setting(
        "auto", "auto (console on a terminal, else JSON lines) | json | console"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("queue_size", "stream_window", "rpc_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.log_level not in LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in FORMATS:
            raise ValueError(
                f"log_format must be one of {', '.join(FORMATS)}, got {self.log_format!r}"
            )
