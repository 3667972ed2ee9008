"""Readiness and liveness as grpc.health.v1 reports them, and the health-only port.

Readiness (`model_executor.v1.ModelExecutor`) turns SERVING once the model is loaded and warmed
up and NOT_SERVING for good on a drain or a device failure; liveness ("") turns NOT_SERVING
only when the device failed (`RunningServer._device_down`). The health-only port
(`health_port.py`) mirrors both.
"""

from __future__ import annotations

import threading

from grpc_health.v1 import health, health_pb2

from executor.observability.metrics import ExecutorMetrics
from executor.service.device_worker import DeviceWorker
from executor.service.runtime_config import RuntimeControl
from executor.service.servicer import ExecutorServicer
from model_executor.v1 import executor_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelExecutor"].full_name


class Readiness:
    """Readiness and draining, changed under one lock: once draining, never SERVING again
    (the loader's "attach, then SERVING unless draining" cannot interleave with a drain)."""

    def __init__(
        self, health: health.HealthServicer, servicer: ExecutorServicer, metrics: ExecutorMetrics
    ) -> None:
        self._lock = threading.Lock()
        self._health = health
        self._servicer = servicer
        self._metrics = metrics

    def serve(self, worker: DeviceWorker, runtime: RuntimeControl) -> bool:
        """Attach the loaded worker and turn SERVING; False (nothing attached) when draining."""
        with self._lock:
            if self._servicer.draining.is_set():
                return False
            self._servicer.attach(worker, runtime)
            self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
            self._metrics.set_ready(True)
            return True

    def drain(self) -> DeviceWorker | None:
        """Turn NOT_SERVING for good; the worker to drain (None: the model never attached)."""
        with self._lock:
            self._servicer.draining.set()
            self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._metrics.set_ready(False)
            return self._servicer.worker
