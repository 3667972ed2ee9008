"""The one map from errors to gRPC status codes, and how a handler answers with it."""

from __future__ import annotations

from concurrent.futures import CancelledError

import grpc
import structlog

from executor.core.controls_types import DeferredMaskTimeout
from executor.core.errors import (
    BatchTooLargeError,
    BatchValidationError,
    KVChecksumError,
    KVStateError,
    LoraAdapterError,
    LoraNotFoundError,
    LoraSlotsFullError,
    LoraStateError,
    ModelStateError,
    RuntimeConfigError,
    ToggleRefusedError,
    WeightChunkError,
)
from executor.observability.telemetry import RpcScope, caller_gone
from executor.observability.tracing import SpanScope
from executor.parallel.comm import TpGroupError
from executor.service.access import PermissionDeniedError
from executor.service.admission import CapacityError, StreamIdleError
from executor.service.auth import UnauthenticatedError
from executor.service.handlers import UndecodableRequestError
from executor.service.jobs import (
    QueueFullError,
    RpcEndedError,
    StreamFailedError,
    WorkerClosedError,
)

log = structlog.get_logger(__name__)


class NotServingError(RuntimeError):
    """The executor is still loading, or is draining before shutdown."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, LoraNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, LoraSlotsFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, LoraAdapterError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, LoraStateError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, BatchTooLargeError | QueueFullError | CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, BatchValidationError | RuntimeConfigError | UndecodableRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KVChecksumError | WeightChunkError):
        return grpc.StatusCode.DATA_LOSS, str(exc)
    if isinstance(exc, ToggleRefusedError | KVStateError | ModelStateError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, NotServingError | WorkerClosedError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TpGroupError):  # a rank died or hangs: this server is going away
        return grpc.StatusCode.UNAVAILABLE, f"tensor-parallel group failed: {exc}"
    if isinstance(exc, RpcEndedError):
        code = grpc.StatusCode.DEADLINE_EXCEEDED if exc.deadline else grpc.StatusCode.CANCELLED
        return code, str(exc)
    if isinstance(exc, CancelledError):  # the RPC ended while its job waited: never run
        return (
            grpc.StatusCode.CANCELLED,
            "the RPC ended before the device reached the batch; it was not applied",
        )
    if isinstance(exc, StreamIdleError | DeferredMaskTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, StreamFailedError):
        return grpc.StatusCode.ABORTED, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def abort(
    context: grpc.ServicerContext,
    exc: BaseException,
    rpc: RpcScope,
    batch_id: int | None = None,
    span: SpanScope | None = None,
) -> None:
    """Answer the RPC with the status `exc` maps to (logged with the code and trace ids)."""
    gone = caller_gone(context)
    if gone is not None:  # whatever failed, the caller had already left
        rpc.caller_left(gone, batch_id)
        context.abort(gone, rpc.message)
    code, message = status_for(exc)
    if (
        batch_id is not None
        and f"batch_id {batch_id}" not in message
        and not message.startswith("batch_id:")
    ):
        message = f"batch_id {batch_id}: {message}"
    rpc.fail(code, message)
    ids = {**(span or rpc).log_ids(), **rpc.peer.log_fields()}
    if code is grpc.StatusCode.INTERNAL:
        log.error("request failed", batch_id=batch_id, code=code.name, exc_info=exc, **ids)
    elif isinstance(exc, UndecodableRequestError):  # no stack trace: nothing of ours failed
        rpc.refusal_log.warning(
            f"{rpc.method}:{code.name}:undecodable", "undecodable request",
            code=code.name, reason=message, **ids,
        )  # fmt: skip
    else:  # the caller's doing: one line per reason per interval, however many it sends
        rpc.refusal_log.info(
            f"{rpc.method}:{code.name}:{type(exc).__name__}", "request refused",
            batch_id=batch_id, code=code.name, reason=message, **ids,
        )  # fmt: skip
    context.abort(code, message)
