"""The weight and memory RPCs as the servicer runs them: each in a telemetry scope, errors
mapped by `status.abort`; the work is `WeightsService`'s (`weights_service.py`); who may call
was checked before (`access.py`: operator calls). A stream's staging is bounded by
`weight_update_timeout_s` (then it is cancelled and nothing changes)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from executor.observability.telemetry import Telemetry
from executor.service.kv_calls import KVDeadline
from executor.service.status import abort
from executor.service.weights_codec import memory_to_proto, swap_to_proto
from executor.service.weights_service import WeightsService
from model_executor.v1 import executor_pb2 as pb


class WeightsHandlers:
    """Mixed into `ExecutorServicer`, which provides the attributes."""

    telemetry: Telemetry
    weights: WeightsService
    weight_update_timeout_s: float

    def _deadline(self, context: grpc.ServicerContext) -> KVDeadline:
        return KVDeadline(
            context.cancel, self.weight_update_timeout_s, total_setting="weight_update_timeout_s"
        )

    def UpdateWeights(
        self, request_iterator: Iterator[pb.WeightUpdateRequest], context: grpc.ServicerContext
    ) -> pb.WeightUpdateResponse:
        with self.telemetry.rpc("UpdateWeights", context) as rpc:
            deadline = self._deadline(context)
            try:
                return swap_to_proto(self.weights.update_stream(iter(request_iterator)))
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
            finally:
                deadline.close()

    def UpdateWeightsFromPath(
        self, request: pb.UpdateWeightsFromPathRequest, context: grpc.ServicerContext
    ) -> pb.WeightUpdateResponse:
        with self.telemetry.rpc("UpdateWeightsFromPath", context) as rpc:
            try:
                return swap_to_proto(self.weights.update_path(request))
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises

    def InitWeightsGroup(
        self, request: pb.InitWeightsGroupRequest, context: grpc.ServicerContext
    ) -> pb.InitWeightsGroupResponse:
        with self.telemetry.rpc("InitWeightsGroup", context) as rpc:
            try:
                spec = self.weights.init_group(request)
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
            return pb.InitWeightsGroupResponse(
                rank=spec.rank, world_size=spec.world_size, backend=spec.backend
            )

    def UpdateWeightsFromGroup(
        self, request: pb.UpdateWeightsFromGroupRequest, context: grpc.ServicerContext
    ) -> pb.WeightUpdateResponse:
        with self.telemetry.rpc("UpdateWeightsFromGroup", context) as rpc:
            try:
                return swap_to_proto(self.weights.update_group(request))
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises

    def DestroyWeightsGroup(
        self, request: pb.DestroyWeightsGroupRequest, context: grpc.ServicerContext
    ) -> pb.DestroyWeightsGroupResponse:
        with self.telemetry.rpc("DestroyWeightsGroup", context) as rpc:
            try:
                self.weights.destroy_group()
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
            return pb.DestroyWeightsGroupResponse()

    def ReleaseMemory(
        self, request: pb.ReleaseMemoryRequest, context: grpc.ServicerContext
    ) -> pb.MemoryState:
        with self.telemetry.rpc("ReleaseMemory", context) as rpc:
            try:
                return memory_to_proto(self.weights.release(request))
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises

    def ResumeMemory(
        self, request: pb.ResumeMemoryRequest, context: grpc.ServicerContext
    ) -> pb.MemoryState:
        with self.telemetry.rpc("ResumeMemory", context) as rpc:
            try:
                return memory_to_proto(self.weights.resume(request))
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
