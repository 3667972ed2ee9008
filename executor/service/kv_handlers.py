"""The KV data plane's three RPC handlers, as the servicer runs them: each in a telemetry
scope, holding a handler place (`max_forward_calls`) as a Forward does, errors mapped by
`status.abort`. The work is `KVService`'s (`kv_service.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from executor.observability.telemetry import Telemetry
from executor.service.admission import CapacityError
from executor.service.kv_service import KVService
from executor.service.status import abort
from model_executor.v1 import executor_pb2 as pb


class KVHandlers:
    """Mixed into `ExecutorServicer`, which provides the attributes and the call-place hooks."""

    telemetry: Telemetry
    kv: KVService
    _enter: Callable[[str], None]  # take a handler place (CapacityError beyond the limit)
    _leave: Callable[[], None]

    def ExportKV(
        self, request: pb.KvExportRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KvExportResponse]:
        with self.telemetry.rpc("ExportKV", context) as rpc:
            try:
                self._enter("ExportKV")  # a KV call holds a handler thread like a Forward
            except CapacityError as exc:
                abort(context, exc, rpc)
            try:
                yield from self.kv.export(request, context.is_active)
            except GeneratorExit:  # the caller stopped reading: nothing to answer
                raise
            except BaseException as exc:
                abort(context, exc, rpc)
            finally:
                self._leave()

    def ImportKV(
        self, request_iterator: Iterator[pb.KvImportRequest], context: grpc.ServicerContext
    ) -> pb.KvImportResponse:
        with self.telemetry.rpc("ImportKV", context) as rpc:
            try:
                self._enter("ImportKV")
                try:
                    return self.kv.import_(request_iterator, context.is_active)
                finally:
                    self._leave()
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises

    def PushKV(self, request: pb.KvPushRequest, context: grpc.ServicerContext) -> pb.KvPushResponse:
        with self.telemetry.rpc("PushKV", context) as rpc:
            try:
                self._enter("PushKV")
                try:
                    return self.kv.push(request)
                finally:
                    self._leave()
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
