"""The KV data plane's three RPC handlers, as the servicer runs them: each in a telemetry
scope, holding one of the `max_kv_calls` places (apart from Forward's) and a server-side
deadline (`kv_calls.py`), errors mapped by `status.abort`. The work is `KVService`'s
(`kv_service.py`); who may call was checked before (`access.py`: the KV rule)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from executor.observability.telemetry import RpcScope, Telemetry
from executor.service.access import OWNER_KEY, AccessRules
from executor.service.admission import CallLimit, CapacityError
from executor.service.jobs import RpcEndedError
from executor.service.kv_calls import KVDeadline
from executor.service.kv_service import KVService
from executor.service.status import abort
from model_executor.v1 import executor_pb2 as pb


class KVHandlers:
    """Mixed into `ExecutorServicer`, which provides the attributes."""

    telemetry: Telemetry
    kv: KVService
    access: AccessRules
    kv_calls: CallLimit
    kv_call_timeout_s: float
    kv_chunk_timeout_s: float

    def _kv_caller(self, context: grpc.ServicerContext) -> str:
        return self.access.identity(context, self.access.kv)

    def _kv_failed(
        self, context: grpc.ServicerContext, exc: BaseException, rpc: RpcScope, deadline: KVDeadline
    ) -> None:
        if deadline.expired:  # cancelled by its server-side deadline: say so in the log
            exc = RpcEndedError(f"the KV call was cancelled: {deadline.expired}", deadline=True)
        abort(context, exc, rpc)

    def ExportKV(
        self, request: pb.KvExportRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KvExportResponse]:
        with self.telemetry.rpc("ExportKV", context) as rpc:
            try:
                self.kv_calls.enter("ExportKV")
            except CapacityError as exc:
                abort(context, exc, rpc)
            deadline = KVDeadline(context.cancel, self.kv_call_timeout_s)
            try:
                yield from self.kv.export(request, context.is_active, self._kv_caller(context))
            except GeneratorExit:  # the caller stopped reading: nothing to answer
                raise
            except BaseException as exc:
                self._kv_failed(context, exc, rpc, deadline)
            finally:
                deadline.close()
                self.kv_calls.leave()

    def ImportKV(
        self, request_iterator: Iterator[pb.KvImportRequest], context: grpc.ServicerContext
    ) -> pb.KvImportResponse:
        with self.telemetry.rpc("ImportKV", context) as rpc:
            try:
                self.kv_calls.enter("ImportKV")
            except CapacityError as exc:
                abort(context, exc, rpc)
            deadline = KVDeadline(context.cancel, self.kv_call_timeout_s, self.kv_chunk_timeout_s)
            try:
                # A pushing executor names the row's owner (its own caller); any other
                # caller owns what it imports.
                owner = dict(context.invocation_metadata() or ()).get(OWNER_KEY)
                owner = owner if isinstance(owner, str) else self._kv_caller(context)
                return self.kv.import_(
                    deadline.touching(request_iterator), context.is_active, owner
                )
            except BaseException as exc:
                self._kv_failed(context, exc, rpc, deadline)
                raise  # unreachable: abort raises
            finally:
                deadline.close()
                self.kv_calls.leave()

    def PushKV(self, request: pb.KvPushRequest, context: grpc.ServicerContext) -> pb.KvPushResponse:
        with self.telemetry.rpc("PushKV", context) as rpc:
            try:
                self.kv_calls.enter("PushKV")
            except CapacityError as exc:
                abort(context, exc, rpc)
            deadline = KVDeadline(context.cancel, self.kv_call_timeout_s)
            try:
                return self.kv.push(request, self._kv_caller(context), deadline)
            except BaseException as exc:
                self._kv_failed(context, exc, rpc, deadline)
                raise  # unreachable: abort raises
            finally:
                deadline.close()
                self.kv_calls.leave()
