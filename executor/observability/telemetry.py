"""The RPC side of observability: one scope per RPC that times it, counts its status code and
holds its server span.

    with telemetry.rpc("Forward", context) as rpc:
        ...                      # rpc.child("decode"), rpc.record_step(stats, batch_id)
        abort(context, exc, rpc) # sets rpc.code before the RPC ends

On exit the scope observes `model_executor_rpc_seconds{method}` and
`model_executor_requests_total{method,code}` and ends the span with the status code. It runs
before gRPC sends the answer, so a client that got its answer can scrape the count.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

import grpc
import structlog

from executor.observability.log_limit import RateLimitedLog
from executor.observability.metrics import ExecutorMetrics
from executor.observability.peer import Peer, PeerBook, peer_of
from executor.observability.tracing import SpanScope, Tracing
from model_executor.v1 import executor_pb2 as pb

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelExecutor"].full_name


def caller_gone(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    """DEADLINE_EXCEEDED or CANCELLED when the caller stopped waiting (its deadline passed, or
    it cancelled or went away), else None. Either is the caller's doing, not a failure."""
    if context.is_active():
        return None
    if context.time_remaining() <= 0:  # no deadline: a far-future one, so > 0
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


CALLER_GONE_MESSAGES = {
    grpc.StatusCode.CANCELLED: "the client cancelled the call or went away",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the client's deadline passed before the answer",
}


class RpcScope(SpanScope):
    """An RPC's span and timer, plus the status it will end with (set by `servicer.abort`).

    A context manager (a class, not a generator: every RPC pays for it).
    """

    def __init__(self, telemetry: Telemetry, method: str, context: grpc.ServicerContext) -> None:
        self._start = time.perf_counter()
        self._context = context
        self._metrics = telemetry.metrics
        self.refusal_log = telemetry.refusal_log
        self.method = method
        self.code = _OK
        self.message = ""
        # Ended once: by the handler's `with` exit, or by `end_if_caller_gone` from gRPC's
        # termination callback, whichever comes first (they run on different threads).
        self._end_lock = threading.Lock()
        self._ended = False
        tracing = telemetry.tracing
        full = _FULL_NAMES.get(method) or _FULL_NAMES.setdefault(method, f"{SERVICE_NAME}/{method}")
        span = tracing.server_span(full, context.invocation_metadata())
        super().__init__(tracing.tracer, span)
        # The address now, while the call is live (a termination callback may log it later);
        # the certificate identities lazily: only traced calls and logged lines pay for them.
        self._address = context.peer()
        self._peer: Peer | None = None
        if self.recording:
            span.set_attributes(self.peer.span_attributes())
        if telemetry.peers.first(self._address):  # once per connection, not per call
            log.info("new peer", method=method, **self.peer.log_fields())

    @property
    def peer(self) -> Peer:
        """The caller: its address and, under mTLS, its certificate identities (read once)."""
        if self._peer is None:
            self._peer = peer_of(self._context, self._address)
        return self._peer

    def log_ids(self) -> dict[str, Any]:
        """Trace ids and the caller, for a log line about this RPC."""
        return {**super().log_ids(), **self.peer.log_fields()}

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message

    def caller_left(self, code: grpc.StatusCode, batch_id: int | None = None) -> None:
        """End as CANCELLED / DEADLINE_EXCEEDED (from `caller_gone`): an info line, no trace.
        Nothing when the scope already ended (gRPC's termination callback came first)."""
        with self._end_lock:
            if not self._ended:
                self._caller_left(code, batch_id)

    def _caller_left(self, code: grpc.StatusCode, batch_id: int | None = None) -> None:
        self.fail(code, CALLER_GONE_MESSAGES[code])
        log.info(
            "caller gone",
            method=self.method,
            batch_id=batch_id,
            code=code.name,
            reason=self.message,
            **self.log_ids(),
        )

    def __enter__(self) -> RpcScope:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
            try:
                if self.code is _OK:
                    # Answered (or about to be) while the caller no longer waits: its doing,
                    # counted under its own code. A stream's generator closed by gRPC too.
                    gone = caller_gone(self._context)
                    if (
                        gone is None
                        and exc_type is not None
                        and issubclass(exc_type, GeneratorExit)
                    ):
                        gone = grpc.StatusCode.CANCELLED
                    if gone is not None:
                        self._caller_left(gone)
                    elif exc_type is not None:  # not aborted by us: gRPC answers UNKNOWN
                        self.fail(grpc.StatusCode.UNKNOWN, f"{exc_type.__name__}: {exc}")
            finally:  # counted even if the log line failed: the RPC ends exactly once
                name, value = _OK_CODE if self.code is _OK else _CODES[self.code]
                self._metrics.observe_rpc(self.method, name, time.perf_counter() - self._start)
                self.finish(name, value, self.message)

    def end_if_caller_gone(self) -> None:
        """From gRPC's termination callback: a stream whose caller left ends now, even if its
        handler never runs again (gRPC stops iterating a response generator whose send failed,
        and the suspended generator is closed only when it is collected, which can take a full
        garbage collection). Nothing when the caller is still there or the handler ended."""
        if caller_gone(self._context) is not None:
            self.__exit__(None, None, None)


_CODES = {code: (code.name, code.value[0]) for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK
_OK_CODE = _CODES[_OK]
_FULL_NAMES: dict[str, str] = {}  # method -> /service/method


class Telemetry:
    """Metrics and tracing of one server, as the gRPC handlers use them."""

    def __init__(
        self, metrics: ExecutorMetrics, tracing: Tracing, refusal_log: RateLimitedLog | None = None
    ) -> None:
        self.metrics = metrics
        self.tracing = tracing
        # Refusals (the caller's doing) log one line per reason per interval.
        self.refusal_log = refusal_log if refusal_log is not None else RateLimitedLog()
        self.peers = PeerBook()

    def rpc(self, method: str, context: grpc.ServicerContext) -> RpcScope:
        """`with telemetry.rpc("Forward", context) as rpc:` around a handler's body."""
        return RpcScope(self, method, context)
