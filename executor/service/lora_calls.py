"""The LoadLora / UnloadLora handlers (operator calls: `access.OPERATOR_METHODS`).

LoadLora reads and checks the adapter's files on the RPC thread, while batches keep running;
only the slot's write runs on the device thread, between two batches. UnloadLora runs whole
on the device thread (it checks the rows that use the adapter there). Either is refused with
nothing changed (`status.status_for` maps the LoRA errors).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from executor.service.lora_codec import adapter_to_proto
from executor.service.status import abort
from model_executor.v1 import executor_pb2 as pb

if TYPE_CHECKING:
    from executor.service.servicer import ExecutorServicer


def load_lora(
    servicer: ExecutorServicer, request: pb.LoadLoraRequest, context: grpc.ServicerContext
) -> pb.LoadLoraResponse:
    with servicer.telemetry.rpc("LoadLora", context) as rpc:
        try:  # the operator rule was checked before (executor.service.access)
            started = time.perf_counter()
            worker = servicer._accepting()
            lora = worker.executor.lora_adapters()
            adapter = lora.read(request.name, request.path)  # this thread: batches go on
            loaded = worker.run_on_device(
                lambda: lora.install(request.name, adapter, started)
            ).result()
        except BaseException as exc:
            abort(context, exc, rpc)
            raise  # unreachable: abort raises
        return pb.LoadLoraResponse(adapter=adapter_to_proto(loaded))


def unload_lora(
    servicer: ExecutorServicer, request: pb.UnloadLoraRequest, context: grpc.ServicerContext
) -> pb.UnloadLoraResponse:
    with servicer.telemetry.rpc("UnloadLora", context) as rpc:
        try:  # the operator rule was checked before (executor.service.access)
            worker = servicer._accepting()
            lora = worker.executor.lora_adapters()
            unloaded = worker.run_on_device(lambda: lora.unload(request.name)).result()
        except BaseException as exc:
            abort(context, exc, rpc)
            raise  # unreachable: abort raises
        return pb.UnloadLoraResponse(adapter=adapter_to_proto(unloaded))
