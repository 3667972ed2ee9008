"""The KV data plane's messages <-> its domain types (`executor.kv_transfer`), once.

Size claims are refused from the message before anything is decoded: a runs tensor claiming
more than max_transfer_runs rows, a token list longer than max_transfer_slots.
"""

from __future__ import annotations

import numpy as np
import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.kv_transfer.layout import KVTransferLimits
from executor.kv_transfer.staging import Chunk, ImportHeader
from executor.service.codec import tensor_from_proto, tensor_to_proto
from executor.service.info_codec import layout_from_proto
from model_executor.v1 import executor_pb2 as pb


def runs_to_proto(runs: np.ndarray) -> pb.KvRuns:
    return pb.KvRuns(
        runs=tensor_to_proto(torch.from_numpy(np.ascontiguousarray(runs, dtype=np.int64)))
    )


def runs_from_proto(msg: pb.KvRuns, field: str, limits: KVTransferLimits) -> np.ndarray:
    """int64 [runs, 2]; the shape claim is checked against max_transfer_runs first."""
    t = msg.runs
    if len(t.shape) != 2 or t.shape[1] != 2 or t.dtype != pb.INT64:
        raise BatchValidationError(
            f"{field}.runs", f"must be int64 [runs, 2] (start, length), got shape {list(t.shape)}"
        )
    if t.shape[0] > limits.max_runs:
        raise BatchTooLargeError(
            f"{field}.runs",
            f"claims {t.shape[0]} runs; must be <= max_transfer_runs ({limits.max_runs})",
        )
    return tensor_from_proto(t, f"{field}.runs").numpy().astype(np.int64)


def tokens_from_proto(msg: pb.Tensor, field: str, limits: KVTransferLimits) -> np.ndarray:
    if len(msg.shape) != 1 or msg.dtype != pb.INT64:
        raise BatchValidationError(field, f"must be int64 [n], got shape {list(msg.shape)}")
    if msg.shape[0] > limits.max_slots:
        raise BatchTooLargeError(
            field,
            f"claims {msg.shape[0]} entries; must be <= max_transfer_slots ({limits.max_slots})",
        )
    return tensor_from_proto(msg, field).numpy().astype(np.int64)


def import_header_from_proto(msg: pb.KvImportHeader, limits: KVTransferLimits) -> ImportHeader:
    if msg.transfer_id == 0:
        raise BatchValidationError("header.transfer_id", "must be nonzero (the exactly-once key)")
    if not msg.HasField("layout"):
        raise BatchValidationError("header.layout", "is required: the source's GetInfo.kv_layout")
    tokens = (
        tokens_from_proto(msg.token_ids, "header.token_ids", limits)
        if msg.HasField("token_ids")
        else None
    )
    return ImportHeader(
        transfer_id=msg.transfer_id,
        row=msg.req_pool_index,
        runs=runs_from_proto(msg.slots, "header.slots", limits),
        token_ids=tokens,
        source=layout_from_proto(msg.layout, "header.layout"),
    )


def chunk_to_proto(chunk: Chunk) -> pb.KvChunk:
    return pb.KvChunk(
        rank=chunk.rank,
        layer=chunk.layer,
        kind=chunk.kind,
        first=chunk.first,
        count=chunk.count,
        data=chunk.data,
        crc32=chunk.crc32,
    )


def chunk_from_proto(msg: pb.KvChunk) -> Chunk:
    return Chunk(
        layer=msg.layer,
        kind=int(msg.kind),
        first=msg.first,
        count=msg.count,
        data=msg.data,
        crc32=msg.crc32,
        rank=msg.rank,
    )
