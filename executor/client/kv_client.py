"""The scheduler's side of the KV data plane: export, import and push through one executor's stub.

`ExecutorClient.kv` returns a `KVClient`. Slots are plain lists (coalesced into runs here);
an export comes back whole (`ExportedKV`: header and chunks) so that it can be imported
elsewhere unchanged, and a push answers one `TransferResult` per transfer (vLLM's
finished_sending / finished_recving: completed or failed, with the status and why).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from executor.kv_transfer.layout import coalesce
from executor.service.codec import tensor_from_proto
from executor.service.kv_codec import runs_to_proto
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc

# A PushKV call that ended so may not have run (or only some of it); a transfer that ended so
# may or may not have been applied on the peer: both are safe to push again under their ids.
_RETRY_CALL = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})
_RETRY_TRANSFER = frozenset({"DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE"})
_ids = itertools.count(secrets.randbits(62) + 1)  # transfer ids: unique across clients
_ids_lock = threading.Lock()


def next_transfer_id() -> int:
    with _ids_lock:
        return next(_ids)


def slot_runs(slots: Sequence[int]) -> pb.KvRuns:
    """Slots in order -> their coalesced runs on the wire."""
    return runs_to_proto(coalesce(np.asarray(slots, dtype=np.int64)))


@dataclass
class ExportedKV:
    """An ExportKV answer: the header and every chunk, as they came."""

    header: pb.KvTransferHeader
    chunks: list[pb.KvChunk] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return tensor_from_proto(self.header.token_ids, "token_ids").tolist()

    @property
    def nbytes(self) -> int:
        return sum(len(c.data) for c in self.chunks)


@dataclass(frozen=True)
class TransferResult:
    """One push's outcome: `ok`, or the gRPC status name and message it failed with."""

    transfer_id: int
    ok: bool
    code: str
    message: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True)
class PushSpec:
    """Source slots on the pushing executor into a peer's free row and slots."""

    source_slots: Sequence[int]
    target: str
    target_row: int
    target_slots: Sequence[int]
    transfer_id: int = 0  # 0: a fresh id
    timeout_s: float = 0.0  # 0: the server's default (60 s)


class KVClient:
    """`metadata`: sent on every call (`authorization: Bearer <kv token>`)."""

    def __init__(
        self, stub: pb_grpc.ModelExecutorStub, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.stub = stub
        self.metadata = list(metadata)

    def export(self, slots: Sequence[int], *, timeout: float | None = 60.0) -> ExportedKV:
        request = pb.KvExportRequest(slots=slot_runs(slots), transfer_id=next_transfer_id())
        responses = iter(self.stub.ExportKV(request, timeout=timeout, metadata=self.metadata))
        first = next(responses)
        out = ExportedKV(first.header)
        out.chunks.extend(r.chunk for r in responses)
        return out

    def import_(
        self,
        exported: ExportedKV,
        row: int,
        slots: Sequence[int],
        *,
        transfer_id: int = 0,
        timeout: float | None = 60.0,
    ) -> pb.KvImportResponse:
        """Write `exported` into `row` at `slots` (positions 0..n-1); raises grpc.RpcError."""
        header = pb.KvImportHeader(
            transfer_id=transfer_id or next_transfer_id(),
            req_pool_index=row,
            slots=slot_runs(slots),
            token_ids=exported.header.token_ids,
            layout=exported.header.layout,
        )

        def requests() -> Iterator[pb.KvImportRequest]:
            yield pb.KvImportRequest(header=header)
            for chunk in exported.chunks:
                yield pb.KvImportRequest(chunk=chunk)

        response: pb.KvImportResponse = self.stub.ImportKV(
            requests(), timeout=timeout, metadata=self.metadata
        )
        return response

    def push(
        self,
        transfers: Sequence[PushSpec],
        *,
        timeout: float | None = None,
        attempts: int = 1,
        backoff_s: float = 0.05,
    ) -> list[TransferResult]:
        """The executor this client talks to pushes each transfer to its peer, in order; one
        result per transfer. With `attempts` > 1, a transfer that ended DEADLINE_EXCEEDED,
        CANCELLED or UNAVAILABLE (or a PushKV call that did) is pushed again under the same
        transfer_id: the peer answers one it already applied `replayed`, never twice."""
        pending = [
            pb.KvPushTransfer(
                transfer_id=t.transfer_id or next_transfer_id(),
                source_slots=slot_runs(t.source_slots),
                target=t.target,
                target_req_pool_index=t.target_row,
                target_slots=slot_runs(t.target_slots),
                timeout_s=t.timeout_s,
            )
            for t in transfers
        ]
        results: dict[int, TransferResult] = {}
        for attempt in range(attempts):
            try:
                answer = self.stub.PushKV(
                    pb.KvPushRequest(transfers=pending), timeout=timeout, metadata=self.metadata
                )
            except grpc.RpcError as exc:
                if attempt + 1 == attempts or exc.code() not in _RETRY_CALL:
                    raise
            else:
                for r in answer.results:
                    results[r.transfer_id] = TransferResult(
                        r.transfer_id, r.ok, r.code, r.message, r.bytes, r.seconds, r.replayed
                    )
                pending = [t for t in pending if results[t.transfer_id].code in _RETRY_TRANSFER]
                if not pending:
                    break
            if attempt + 1 < attempts:
                time.sleep(backoff_s * 2**attempt)
        return list(results.values())  # request order: the first answer's, updated in place
