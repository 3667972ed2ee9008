"""The health-only port: grpc.health.v1 on its own grpc.aio server, thread and event loop.

The kubelet's gRPC probes ask it without credentials (and cannot speak TLS), so anyone who
reaches it can open calls. On grpc.aio a call that never sends its body is a suspended
coroutine, not a parked thread: no number of stalled calls keeps a probe's Check from being
answered. Connections live at most MAX_AGE_S (+ grace), so nothing holds one open forever.

Its statuses mirror the main port's `health.HealthServicer` (`MirroredHealth`): every `set`
there is handed to this port's loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import _async as aio_health
from grpc_health.v1 import health, health_pb2_grpc

MAX_AGE_S = 60.0  # a probe opens a fresh connection each time
AGE_GRACE_S = 10.0


class MirroredHealth(health.HealthServicer):
    """The main port's health servicer; `listeners` get every status it is set to."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: dict[str, int] = {}
        self.listeners: list[Callable[[str, int], None]] = []
        self.mirror_lock = threading.Lock()

    def set(self, service: str, status: int) -> None:
        with self.mirror_lock:
            super().set(service, status)
            self.statuses[service] = status
            for listener in self.listeners:
                listener(service, status)


class _Stopped:
    """What `HealthPort.stop` returns: `wait()` as grpc.Server.stop's event offers."""

    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


class HealthPort:
    """Serves `mirror`'s statuses on `host:port` (0 = a free port: `self.port`)."""

    def __init__(self, host: str, port: int, mirror: MirroredHealth) -> None:
        self._address = f"{host}:{port}"
        self._mirror = mirror
        self._loop = asyncio.new_event_loop()
        self._servicer: aio_health.HealthServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="health-port", daemon=True)

    def start(self) -> None:
        """Bind and serve; raises OSError when the port cannot be bound."""
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            raise OSError(f"could not listen on {self._address}: {self._error}")

    def stop(self, grace: float | None = None) -> _Stopped:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        return _Stopped(self._thread)

    def _set(self, service: str, status: int) -> None:
        if self._servicer is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._servicer.set(service, status), self._loop)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        try:
            self._stop = asyncio.Event()
            self._servicer = aio_health.HealthServicer()
            server = grpc.aio.server(
                options=[
                    ("grpc.max_connection_age_ms", int(MAX_AGE_S * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(AGE_GRACE_S * 1000)),
                ]
            )
            health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
            self.port = server.add_insecure_port(self._address)
            if self.port == 0:
                raise OSError("the port is taken")
            with self._mirror.mirror_lock:  # no status set between the copy and the listener
                statuses = dict(self._mirror.statuses)
                self._mirror.listeners.append(self._set)
            for service, status in statuses.items():  # no watchers yet: applied at once
                await self._servicer.set(service, status)
            await server.start()
            self._server = server
        except BaseException as exc:
            self._error = exc
            self._bound.set()
            return
        self._bound.set()
        await self._stop.wait()
        await server.stop(None)
