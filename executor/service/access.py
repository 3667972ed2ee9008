"""Who may call: the client-identity allowlist and the bearer token, checked before decode.

Every RPC on the gRPC port passes `AccessInterceptor` first. It hands the handler the request
*bytes* (gRPC's own decoder is taken off the method) and decodes them only after the call was
admitted, so a caller that is not allowed costs the server no protobuf parse and reaches no
servicer code. Two rules, each optional:

- `allowed_client_identities` (needs mTLS): the client certificate must carry an identity (a
  subject alternative name, the subject's common name, or the whole subject `CN=...,O=...`)
  that matches one of the patterns (`fnmatch` globs, case-sensitive). Otherwise
  PERMISSION_DENIED; the message names the rule and the caller's own identities, never the list.
- `call_token_file`: every call carries `authorization: Bearer <token>`; the runtime-config
  token passes too (an operator's token is a superset). Otherwise UNAUTHENTICATED.

The health-only port (`health_port`) has no interceptor: the kubelet probes it without
credentials, and it serves nothing but grpc.health.v1.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import structlog

from executor.observability.log_limit import RateLimitedLog
from executor.observability.peer import Peer, peer_of
from executor.service.auth import TokenCheck, UnauthenticatedError

log = structlog.get_logger(__name__)


class PermissionDeniedError(PermissionError):
    """The client's certificate names no allowed identity. Maps to PERMISSION_DENIED."""


def parse_identity_patterns(text: str) -> tuple[str, ...]:
    """`allowed_client_identities` ("a, spiffe://ns/sa/*") as patterns; ValueError if empty."""
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if text.strip() and not patterns:
        raise ValueError(f"allowed_client_identities {text!r} holds no pattern")
    return patterns


class AccessRules:
    """The allowlist and the call token; `check` raises the refusal a call earns."""

    def __init__(self, identity_patterns: Sequence[str], token_check: TokenCheck) -> None:
        self.identity_patterns = tuple(identity_patterns)
        self.token_check = token_check

    @property
    def enabled(self) -> bool:
        return bool(self.identity_patterns) or self.token_check.enabled

    def check(self, peer: Peer, metadata: Sequence[Any] | None) -> None:
        if self.identity_patterns:
            if not peer.identities:
                raise UnauthenticatedError(
                    "this server admits only clients with a certificate "
                    "(allowed_client_identities): connect with mTLS"
                )
            if not any(
                fnmatch.fnmatchcase(name, pattern)
                for name in peer.identities
                for pattern in self.identity_patterns
            ):
                raise PermissionDeniedError(
                    f"client identity {list(peer.identities)} is not allowed to call this server "
                    "(rule: allowed_client_identities)"
                )
        self.token_check.check(metadata)


def _refusal_code(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.UNAUTHENTICATED


class AccessInterceptor(grpc.ServerInterceptor):
    """Applies `AccessRules` to every method before its request is decoded."""

    def __init__(
        self,
        rules: AccessRules,
        refusal_log: RateLimitedLog,
        on_refusal: Callable[[str, str], None] | None = None,
    ) -> None:
        self.rules = rules
        self._refusal_log = refusal_log
        self._on_refusal = on_refusal  # (method, code name): counts the refusal

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or not self.rules.enabled:
            return handler
        return _guarded(handler, details.method, self._admit)

    def _admit(self, method: str, context: grpc.ServicerContext) -> None:
        """Return when the call may go on; else answer it with its refusal (raises)."""
        peer = peer_of(context)
        try:
            self.rules.check(peer, context.invocation_metadata())
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            code = _refusal_code(exc)
            if self._on_refusal is not None:
                self._on_refusal(method.rsplit("/", 1)[-1], code.name)
            self._refusal_log.warning(
                f"access:{code.name}", "call refused", method=method, code=code.name,
                reason=str(exc), **peer.log_fields(),
            )  # fmt: skip
            context.abort(code, str(exc))


def _decode(
    deserialize: Callable[[bytes], Any] | None, data: bytes, context: grpc.ServicerContext
) -> Any:
    if deserialize is None:
        return data
    try:
        return deserialize(data)
    except Exception as exc:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request payload ({len(data)} bytes) does not parse: {type(exc).__name__}",
        )


def _guarded(
    handler: grpc.RpcMethodHandler,
    method: str,
    admit: Callable[[str, grpc.ServicerContext], None],
) -> grpc.RpcMethodHandler:
    """`handler` with its request decoder moved behind `admit`."""
    deserialize = handler.request_deserializer
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        def uu(data: bytes, context: grpc.ServicerContext) -> Any:
            admit(method, context)
            return unary_unary(_decode(deserialize, data, context), context)

        return grpc.unary_unary_rpc_method_handler(uu, None, serialize)
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream

        def us(data: bytes, context: grpc.ServicerContext) -> Any:
            admit(method, context)
            return unary_stream(_decode(deserialize, data, context), context)

        return grpc.unary_stream_rpc_method_handler(us, None, serialize)

    def decoded(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        for data in requests:
            yield _decode(deserialize, data, context)

    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        def su(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            admit(method, context)
            return stream_unary(decoded(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(su, None, serialize)
    stream_stream = handler.stream_stream

    def ss(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        admit(method, context)
        return stream_stream(decoded(requests, context), context)

    return grpc.stream_stream_rpc_method_handler(ss, None, serialize)
