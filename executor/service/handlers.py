"""Registering the ModelExecutor service with a `ForwardRequest` decoder that never raises.

gRPC's generated registration decodes requests before the handler runs; bytes that do not
parse end there as `INTERNAL: Exception deserializing request!` with a stack trace in the log,
counted nowhere. Those bytes are the caller's fault, so `Forward` and `ForwardStream` receive
them as an `UndecodableRequest` instead, and the servicer answers INVALID_ARGUMENT naming
`model_executor.v1.ForwardRequest`, logs a warning without a stack trace and counts it under
`model_executor_requests_total{code="INVALID_ARGUMENT"}` like any other refusal.

UpdateWeights' chunks are read in place (their data is not copied again), and its bytes that
do not parse are answered INVALID_ARGUMENT the same way. Every other method keeps the generated
decoder: the service is registered from its
descriptor, so a method added to the .proto is registered here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from executor.service.weights_codec import RawChunk, decode_chunk
from model_executor.v1 import executor_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["ModelExecutor"]
FORWARD_REQUEST = pb.ForwardRequest.DESCRIPTOR.full_name
WEIGHT_UPDATE_REQUEST = pb.WeightUpdateRequest.DESCRIPTOR.full_name


class UndecodableRequestError(ValueError):
    """The request bytes are not a `ForwardRequest` (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class UndecodableRequest:
    """What `Forward`/`ForwardStream` receive in place of bytes that do not parse."""

    error: UndecodableRequestError


def decode_forward_request(data: bytes) -> pb.ForwardRequest | UndecodableRequest:
    try:
        return pb.ForwardRequest.FromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        return UndecodableRequest(
            UndecodableRequestError(
                f"the request payload ({len(data)} bytes) is not a valid {FORWARD_REQUEST}: {exc}"
            )
        )


_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def decode_weight_update_request(
    data: bytes,
) -> pb.WeightUpdateRequest | RawChunk | UndecodableRequest:
    """UpdateWeights' requests: a chunk read in place (`weights_codec.decode_chunk`: its data is
    not copied), anything else by protobuf; bytes that do not parse as an
    `UndecodableRequest`."""
    try:
        chunk = decode_chunk(data)
        return chunk if chunk is not None else pb.WeightUpdateRequest.FromString(data)
    except (DecodeError, RuntimeError, ValueError, IndexError) as exc:
        return UndecodableRequest(
            UndecodableRequestError(
                f"the request payload ({len(data)} bytes) is not a valid "
                f"{pb.WeightUpdateRequest.DESCRIPTOR.full_name}: {exc}"
            )
        )


def add_executor_servicer(servicer: Any, server: grpc.Server) -> None:
    """`pb_grpc.add_ModelExecutorServicer_to_server`, with the lenient ForwardRequest decoder."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        decode = {
            FORWARD_REQUEST: decode_forward_request,
            WEIGHT_UPDATE_REQUEST: decode_weight_update_request,
        }.get(method.input_type.full_name, request_cls.FromString)
        factory = _FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=decode,
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
