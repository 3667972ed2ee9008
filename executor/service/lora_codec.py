"""LoRA on the wire: a batch's `RowAdapter` entries, `LoraAdapter`, and GetInfo's LoRA fields.

Size claims (entry count, name bytes) are refused from the header before anything is built,
like the batch's own; whether a name is loaded is the LoRA feature's rule, on the device
thread (`executor.lora.rows`).
"""

from __future__ import annotations

from typing import Any

from executor.core.errors import BatchTooLargeError
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
from executor.core.lora_types import MAX_NAME_BYTES, LoadedAdapter, LoraInfo, RowAdapter
from executor.validation import check_request_count
from model_executor.v1 import executor_pb2 as pb


def check_lora_claims(msg: Any, limits: BatchLimits) -> None:
    """At most one entry per request of a batch, names within MAX_NAME_BYTES
    (BatchTooLargeError). `msg` is a `pb.ForwardBatch`."""
    check_request_count("row_adapters", len(msg.row_adapters), limits)
    for i, entry in enumerate(msg.row_adapters):
        n = len(entry.adapter.encode())
        if n > MAX_NAME_BYTES:
            raise BatchTooLargeError(
                f"row_adapters[{i}].adapter",
                f"has {n} bytes; must be <= max_lora_name_bytes ({MAX_NAME_BYTES})",
            )


def adapters_from_proto(msg: Any) -> tuple[RowAdapter, ...]:
    return tuple(RowAdapter(e.req_pool_index, e.adapter) for e in msg.row_adapters)


def add_adapters_to_proto(fb: ForwardBatch, msg: Any) -> None:
    for entry in fb.row_adapters:
        msg.row_adapters.add(req_pool_index=entry.row, adapter=entry.name)


def adapter_to_proto(a: LoadedAdapter) -> pb.LoraAdapter:
    return pb.LoraAdapter(
        name=a.name,
        path=a.path,
        slot=a.slot,
        rank=a.rank,
        target_modules=list(a.target_modules),
        load_seconds=a.load_seconds,
    )


def adapter_from_proto(msg: pb.LoraAdapter) -> LoadedAdapter:
    return LoadedAdapter(
        name=msg.name,
        path=msg.path,
        slot=msg.slot,
        rank=msg.rank,
        target_modules=tuple(msg.target_modules),
        load_seconds=msg.load_seconds,
    )


def add_lora_info_to_proto(info: LoraInfo, msg: pb.GetInfoResponse) -> None:
    msg.loras.extend(adapter_to_proto(a) for a in info.adapters)
    msg.max_loras = info.max_loras
    msg.max_lora_rank = info.max_lora_rank
    msg.max_lora_name_bytes = info.max_name_bytes
    msg.lora_target_modules.extend(info.target_modules)


def lora_info_from_proto(msg: pb.GetInfoResponse) -> LoraInfo:
    return LoraInfo(
        adapters=tuple(adapter_from_proto(a) for a in msg.loras),
        max_loras=msg.max_loras,
        max_lora_rank=msg.max_lora_rank,
        target_modules=tuple(msg.lora_target_modules),
        max_name_bytes=msg.max_lora_name_bytes or MAX_NAME_BYTES,
    )
