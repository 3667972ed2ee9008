"""Weight updates and memory calls on the wire: headers, chunks, limits, answers.

Both sides use it: the server decodes headers (`specs_from_proto`, refusing from the header
alone) and encodes answers; the client encodes tensors as chunks (`chunk_tensor`, one CRC-32
each: `ops.checksum`) and decodes answers. A tensor travels as its raw little-endian bytes in
its own dtype.
"""

from __future__ import annotations

import ctypes
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from executor.core.errors import BatchValidationError
from executor.weights.catalog import MAX_NAME_BYTES, MAX_VERSION_BYTES, TensorSpec
from executor.weights.control import SwapResult
from executor.weights.memory import MemoryReport
from model_executor.v1 import executor_pb2 as pb
from ops.checksum import checksum

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
    max_group_timeout_s: float = 600.0
    chunk_bytes: int = CHUNK_BYTES


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


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_chunk(index: int, offset: int, data: memoryview) -> bytes:
    """A serialized WeightUpdateRequest holding one WeightChunk, made by hand so that the data
    is copied once (protobuf's message objects copy it three times on the way to the wire)."""
    head = b"\x08" + _varint(index) + b"\x10" + _varint(offset) + b"\x1a" + _varint(len(data))
    tail = b"\x20" + _varint(checksum(data))
    return b"".join((b"\x12", _varint(len(head) + len(data) + len(tail)), head, data, tail))


_ENCODE_THREADS = 4  # chunks encoded at once (the CRC-32 releases the GIL)
_ENCODE_AHEAD = 8  # chunks encoded ahead of the one being sent


def _encode_owned(owner: torch.Tensor, index: int, offset: int, data: memoryview) -> bytes:
    """`encode_chunk` holding `owner`, whose memory `data` views, until it is done."""
    return encode_chunk(index, offset, data)


def chunk_requests(tensors: list[torch.Tensor], chunk_bytes: int) -> Iterator[bytes]:
    """Every tensor's chunks, serialized (`encode_chunk`), in order: tensor by tensor, each
    from offset 0. A few threads encode ahead of the one gRPC is sending."""

    def pieces() -> Iterator[tuple[int, int, torch.Tensor, memoryview]]:
        for i, tensor in enumerate(tensors):
            owner, data = tensor_bytes(tensor)  # the view reads owner: kept with each piece
            for offset in range(0, len(data), chunk_bytes):
                yield i, offset, owner, data[offset : offset + chunk_bytes]

    pending: deque[Future[bytes]] = deque()
    with ThreadPoolExecutor(_ENCODE_THREADS, thread_name_prefix="weights-encode") as pool:
        for i, offset, owner, data in pieces():
            pending.append(pool.submit(_encode_owned, owner, i, offset, data))
            if len(pending) > _ENCODE_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@dataclass(frozen=True)
class RawChunk:
    """A WeightChunk read in place from its request's bytes (`data` views them: no copy)."""

    tensor: int
    offset: int
    data: memoryview
    crc32: int


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def decode_chunk(data: bytes) -> RawChunk | None:
    """A serialized WeightUpdateRequest that is one chunk, read without copying its data;
    None when it is something else (a header) or not laid out as a chunk alone. ValueError
    or IndexError for bytes that do not parse."""
    buf = memoryview(data)
    if len(buf) < 2 or buf[0] != 0x12:
        return None
    length, i = _read_varint(buf, 1)
    if i + length != len(buf):
        return None  # more than the chunk (unknown fields): protobuf reads it
    fields = {1: 0, 2: 0, 4: 0}
    payload = buf[0:0]
    while i < len(buf):
        tag, i = _read_varint(buf, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
            fields[number] = value
        elif wire == 2:
            size, i = _read_varint(buf, i)
            if i + size > len(buf):
                raise ValueError("a field runs past the message")
            if number == 3:
                payload = buf[i : i + size]
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} in a chunk")
    return RawChunk(fields[1], fields[2], payload, fields[4])


def limits_to_proto(limits: WeightLimits) -> pb.WeightUpdateLimits:
    return pb.WeightUpdateLimits(
        max_update_bytes=limits.max_update_bytes,
        chunk_bytes=limits.chunk_bytes,
        max_tensors=limits.max_tensors,
        max_name_bytes=MAX_NAME_BYTES,
        max_version_bytes=MAX_VERSION_BYTES,
        path_updates=limits.path_updates,
        group_updates=limits.group_updates,
        max_group_timeout_s=limits.max_group_timeout_s,
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
