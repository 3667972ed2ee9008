"""Weight updates and memory calls on the wire: headers, chunks, limits, answers.

Both sides use it: the server decodes headers (`specs_from_proto`, refusing from the header
alone) and encodes answers; the client encodes tensors as chunks (`chunk_tensor`, one CRC-32
each) and decodes answers. A tensor travels as its raw little-endian bytes in its own dtype.
"""

from __future__ import annotations

import ctypes
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from executor.core.errors import BatchValidationError
from executor.weights.catalog import MAX_NAME_BYTES, MAX_VERSION_BYTES, TensorSpec
from executor.weights.control import SwapResult
from executor.weights.memory import MemoryReport
from model_executor.v1 import executor_pb2 as pb

CHUNK_BYTES = 4 << 20  # under every gRPC message limit (the KV plane's chunk size)
_TO_TORCH = {pb.FLOAT32: torch.float32, pb.BFLOAT16: torch.bfloat16, pb.FLOAT16: torch.float16}
_TO_PB = {v: k for k, v in _TO_TORCH.items()}
_MAX_RANK = 4


@dataclass(frozen=True)
class WeightLimits:
    """What one update may carry here (GetInfo.weight_update_limits)."""

    max_update_bytes: int
    max_tensors: int
    path_updates: bool
    group_updates: bool
    chunk_bytes: int = CHUNK_BYTES


def checksum(data: bytes | memoryview) -> int:
    """A chunk's checksum: CRC-32 (zlib) of its data bytes."""
    return zlib.crc32(data) & 0xFFFFFFFF


def spec_from_proto(msg: pb.WeightTensorSpec, field: str) -> TensorSpec:
    """One header tensor; INVALID_ARGUMENT for a dtype or shape no weight can have."""
    if msg.dtype not in _TO_TORCH:
        raise BatchValidationError(
            f"{field}.dtype", f"{msg.name[:MAX_NAME_BYTES]}: must be FLOAT32, BFLOAT16 or FLOAT16"
        )
    shape = tuple(int(d) for d in msg.shape)
    if not 1 <= len(shape) <= _MAX_RANK or any(d < 1 for d in shape):
        raise BatchValidationError(
            f"{field}.shape", f"{msg.name[:MAX_NAME_BYTES]}: 1..{_MAX_RANK} positive dimensions"
        )
    return TensorSpec(msg.name, _TO_TORCH[msg.dtype], shape)


def specs_from_proto(tensors: list[pb.WeightTensorSpec], max_tensors: int) -> list[TensorSpec]:
    if len(tensors) > max_tensors:  # before decoding any of them
        from executor.core.errors import BatchTooLargeError

        raise BatchTooLargeError(
            "tensors",
            f"{len(tensors)} tensors, more than weight_update_limits.max_tensors ({max_tensors})",
        )
    return [spec_from_proto(t, f"tensors[{i}]") for i, t in enumerate(tensors)]


def spec_to_proto(spec: TensorSpec) -> pb.WeightTensorSpec:
    return pb.WeightTensorSpec(name=spec.name, dtype=_TO_PB[spec.dtype], shape=list(spec.shape))


def tensor_spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    if tensor.dtype not in _TO_PB:
        raise ValueError(
            f"{name}: weights travel as float32, bfloat16 or float16, not {tensor.dtype}"
        )
    return TensorSpec(name, tensor.dtype, tuple(tensor.shape))


def tensor_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A tensor's bytes, little-endian, row-major, without a copy when it is a contiguous
    host tensor already: (the tensor the view reads, keep it alive while reading; the view).
    The view is made from the data pointer, not through numpy, which would pin the caller's
    storage (a trainer that frees or resizes its tensors afterwards could not)."""
    t = tensor.detach().to("cpu").contiguous()
    if sys.byteorder != "little":  # pragma: no cover - the wire is little-endian
        t = t.view(torch.uint8).reshape(*t.shape, -1).flip(-1).contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t, memoryview(b"")
    return t, memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def chunk_tensor(index: int, tensor: torch.Tensor, chunk_bytes: int) -> Iterator[pb.WeightChunk]:
    """One tensor's chunks, in order."""
    _owner, data = tensor_bytes(tensor)  # the view reads _owner: keep it alive
    for offset in range(0, len(data), chunk_bytes):
        part = data[offset : offset + chunk_bytes]
        yield pb.WeightChunk(tensor=index, offset=offset, data=part.tobytes(), crc32=checksum(part))


def limits_to_proto(limits: WeightLimits) -> pb.WeightUpdateLimits:
    return pb.WeightUpdateLimits(
        max_update_bytes=limits.max_update_bytes,
        chunk_bytes=limits.chunk_bytes,
        max_tensors=limits.max_tensors,
        max_name_bytes=MAX_NAME_BYTES,
        max_version_bytes=MAX_VERSION_BYTES,
        path_updates=limits.path_updates,
        group_updates=limits.group_updates,
    )


def swap_to_proto(result: SwapResult) -> pb.WeightUpdateResponse:
    return pb.WeightUpdateResponse(
        weight_version=result.version,
        num_tensors=result.num_tensors,
        bytes=result.nbytes,
        stage_seconds=result.stage_seconds,
        swap_seconds=result.swap_seconds,
    )


def swap_from_proto(msg: pb.WeightUpdateResponse) -> SwapResult:
    return SwapResult(
        msg.weight_version, msg.num_tensors, msg.bytes, msg.stage_seconds, msg.swap_seconds
    )


def memory_to_proto(report: MemoryReport) -> pb.MemoryState:
    return pb.MemoryState(
        released=list(report.released),
        kv_epoch=report.kv_epoch,
        weights_await_update=report.awaiting_update,
        bytes=report.nbytes,
        seconds=report.seconds,
    )


def memory_from_proto(msg: pb.MemoryState) -> MemoryReport:
    return MemoryReport(
        tuple(msg.released), msg.kv_epoch, msg.weights_await_update, msg.bytes, msg.seconds
    )
