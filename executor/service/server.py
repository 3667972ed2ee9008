"""Run the executor as a gRPC server: health, reflection, start-up, drain and signals.

Start-up: the port opens first with liveness ("") SERVING and readiness
(`model_executor.v1.ModelExecutor`) NOT_SERVING; the model loads and warms up; then readiness
turns SERVING. On SIGTERM/SIGINT (or `drain()`), readiness turns NOT_SERVING, new batches get
UNAVAILABLE, and everything already accepted finishes within the grace period before the port
closes; what is still queued at its end is answered UNAVAILABLE, so the process always exits
within the grace plus a bounded margin. Observability is per server: its own metrics registry
on `metrics_port` (`/metrics`), its own tracer provider, and the runtime toggles.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace.export import SpanExporter

from executor.config import ExecutorConfig
from executor.core.errors import StartupCancelled
from executor.kv_transfer.layout import DEFAULT_CHUNK_BYTES
from executor.model_executor import ModelExecutor
from executor.models.loader import read_model_config
from executor.observability.log_limit import RateLimitedLog
from executor.observability.metrics import ExecutorMetrics, LiveSources
from executor.observability.telemetry import Telemetry
from executor.observability.tracing import Tracing
from executor.service import heap, tp_launch
from executor.service.access import AccessInterceptor
from executor.service.admission import ByteBudget, CallLimit, forward_call_limit
from executor.service.applied_batches import AppliedBatches
from executor.service.credentials import credentials_from
from executor.service.device_worker import DeviceWorker
from executor.service.handlers import add_executor_servicer
from executor.service.health_port import HealthPort, MirroredHealth
from executor.service.kv_peers import PeerChannels, PeerList
from executor.service.kv_service import KVTransferObserver
from executor.service.readiness import SERVICE_NAME, Readiness
from executor.service.runtime_config import RuntimeControl
from executor.service.server_config import ServerConfig
from executor.service.servicer import ExecutorServicer
from executor.service.tenancy import RowTenants
from executor.service.tls import CertificateFiles, is_loopback
from executor.service.watchdog import DeviceWatchdog, RunningStep
from executor.service.weights_service import weights_service
from executor.service.wire_limits import MESSAGE_SLACK, batch_budget_bytes, message_limits
from ops import triton_off

log = structlog.get_logger(__name__)

# How long a drain waits, after the grace and the port's close, for a device step that is
# still running: the device thread is a daemon, so the process exits even if it never ends.
DRAIN_MARGIN_S = 2.0


@dataclass
class RunningServer:
    """A started server; `ready` is set once the model is loaded and warmed up."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    servicer: ExecutorServicer
    ready: threading.Event
    load_error: list[BaseException]
    server_config: ServerConfig
    telemetry: Telemetry
    metrics_port: int | None  # None: the /metrics endpoint is off
    readiness: Readiness
    health_server: HealthPort | None = None  # the plaintext probe port, when one is open
    health_port: int | None = None
    certificates: CertificateFiles | None = None  # the TLS files, when the port is TLS
    # Set by `drain`: a start-up still loading or capturing graphs stops at the next bucket.
    stop_loading: threading.Event = field(default_factory=threading.Event)
    loader: threading.Thread | None = None
    # Tensor parallel: the group rank 0 leads, and why it failed (a rank died or hangs).
    tp_group: tp_launch.TpGroup | None = None
    tp_failure: list[str] = field(default_factory=list)
    tp_failed: threading.Event = field(default_factory=threading.Event)
    executor: ModelExecutor | None = None
    # The device watchdog, and why the device failed (a stuck step, a sticky device error).
    watchdog: DeviceWatchdog | None = None
    device_failure: list[str] = field(default_factory=list)
    device_failed: threading.Event = field(default_factory=threading.Event)
    device_fatal: threading.Event = field(default_factory=threading.Event)  # `serve` exits 1

    def on_device_stuck(self, step: RunningStep) -> None:
        """A step outran step_timeout_s: liveness and readiness NOT_SERVING (the kubelet
        restarts the pod), every waiting caller UNAVAILABLE."""
        bound = self.server_config.step_timeout_s
        log.error(
            "device step stuck; not serving",
            batch_id=step.batch_id,
            phase=step.phase,
            seconds=round(step.seconds, 3),
            step_timeout_s=bound,
        )
        self._device_down(
            f"the device is stuck: batch_id {step.batch_id} has run {step.seconds:.1f} s in "
            f"its {step.phase} phase (step_timeout_s {bound:g}); the executor will restart"
        )

    def on_device_error(self, exc: BaseException) -> None:
        """A device error that poisons the context: not serving, and `serve` exits 1 so that
        Kubernetes restarts the process with a fresh one."""
        log.error("sticky device error; exiting", error=f"{type(exc).__name__}: {exc}")
        self._device_down(f"the device failed ({type(exc).__name__}); the executor will restart")
        self.device_fatal.set()

    def _device_down(self, reason: str) -> None:
        self.device_failure.append(reason)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # liveness
        worker = self.readiness.drain()
        if worker is not None:
            answered = worker.abandon(reason)
            log.warning("waiting batches answered UNAVAILABLE", answered=answered)
        self.device_failed.set()

    def on_tp_failure(self, reason: str) -> None:
        """A collective failed: NOT_SERVING now (new batches UNAVAILABLE); `serve` exits 1."""
        log.error("tensor-parallel group failed; not serving", reason=reason)
        self.tp_failure.append(reason)
        self.readiness.drain()
        self.tp_failed.set()

    def stop_tp_group(self) -> None:
        """Tell the workers to stop (when the group is healthy), wait, kill what is left."""
        if self.executor is not None:
            self.executor.close()
        if self.tp_group is not None:
            codes = self.tp_group.stop()
            log.info("tensor-parallel workers stopped", exit_codes=codes)

    @property
    def worker(self) -> DeviceWorker | None:
        return self.servicer.worker

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise TimeoutError(f"the executor was not ready within {timeout} s")
        if self.load_error:
            raise RuntimeError("the executor failed to start") from self.load_error[0]

    def drain(self, grace_s: float | None = None) -> bool:
        """Stop taking batches, finish what was accepted within the grace, close the port.
        The worker's stop marker goes in first. Whatever is still queued when the grace ends
        is answered UNAVAILABLE (not run), as is a step still running; returns within the grace
        plus DRAIN_MARGIN_S plus the port's close (<= 1 s). True if everything finished."""
        grace = self.server_config.drain_grace_s if grace_s is None else grace_s
        start = time.monotonic()
        if self.watchdog is not None:  # a drain's own wait is bounded by its grace
            self.watchdog.stop()
        worker = self.readiness.drain()
        self.stop_loading.set()  # a start-up still loading or capturing stops at its next bucket
        log.info("draining", grace_s=grace, queued=worker.depth if worker else 0)
        finished = True
        if worker is not None:
            worker.close()
            finished = worker.wait_idle(grace)
            if not finished:
                answered = worker.abandon("the executor shut down before this batch ran")
                log.warning("drain grace ended", answered_unavailable=answered)
        remaining = max(0.0, grace - (time.monotonic() - start))
        self.server.stop(grace=min(remaining, 1.0)).wait()
        if self.health_server is not None:
            self.health_server.stop(grace=None).wait()
        if self.loader is not None:  # a start-up cut short ends at its next bucket
            self.loader.join(max(0.0, grace - (time.monotonic() - start)))
            if self.loader.is_alive():
                finished = False
                log.warning("start-up did not stop within the drain grace", grace_s=grace)
        if worker is not None and not worker.stop(timeout=DRAIN_MARGIN_S):
            log.warning("a device step outlived the drain; exiting without it")
        left = max(0.0, grace - (time.monotonic() - start))  # a background capture's stop
        if self.executor and not self.executor.control.wait_for_capture(left):
            log.warning("a background graph capture outlived the drain; exiting without it")
        self.stop_tp_group()
        self.servicer.kv.close()  # the channels to KV push peers
        self.telemetry.metrics.close()
        self.telemetry.tracing.shutdown()
        log.info("drained", finished=finished, seconds=round(time.monotonic() - start, 3))
        return finished


def start_server(
    config: ExecutorConfig,
    server_config: ServerConfig,
    *,
    block_until_ready: bool = False,
    span_exporter: SpanExporter | None = None,
    freeze_heap: bool = False,
) -> RunningServer:
    """Open the ports now, load the model in the background; returns at once (or when ready).

    `span_exporter` receives this server's spans too (tests pass an in-memory one); with
    `freeze_heap` (`serve`'s own server) the heap is frozen before it serves (`service.heap`)."""
    credentials = credentials_from(server_config)  # token files read: a bad one fails here
    access = credentials.rules
    server_config.check_with(config.deferred_mask_timeout_s)
    model_cfg, max_context_len = read_model_config(config)
    receive, send = message_limits(
        config, model_cfg.hidden_size, model_cfg.vocab_size, max_context_len
    )
    # An ImportKV request and an ExportKV answer carry one KV chunk (DEFAULT_CHUNK_BYTES).
    receive, send = (
        max(receive, DEFAULT_CHUNK_BYTES + MESSAGE_SLACK),
        max(send, DEFAULT_CHUNK_BYTES + MESSAGE_SLACK),
    )
    options = [("grpc.max_receive_message_length", receive), ("grpc.max_send_message_length", send)]
    metrics = ExecutorMetrics()
    tracing = Tracing(
        server_config.trace_exporter,
        server_config.trace_otlp_endpoint,
        server_config.trace_sample_ratio,
        extra_exporter=span_exporter,
    )
    refusal_log = RateLimitedLog(interval_s=server_config.refusal_log_interval_s)
    telemetry = Telemetry(metrics, tracing, refusal_log)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=server_config.rpc_threads, thread_name_prefix="rpc"),
        options=options,
        maximum_concurrent_rpcs=server_config.concurrent_rpcs,
        # Who may call is checked before a body is read (executor.service.access).
        interceptors=[
            AccessInterceptor(
                access, refusal_log, lambda method, code: metrics.observe_rpc(method, code, 0.0)
            )
        ]
        if access.enabled
        else None,
    )
    forward_limit = forward_call_limit(server_config.rpc_threads, server_config.max_forward_calls)
    servicer = ExecutorServicer(
        config.model,
        server_config.stream_window,
        telemetry,
        access,
        call_limit=CallLimit(forward_limit),
        byte_budget=ByteBudget(batch_budget_bytes(server_config.batch_budget_mib, receive)),
        queue_wait_s=server_config.queue_wait_s,
        stream_idle_timeout_s=server_config.stream_idle_timeout_s,
        deferred_mask_budget_s=server_config.deferred_mask_budget_s,
        kv_calls=CallLimit(server_config.max_kv_calls, "KV data-plane calls", "max_kv_calls"),
        kv_call_timeout_s=server_config.kv_call_timeout_s,
        kv_chunk_timeout_s=server_config.kv_chunk_timeout_s,
        weight_update_timeout_s=server_config.weight_update_timeout_s,
    )
    servicer.weights = weights_service(servicer, server_config, metrics)
    add_executor_servicer(servicer, server)
    health_servicer = MirroredHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{server_config.host}:{server_config.port}"
    tls = server_config.tls
    certificates = CertificateFiles(tls) if tls is not None else None
    # A push dials only kv_peers and presents this server's own identity and KV token.
    servicer.kv.channels = PeerChannels(PeerList.parse(server_config.kv_peers), tls)
    servicer.kv.token = credentials.kv_token
    servicer.kv.log = refusal_log
    servicer.kv.observer = KVTransferObserver(metrics.observe_kv_transfer)
    if certificates is None:
        port = server.add_insecure_port(address)
        if not is_loopback(server_config.host):
            log.warning(
                "plaintext gRPC on a non-loopback address: batches and the runtime-config "
                "token travel unencrypted; set tls_cert_file and tls_key_file",
                host=server_config.host,
            )
    else:
        port = server.add_secure_port(address, certificates.server_credentials())
    if port == 0:
        raise OSError(f"could not listen on {address}")
    health_server, health_port = None, None
    if server_config.health_port >= 0:
        health_server = HealthPort(server_config.host, server_config.health_port, health_servicer)
        health_server.start()
        health_port = health_server.port
    metrics_port = None
    if server_config.metrics_port >= 0:
        try:
            metrics_port = metrics.serve(server_config.host, server_config.metrics_port)
        except OSError as exc:
            server.stop(grace=None)
            if health_server is not None:
                health_server.stop(grace=None)
            raise OSError(
                f"could not serve metrics on {server_config.host}:{server_config.metrics_port}: {exc}"
            ) from exc
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    log.info(
        "listening",
        host=server_config.host,
        port=port,
        tls="mtls" if tls is not None and tls.mutual else "tls" if tls is not None else "off",
        health_port=health_port,
        metrics_port=metrics_port,
        max_receive_bytes=receive,
        max_send_bytes=send,
        runtime_config_token=credentials.operator_token is not None,
        call_token=credentials.call_token is not None,
        allowed_client_identities=len(access.call.identity_patterns),
        kv_transfer=server_config.kv_transfer,
        kv_peers=len(servicer.kv.channels.peers),
        tenants=access.tenants,
    )

    running = RunningServer(
        server,
        port,
        health_servicer,
        servicer,
        threading.Event(),
        [],
        server_config,
        telemetry,
        metrics_port,
        Readiness(health_servicer, servicer, metrics),
        health_server,
        health_port,
        certificates,
    )

    def load() -> None:
        try:
            t0 = time.perf_counter()
            comm = None
            if config.tp_size > 1:
                running.tp_group = tp_launch.start_group(
                    config,
                    dict(os.environ),
                    log_level=server_config.log_level,
                    log_format=server_config.log_format,
                )
                comm = running.tp_group.comm
                comm.on_failure = running.on_tp_failure
            executor = ModelExecutor(config, observer=metrics, stop=running.stop_loading, comm=comm)
            running.executor = executor
            if running.stop_loading.is_set():
                raise StartupCancelled("shutdown requested after the model loaded")
            executor.warmup()
            if running.stop_loading.is_set():
                raise StartupCancelled("shutdown requested after warm-up")
            if freeze_heap:
                heap.freeze()
            worker = DeviceWorker(
                executor,
                server_config.queue_size,
                on_step=metrics.observe_step,
                applied=AppliedBatches(
                    server_config.retry_memory, max_bytes=server_config.retry_memory_mib << 20
                ),
                on_device_error=running.on_device_error,
            )
            if access.tenants:  # callers differ in identity: keep their rows apart
                worker.tenants = RowTenants(executor.req_to_token_pool, executor.limits.kv_slots)
            runtime = RuntimeControl(
                executor,
                trace_sample_ratio=server_config.trace_sample_ratio,
                set_trace_sample_ratio=tracing.set_sample_ratio,
                on_change=metrics.set_runtime_config,
            )
            pool, lora = executor.req_to_token_pool, executor.lora
            metrics.set_executor(
                executor.info,
                LiveSources(
                    queue_depth=lambda: worker.depth,
                    kv_slots_used=pool.slots_in_use,
                    req_rows_used=pool.rows_in_use,
                    lora_running_rows=lora.running_rows if lora is not None else None,
                    lora_operations=(lambda: dict(lora.counts)) if lora is not None else None,
                    graph_capture_running_s=executor.control.background_capture_seconds,
                ),
            )
            if (upgrade := executor.control.start_background()) is not None:  # auto, on a CPU
                runtime.refresh()  # GetRuntimeConfig's graph_capture says "capturing" now
                log.info("graph capture started while serving", graph_mode=upgrade)
            worker.start()
            if server_config.step_timeout_s:
                running.watchdog = DeviceWatchdog(
                    worker, server_config.step_timeout_s, running.on_device_stuck
                )
                running.watchdog.start()
            if running.readiness.serve(worker, runtime):
                log.info("ready", seconds=round(time.perf_counter() - t0, 3))
            else:  # a drain began while the model loaded: it never serves
                worker.stop()
        except StartupCancelled as exc:  # drain() during start-up: never ready, not an error
            log.info("start-up cancelled", reason=str(exc))
            running.load_error.append(exc)
        except BaseException as exc:
            log.error("start-up failed", exc_info=exc)
            running.load_error.append(exc)
        finally:
            if running.load_error and running.tp_group is not None:
                running.tp_group.stop(timeout_s=0)  # workers of a failed start-up: killed
            running.ready.set()

    running.loader = threading.Thread(target=load, name="model-loader", daemon=True)
    running.loader.start()
    if block_until_ready:
        running.wait_ready()
    return running


def serve(config: ExecutorConfig, server_config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain. The process exit code.

    Under torchrun, ranks other than 0 run the tensor-parallel worker loop instead (no
    ports). When the group fails (a rank died or hangs), exit 1 at once: the pod restarts."""
    endpoint = tp_launch.torchrun_endpoint(config, dict(os.environ))
    if endpoint is not None and endpoint.rank != 0:
        return tp_launch.run_torchrun_worker(config, endpoint, server_config)
    triton_off.keep_out_on_cpu(config.device)  # before a background compile imports dynamo
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    log.info("starting", executor_config=config.__dict__, server_config=server_config.__dict__)
    heap.freeze(collect=False)  # the imports' objects (`heap`); the rest once warmed
    running = start_server(config, server_config, freeze_heap=True)
    while not stop.wait(0.5):
        if running.ready.is_set() and running.load_error:
            running.server.stop(grace=None)
            return 1
        if running.device_fatal.is_set():  # no drain: the device context is unusable
            log.error("exiting: the device failed", reason=running.device_failure[0])
            running.server.stop(grace=1.0).wait()
            if running.health_server is not None:
                running.health_server.stop(grace=None).wait()
            running.telemetry.metrics.close()
            return 1
        if running.tp_failed.is_set():
            log.error("exiting: tensor-parallel group failed", reason=running.tp_failure[0])
            running.server.stop(grace=1.0).wait()
            running.stop_tp_group()
            return 1
    log.info("shutdown signal received")
    running.drain()
    return 0
