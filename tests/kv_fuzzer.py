"""The structured fuzzer's KV-plane messages and its extreme integers (tests/fuzzer.py uses both).

`extreme_int` sets one integer anywhere in a message (a scalar field, a repeated one such as a
tensor's shape, or one element of an integer tensor) to an edge of its type: int64's -2**63
and 2**63-1, int32's, uint64's 2**64-1, and the values just past the executor's caps.

`KVFuzz` sends ExportKV, header-only ImportKV (and a few with chunks) and PushKV messages
built from live slots and then mutated with such values. Pushes go only to a listed peer where
nothing listens, so no KV message may change the executor's state, whatever it answers.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message

from executor.core.limits import BatchLimits
from model_executor.v1 import executor_pb2 as pb

EXPORT = "/model_executor.v1.ModelExecutor/ExportKV"
IMPORT = "/model_executor.v1.ModelExecutor/ImportKV"
PUSH = "/model_executor.v1.ModelExecutor/PushKV"
KV_ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.DATA_LOSS,
    }
)
_I32 = (2**31 - 1, -(2**31), -1, 0)
_I64 = (2**63 - 1, -(2**63), 2**62, 2**62 + 1, -(2**62), -1)
_U32 = (2**32 - 1, 2**31, 0)
_U64 = (2**64 - 1, 2**63, 0)
EXTREMES = {
    F.TYPE_INT32: _I32, F.TYPE_SINT32: _I32, F.TYPE_SFIXED32: _I32, F.TYPE_ENUM: _I32,
    F.TYPE_INT64: _I64, F.TYPE_SINT64: _I64, F.TYPE_SFIXED64: _I64,
    F.TYPE_UINT32: _U32, F.TYPE_FIXED32: _U32, F.TYPE_UINT64: _U64, F.TYPE_FIXED64: _U64,
}  # fmt: skip
_TENSOR_INTS = {pb.INT32: ("<i4", _I32), pb.INT64: ("<i8", _I64)}


def _messages(msg: Message) -> list[Message]:
    """`msg` and every message it holds, depth first."""
    out = [msg]
    for field in msg.DESCRIPTOR.fields:
        if field.type != F.TYPE_MESSAGE:
            continue
        if field.is_repeated:
            for item in getattr(msg, field.name):
                if isinstance(item, Message):
                    out += _messages(item)
        elif msg.HasField(field.name):
            out += _messages(getattr(msg, field.name))
    return out


def _integers(msg: Message) -> list[tuple[Message, F, int | None]]:
    """Every integer of `msg` and the messages it holds: (message, field, index or None)."""
    found: list[tuple[Message, F, int | None]] = []
    for holder in _messages(msg):
        for field in holder.DESCRIPTOR.fields:
            if field.type not in EXTREMES:
                continue
            if field.is_repeated:
                found += [(holder, field, i) for i in range(len(getattr(holder, field.name)))]
            else:
                found.append((holder, field, None))
    return found


def _int_tensors(msg: Message) -> list[pb.Tensor]:
    return [
        m for m in _messages(msg) if isinstance(m, pb.Tensor) and m.dtype in _TENSOR_INTS and m.data
    ]


def extreme_int(msg: Message, rng: random.Random) -> None:
    """Set one integer of `msg` (a field, or an element of an integer tensor) to an extreme."""
    tensors = _int_tensors(msg)
    if tensors and rng.random() < 0.5:
        t = rng.choice(tensors)
        dtype, values = _TENSOR_INTS[t.dtype]
        data = np.frombuffer(t.data, dtype=dtype).copy()
        if data.size:
            data[rng.randrange(data.size)] = rng.choice(values)
            t.data = data.tobytes()
            return
    fields = _integers(msg)
    if not fields:
        return
    holder, field, index = rng.choice(fields)
    value = rng.choice(EXTREMES[field.type])
    if index is None:
        setattr(holder, field.name, value)
    else:
        getattr(holder, field.name)[index] = value


def _runs(runs: list[tuple[int, int]]) -> pb.KvRuns:
    data = np.asarray(runs, dtype="<i8").reshape(-1, 2)
    return pb.KvRuns(runs=pb.Tensor(dtype=pb.INT64, shape=list(data.shape), data=data.tobytes()))


class KVFuzz:
    """KV-plane messages against one server. `live`: slots live rows hold now (the Forward
    fuzzer's generator knows them); `dead_peer`: a kv_peers entry where nothing listens."""

    def __init__(
        self, channel: grpc.Channel, limits: BatchLimits, dead_peer: str, rng: random.Random
    ) -> None:
        self.limits = limits
        self.dead_peer = dead_peer
        self.rng = rng
        ident: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
        self.export = channel.unary_stream(EXPORT, request_serializer=ident)
        self.import_ = channel.stream_unary(IMPORT, request_serializer=ident)
        self.push = channel.unary_unary(PUSH, request_serializer=ident)
        self.layout: pb.KvLayout | None = None

    def _some_runs(self, live: list[int]) -> list[tuple[int, int]]:
        rng, kv = self.rng, self.limits.kv_slots
        if live and rng.random() < 0.6:
            start = rng.choice(live)
            return [(start, rng.randint(1, 4))]
        edges = [0, -1, 1, kv, kv + 1, 2**31 - 1, 2**62, 2**62 + 1, 2**63 - 1, -(2**63)]
        return [(rng.choice(edges), rng.choice(edges)) for _ in range(rng.randint(1, 4))]

    def message(self, live: list[int]) -> tuple[str, Callable[[], None]]:
        """One KV call (its kind and a thunk that makes it; the thunk raises grpc.RpcError)."""
        rng = self.rng
        kind = rng.choice(["export", "import", "import_chunks", "push"])
        if kind == "export":
            req = pb.KvExportRequest(
                slots=_runs(self._some_runs(live)), transfer_id=rng.randrange(1, 2**63)
            )
            self._mutate(req)
            data = req.SerializeToString()
            return kind, lambda: [None for _ in self.export(data, timeout=30)]  # type: ignore[func-returns-value]
        if kind == "push":
            n = rng.randint(1, 3)
            target = self.dead_peer if rng.random() < 0.7 else rng.choice(
                ["unix:/tmp/x", "127.0.0.1:1", "dns:///example.invalid:50051", "a" * 300]
            )  # fmt: skip
            t = pb.KvPushTransfer(
                transfer_id=rng.randrange(1, 2**63), source_slots=_runs(self._some_runs(live)),
                target=target, target_req_pool_index=rng.randint(1, self.limits.max_reqs),
                target_slots=_runs([(1, n)] if rng.random() < 0.5 else self._some_runs([])),
                timeout_s=rng.choice([0.0, 0.5, 1e9, float("nan"), float("inf"), -1.0]),
            )  # fmt: skip
            req = pb.KvPushRequest(transfers=[t])
            self._mutate(req)
            data = req.SerializeToString()
            return kind, lambda: self.push(data, timeout=30)
        header = pb.KvImportHeader(
            transfer_id=rng.randrange(1, 2**63), req_pool_index=rng.randint(1, self.limits.max_reqs),
            slots=_runs(self._some_runs(live)), layout=self.layout,
        )  # fmt: skip
        n = max(1, min(8, int(np.frombuffer(header.slots.runs.data, "<i8")[1::2].clip(0, 8).sum())))
        ids = np.array([rng.choice([5, -1, -2, self.limits.vocab_size, 2**62]) for _ in range(n)])
        header.token_ids.CopyFrom(
            pb.Tensor(dtype=pb.INT64, shape=[n], data=ids.astype("<i8").tobytes())
        )
        messages = [pb.KvImportRequest(header=header)]
        if kind == "import_chunks":
            data = bytes(rng.randrange(256) for _ in range(rng.choice([0, 4, 64])))
            chunk = pb.KvChunk(
                rank=0, layer=0, kind=pb.KV_KIND_K, first=0, count=1, data=data,
                crc32=zlib.crc32(data) & 0xFFFFFFFF,
            )  # fmt: skip
            messages += [pb.KvImportRequest(chunk=chunk) for _ in range(rng.randint(1, 3))]
        for m in messages:
            self._mutate(m)
        raw = [m.SerializeToString() for m in messages]
        return kind, lambda: self.import_(iter(raw), timeout=30)

    def _mutate(self, msg: Message) -> None:
        for _ in range(self.rng.randint(0, 2)):
            extreme_int(msg, self.rng)
