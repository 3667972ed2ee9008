"""How the gRPC server runs (as opposed to what the executor computes): ports, queues, drain,
logs, metrics, traces, TLS, and the runtime-config token."""

from __future__ import annotations

from dataclasses import dataclass

from executor.config import setting
from executor.observability.logs import FORMATS, LEVELS
from executor.observability.tracing import TRACE_EXPORTERS
from executor.service.admission import forward_call_limit
from executor.service.tls import TlsFiles, is_loopback


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in a container)")
    port: int = setting(50051, "gRPC port; 0 picks a free one")
    queue_size: int = setting(
        64, "batches that may wait for the device; more get RESOURCE_EXHAUSTED"
    )
    batch_budget_mib: int = setting(
        1024,
        "MiB of encoded batches that may be queued for or running on the device at once; a "
        "batch beyond it gets RESOURCE_EXHAUSTED before it is decoded (raised to one largest "
        "batch, the receive limit, when smaller); 0 = no byte budget",
    )
    stream_window: int = setting(4, "batches one ForwardStream may have queued or running at once")
    drain_grace_s: float = setting(
        30.0, "on SIGTERM/SIGINT, seconds to finish queued and running batches"
    )
    rpc_threads: int = setting(16, "gRPC handler threads (the device itself is one thread)")
    max_concurrent_rpcs: int = setting(
        0,
        "RPCs the gRPC port holds at once, running or waiting for a handler thread; more get "
        "RESOURCE_EXHAUSTED at once instead of queueing without bound (idle streams, bodies "
        "that never arrive); >= rpc_threads; 0 = 4 x rpc_threads",
    )
    max_forward_calls: int = setting(
        0,
        "Forward/ForwardStream calls in progress at once (each holds a handler thread); more "
        "get RESOURCE_EXHAUSTED; with max_kv_calls (when kv_transfer is on) must be < "
        "rpc_threads so health and GetInfo always have threads; 0 = rpc_threads less a "
        "quarter (at least 2 kept free)",
    )
    queue_wait_s: float = setting(
        30.0,
        "longest a unary Forward's batch waits for the device before it is answered "
        "RESOURCE_EXHAUSTED (not applied); 0 = as long as the call's deadline allows",
    )
    step_timeout_s: float = setting(
        300.0,
        "device watchdog: a step running longer than this turns liveness and readiness "
        "NOT_SERVING and answers every waiting batch UNAVAILABLE (the pod restarts); "
        "0 = no watchdog",
    )
    stream_idle_timeout_s: float = setting(
        300.0,
        "a ForwardStream that sends no batch for this long, with none in flight, is ended "
        "(DEADLINE_EXCEEDED) and its handler thread freed; 0 = never",
    )
    deferred_mask_budget_s: float = setting(
        1.0,
        "device seconds one ForwardStream may spend waiting for its deferred vocab masks, "
        "refilled at that much per 5 s (so at most a fifth of the device); a wait beyond it "
        "ends DEADLINE_EXCEEDED (nothing applied); 0 = only deferred_mask_timeout_s bounds a "
        "wait",
    )
    retry_memory: int = setting(
        1024,
        "batch_ids of the last applied batches kept with their responses: a retry with the "
        "same batch_id gets the stored response and is not applied again; 0 turns it off",
    )
    retry_memory_mib: int = setting(
        256,
        "the most MiB of stored responses the retry memory keeps (the oldest are forgotten "
        "first; prompt logprobs and hidden states make responses large)",
    )
    log_level: str = setting("info", "debug | info | warning | error; a runtime toggle too")
    log_format: str = setting(
        "auto", "auto (console on a terminal, else JSON lines) | json | console"
    )
    metrics_port: int = setting(
        9464, "Prometheus /metrics port (on `host`); 0 picks a free one, -1 turns it off"
    )
    trace_exporter: str = setting(
        "none", "none | console (spans on stderr) | otlp (OTLP over gRPC to trace_otlp_endpoint)"
    )
    trace_otlp_endpoint: str = setting(
        "http://localhost:4317", "OTLP gRPC collector for trace_exporter=otlp (http:// = no TLS)"
    )
    trace_sample_ratio: float = setting(
        1.0,
        "share of RPCs traced when the caller sent no sampled traceparent (a caller's sampled "
        "flag is always honoured); a runtime toggle too",
    )
    runtime_config_token_file: str = setting(
        "",
        "token file (lines 'TOKEN' or 'NAME TOKEN', re-read when it changes) of the operator "
        "calls (GetRuntimeConfig/UpdateRuntimeConfig): they need 'authorization: Bearer TOKEN' "
        "metadata; with neither it nor allowed_operator_identities they are closed "
        "(PERMISSION_DENIED)",
    )
    allowed_operator_identities: str = setting(
        "",
        "comma-separated glob patterns of client-certificate identities that may make the "
        "operator calls (GetRuntimeConfig/UpdateRuntimeConfig); needs tls_client_ca_file; "
        "'' = the runtime-config token decides",
    )
    operator_calls_open: bool = setting(
        False,
        "development only: with no runtime-config token or operator identity, open the "
        "operator calls to every caller the call rule admits; refused unless host is loopback",
    )
    call_token_file: str = setting(
        "",
        "token file (lines 'TOKEN' or 'NAME TOKEN'; NAME is the caller's identity, which its "
        "rows are kept under; re-read when it changes) of a bearer token that EVERY call on "
        "the gRPC port must carry ('authorization: Bearer TOKEN'; the runtime-config token "
        "passes too), checked from the metadata before the body is read; else "
        "UNAUTHENTICATED; '' = no token",
    )
    kv_transfer: bool = setting(
        False,
        "serve the KV data plane (ExportKV/ImportKV/PushKV); off, they answer UNIMPLEMENTED; "
        "on a non-loopback host it needs kv_token_file or allowed_kv_identities",
    )
    kv_token_file: str = setting(
        "",
        "token file of the KV data plane: KV calls carry this token in place of the call "
        "token (the call token does not open them); this server's pushes send its first "
        "line; '' = KV calls follow the call rule (loopback only)",
    )
    allowed_kv_identities: str = setting(
        "",
        "comma-separated glob patterns of client-certificate identities that may make KV "
        "calls (schedulers, and peer executors that push here), in place of "
        "allowed_client_identities; needs tls_client_ca_file",
    )
    kv_peers: str = setting(
        "",
        "comma-separated executors PushKV may dial: 'host:port' (a DNS name or IP), "
        "'*.domain:port' (any name under domain), 'CIDR:port' (any IP in the network, e.g. "
        "the pod network), or a listed 'unix:PATH'; any other target is refused before "
        "dialing (PERMISSION_DENIED); under TLS the peer's certificate must name the host it "
        "is dialed by; '' = PushKV off",
    )
    max_kv_calls: int = setting(
        2,
        "KV data-plane calls (ExportKV/ImportKV/PushKV) in progress at once, apart from "
        "max_forward_calls; more get RESOURCE_EXHAUSTED",
    )
    kv_call_timeout_s: float = setting(
        120.0,
        "longest a KV call may run on this server, whatever deadline its caller set; a "
        "push's transfers share it; then the call is cancelled",
    )
    kv_chunk_timeout_s: float = setting(
        10.0,
        "longest an ImportKV stream may go without sending its next message; then it is "
        "cancelled and nothing is written",
    )
    weight_update_root: str = setting(
        "",
        "directory UpdateWeightsFromPath may read safetensors from (symlinks resolved; any "
        "path outside it is PERMISSION_DENIED); '' = path updates off",
    )
    max_weight_update_mib: int = setting(
        0,
        "the most MiB one weight update may carry (its header's tensors at their dtypes), "
        "refused from the header (RESOURCE_EXHAUSTED); staged on the host while steps run; "
        "0 = the model's own size in float32",
    )
    weight_group_addresses: str = setting(
        "",
        "comma-separated glob patterns of the master_address a trainer's weights group may "
        "rendezvous at (InitWeightsGroup dials it and the members it names); others are "
        "PERMISSION_DENIED before anything is dialed; '' = InitWeightsGroup off",
    )
    weight_update_timeout_s: float = setting(
        600.0,
        "longest an UpdateWeights stream may take to arrive (then it is cancelled and the "
        "weights stay as they were), and the most InitWeightsGroup's timeout_s may ask (a "
        "weights group's bound on each collective)",
    )
    refusal_log_interval_s: float = setting(
        10.0,
        "refused calls and batches log one line per reason per this many seconds, with the "
        "count of lines suppressed since; 0 = every refusal",
    )

    tls_cert_file: str = setting(
        "",
        "PEM certificate chain the gRPC port serves (TLS); re-read when the file changes; "
        "'' = plaintext",
    )
    tls_key_file: str = setting("", "PEM private key of tls_cert_file (both or neither)")
    tls_client_ca_file: str = setting(
        "",
        "PEM CA bundle; when set, clients must present a certificate it signed (mTLS); "
        "needs tls_cert_file",
    )
    allowed_client_identities: str = setting(
        "",
        "comma-separated glob patterns (fnmatch) of client-certificate identities (a SAN such "
        "as spiffe://cluster/ns/llm/sa/scheduler or a DNS name, the subject's common name, or "
        "the subject 'CN=..,O=..') that may call; others get PERMISSION_DENIED before their "
        "request is decoded; needs tls_client_ca_file (mTLS); '' = any certificate the CA signed",
    )
    health_port: int = setting(
        -1,
        "plaintext port serving only grpc.health.v1 (for kubelet gRPC probes, which cannot "
        "speak TLS); 0 picks a free one, -1 turns it off",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("queue_size", "stream_window", "rpc_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_concurrent_rpcs and self.max_concurrent_rpcs < self.rpc_threads:
            raise ValueError(
                f"max_concurrent_rpcs must be 0 (auto) or >= rpc_threads ({self.rpc_threads}), "
                f"got {self.max_concurrent_rpcs}"
            )
        if not 0 <= self.max_forward_calls < self.rpc_threads:
            raise ValueError(
                f"max_forward_calls must be in 0..rpc_threads-1 ({self.rpc_threads - 1}), "
                f"got {self.max_forward_calls}"
            )
        for name in (
            "queue_wait_s",
            "stream_idle_timeout_s",
            "step_timeout_s",
            "deferred_mask_budget_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_budget_mib < 0:
            raise ValueError(f"batch_budget_mib must be >= 0, got {self.batch_budget_mib}")
        if self.retry_memory_mib < 1:
            raise ValueError(f"retry_memory_mib must be >= 1, got {self.retry_memory_mib}")
        if self.retry_memory < 0:
            raise ValueError(f"retry_memory must be >= 0, got {self.retry_memory}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.log_level not in LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LEVELS)}, got {self.log_level!r}"
            )
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ValueError(
                f"metrics_port must be in 0..65535, or -1 (off), got {self.metrics_port}"
            )
        if self.trace_exporter not in TRACE_EXPORTERS:
            raise ValueError(
                f"trace_exporter must be one of {', '.join(TRACE_EXPORTERS)}, "
                f"got {self.trace_exporter!r}"
            )
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in 0..1, got {self.trace_sample_ratio}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        for name in (
            "allowed_client_identities",
            "allowed_kv_identities",
            "allowed_operator_identities",
        ):
            if getattr(self, name).strip() and not self.tls_client_ca_file:
                raise ValueError(
                    f"{name} needs tls_client_ca_file (mTLS): without client certificates no "
                    "caller has an identity to check"
                )
        self._check_kv()
        if self.operator_calls_open and not is_loopback(self.host):
            raise ValueError(
                "operator_calls_open is for development on a loopback host; on "
                f"{self.host!r} set runtime_config_token_file or allowed_operator_identities"
            )
        if self.max_weight_update_mib < 0:
            raise ValueError(
                f"max_weight_update_mib must be >= 0, got {self.max_weight_update_mib}"
            )
        if not self.weight_update_timeout_s > 0:
            raise ValueError(
                f"weight_update_timeout_s must be > 0, got {self.weight_update_timeout_s}"
            )
        if self.refusal_log_interval_s < 0:
            raise ValueError(
                f"refusal_log_interval_s must be >= 0, got {self.refusal_log_interval_s}"
            )
        if not -1 <= self.health_port <= 65535:
            raise ValueError(
                f"health_port must be in 0..65535, or -1 (off), got {self.health_port}"
            )
        if self.log_format not in FORMATS:
            raise ValueError(
                f"log_format must be one of {', '.join(FORMATS)}, got {self.log_format!r}"
            )

    def check_with(self, deferred_mask_timeout_s: float) -> None:
        """The checks that need the executor's settings too."""
        if 0 < self.step_timeout_s <= deferred_mask_timeout_s:
            raise ValueError(
                f"deferred_mask_timeout_s ({deferred_mask_timeout_s:g}) must be below "
                f"step_timeout_s ({self.step_timeout_s:g}): a missing mask would restart the pod"
            )

    def _check_kv(self) -> None:
        if self.max_kv_calls < 1:
            raise ValueError(f"max_kv_calls must be >= 1, got {self.max_kv_calls}")
        for name in ("kv_call_timeout_s", "kv_chunk_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.kv_transfer:
            if self.kv_peers.strip():
                raise ValueError("kv_peers needs kv_transfer (PushKV is a KV call)")
            return
        forward = forward_call_limit(self.rpc_threads, self.max_forward_calls)
        if forward + self.max_kv_calls >= self.rpc_threads:
            raise ValueError(
                f"max_forward_calls ({forward}) + max_kv_calls ({self.max_kv_calls}) must be < "
                f"rpc_threads ({self.rpc_threads}): health and GetInfo need threads"
            )
        if (
            not is_loopback(self.host)
            and not self.kv_token_file
            and not self.allowed_kv_identities.strip()
        ):
            raise ValueError(
                "kv_transfer on a non-loopback host needs its own credential: kv_token_file "
                "or allowed_kv_identities (the KV plane reads and writes every request's KV)"
            )
        if self.kv_peers.strip() and self.tls_cert_file and not self.tls_client_ca_file:
            raise ValueError(
                "kv_peers under TLS needs tls_client_ca_file: the CA that verifies the peers "
                "(the system roots are never used for pushes)"
            )

    @property
    def concurrent_rpcs(self) -> int:
        """The effective `max_concurrent_rpcs`."""
        return self.max_concurrent_rpcs or 4 * self.rpc_threads

    @property
    def tls(self) -> TlsFiles | None:
        """The TLS files of the gRPC port; None = plaintext."""
        if not self.tls_cert_file:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
