"""Who may call: one rule per class of methods, checked before a handler thread waits for a body.

Three classes, each with its own rule (`AccessRules`):
- **calls** (Forward, GetInfo, health, reflection, ...): `allowed_client_identities` (mTLS: the
  client certificate must carry a matching identity, a SAN, the subject's common name or the
  whole subject, `fnmatch` globs) and `call_token_file` (`authorization: Bearer <token>`; the
  runtime-config token passes too);
- **the KV data plane** (ExportKV, ImportKV, PushKV): refused (UNIMPLEMENTED) unless
  `kv_transfer` is on; then `kv_token_file` in place of the call token and
  `allowed_kv_identities` in place of the client allowlist (each falls back to the call rule's
  when unset);
- **operator calls** (GetRuntimeConfig, UpdateRuntimeConfig, the weight and memory calls,
  LoadLora, UnloadLora; a later call that changes the model for every caller adds its name to
  OPERATOR_METHODS): the runtime-config token or
  `allowed_operator_identities`; with neither they are closed (PERMISSION_DENIED), unless
  `operator_calls_open` (loopback only).

A missing or wrong token is refused in `intercept_service`, from the call's metadata, with a
handler that reads no request: a caller without the token never holds a thread waiting for a
body. An identity (which needs the call's auth context, not there yet) is checked first thing
in the handler; unary methods are served as request-streaming ones so that the check runs
before the body is read, and the body is decoded only after it (a refused caller costs no
protobuf parse). A method whose rule asks for nothing is served unwrapped (no cost).

The health-only port (`health_port`) has no rules: the kubelet probes it without credentials.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from executor.observability.log_limit import RateLimitedLog
from executor.observability.peer import Peer, peer_of
from executor.service.auth import TokenCheck, UnauthenticatedError

log = structlog.get_logger(__name__)

SERVICE_PREFIX = "/model_executor.v1.ModelExecutor/"
KV_METHODS = frozenset({"ExportKV", "ImportKV", "PushKV"})
# Calls that change the model (or read its config) for every caller.
OPERATOR_METHODS = frozenset(
    {
        "GetRuntimeConfig",
        "UpdateRuntimeConfig",
        "UpdateWeights",
        "UpdateWeightsFromPath",
        "InitWeightsGroup",
        "UpdateWeightsFromGroup",
        "DestroyWeightsGroup",
        "ReleaseMemory",
        "ResumeMemory",
        "LoadLora",
        "UnloadLora",
    }
)
OWNER_KEY = "x-model-executor-kv-owner"  # an import's row owner, sent by a pushing executor


class PermissionDeniedError(PermissionError):
    """The caller may not do this (identity, closed method, another's row): PERMISSION_DENIED."""


def parse_identity_patterns(
    text: str, setting: str = "allowed_client_identities"
) -> tuple[str, ...]:
    """A comma-separated allowlist ("a, spiffe://ns/sa/*") as patterns; ValueError if empty."""
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if text.strip() and not patterns:
        raise ValueError(f"{setting} {text!r} holds no pattern")
    return patterns


@dataclass(frozen=True)
class Rule:
    """Who may call one class of methods."""

    name: str  # the setting a refusal names
    identity_patterns: tuple[str, ...] = ()
    tokens: TokenCheck = field(default_factory=TokenCheck)
    closed: str = ""  # why every call is refused ("" = open to whoever passes the checks)
    closed_code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED

    @property
    def free(self) -> bool:
        """Nothing to check: served unwrapped."""
        return not self.closed and not self.identity_patterns and not self.tokens.enabled

    def check_identity(self, peer: Peer) -> None:
        if not self.identity_patterns:
            return
        if not peer.identities:
            raise UnauthenticatedError(
                f"this server admits only clients with a certificate ({self.name}): connect "
                "with mTLS"
            )
        if not any(
            fnmatch.fnmatchcase(name, pattern)
            for name in peer.identities
            for pattern in self.identity_patterns
        ):
            raise PermissionDeniedError(
                f"client identity {list(peer.identities)} is not allowed to call this "
                f"(rule: {self.name})"
            )


class AccessRules:
    """The rules of the three method classes; `tenants`: whether callers may differ in
    identity (named tokens or client certificates), so that rows are kept apart."""

    def __init__(self, call: Rule, kv: Rule, operator: Rule, *, tenants: bool = False) -> None:
        self.call, self.kv, self.operator = call, kv, operator
        self.tenants = tenants

    @property
    def enabled(self) -> bool:
        return not (self.call.free and self.kv.free and self.operator.free)

    def rule_for(self, method: str) -> Rule:
        if method.startswith(SERVICE_PREFIX):
            name = method[len(SERVICE_PREFIX) :]
            if name in KV_METHODS:
                return self.kv
            if name in OPERATOR_METHODS:
                return self.operator
        return self.call

    def may_operate(self, context: grpc.ServicerContext) -> bool:
        """Whether this call's caller would pass the operator rule (GetInfo shows it the
        runtime config)."""
        rule = self.operator
        if rule.closed:
            return False
        try:
            rule.tokens.check(context.invocation_metadata())
            rule.check_identity(peer_of(context))
        except (UnauthenticatedError, PermissionDeniedError):
            return False
        return True

    def identity(self, context: grpc.ServicerContext, rule: Rule | None = None) -> str:
        """The caller's identity, which its rows are recorded under: its certificate's first
        name, else the name of its token's line; "" when callers are not told apart."""
        if not self.tenants:
            return ""
        peer = peer_of(context)
        if peer.identities:
            return peer.identities[0]
        try:
            return (rule or self.call).tokens.check(context.invocation_metadata())
        except UnauthenticatedError:
            return ""


def _refusal_code(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.UNAUTHENTICATED


class AccessInterceptor(grpc.ServerInterceptor):
    """Applies `AccessRules` to every method before its request is read."""

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
        if handler is None:
            return handler
        rule = self.rules.rule_for(details.method)
        if rule.free:
            return handler
        if rule.closed:
            return self._refusing(handler, details.method, rule.closed_code, rule.closed)
        try:  # from the metadata: no thread waits for the body of a call without the token
            rule.tokens.check(details.invocation_metadata)
        except UnauthenticatedError as exc:
            return self._refusing(
                handler, details.method, grpc.StatusCode.UNAUTHENTICATED, str(exc)
            )
        if not rule.identity_patterns:
            return handler
        return _guarded(handler, details.method, lambda m, c: self._admit(rule, m, c))

    def _refuse(
        self, method: str, code: grpc.StatusCode, reason: str, context: grpc.ServicerContext
    ) -> None:
        peer = peer_of(context)
        if self._on_refusal is not None:
            self._on_refusal(method.rsplit("/", 1)[-1], code.name)
        self._refusal_log.warning(
            f"access:{code.name}", "call refused", method=method, code=code.name,
            reason=reason, **peer.log_fields(),
        )  # fmt: skip
        context.abort(code, reason)

    def _refusing(
        self, handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, reason: str
    ) -> grpc.RpcMethodHandler:
        """A handler that answers `code` at once, reading no request (request-streaming:
        gRPC runs it without waiting for a body)."""

        def refuse(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            self._refuse(method, code, reason, context)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.stream_unary_rpc_method_handler(refuse)

    def _admit(self, rule: Rule, method: str, context: grpc.ServicerContext) -> None:
        """Return when the caller's identity may call; else answer with the refusal."""
        try:
            rule.check_identity(peer_of(context))
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            self._refuse(method, _refusal_code(exc), str(exc), context)


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


def _single(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    """The one request of a unary method served as request-streaming."""
    data = next(requests, None)
    if data is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
    assert data is not None
    return data


def _guarded(
    handler: grpc.RpcMethodHandler,
    method: str,
    admit: Callable[[str, grpc.ServicerContext], None],
) -> grpc.RpcMethodHandler:
    """`handler` with `admit` first and its request decoder moved behind it. Unary requests
    are read as a stream, so `admit` runs before the body arrives."""
    deserialize = handler.request_deserializer
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        def uu(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            admit(method, context)
            return unary_unary(_decode(deserialize, _single(requests, context), context), context)

        return grpc.stream_unary_rpc_method_handler(uu, None, serialize)
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream
        if getattr(unary_stream, "experimental_non_blocking", False):
            # health Watch: gRPC hands it a send callback and holds no thread while it
            # waits; the wrapper keeps that (the body comes first: the token was checked).
            def watch(data: bytes, context: grpc.ServicerContext, send: Any = None) -> Any:
                admit(method, context)
                return unary_stream(_decode(deserialize, data, context), context, send)

            watch.experimental_non_blocking = True  # type: ignore[attr-defined]
            watch.experimental_thread_pool = getattr(  # type: ignore[attr-defined]
                unary_stream, "experimental_thread_pool", None
            )
            return grpc.unary_stream_rpc_method_handler(watch, None, serialize)

        def us(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            admit(method, context)
            return unary_stream(_decode(deserialize, _single(requests, context), context), context)

        return grpc.stream_stream_rpc_method_handler(us, None, serialize)

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
