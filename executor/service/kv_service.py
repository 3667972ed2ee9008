"""The KV data plane's handlers: ExportKV, ImportKV and PushKV (executor to executor).

Every read of and write into the cache runs as a device job (`DeviceWorker.run_on_device`),
between two steps: an export reads one chunk per job (memory bounded by chunk_bytes), an
import stages every chunk on the host, verifies it, and writes it in one job. A push is an
export whose chunks go straight into the peer's ImportKV, only to a peer `kv_peers` names,
over a channel built from this server's own TLS files (`kv_peers.PeerChannels`), with this
server's KV token and the row's owner as metadata. Refusals map through `status.py`; a push
reports each transfer's outcome in its answer instead of failing the call.

When callers differ in identity (`tenancy.RowTenants`), an export or push sends only slots
the caller's requests wrote, and an import writes only into rows and slots no other caller
holds. Refusals name fields and positions, never another request's slots or tokens.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import numpy as np
import structlog
import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.kv_transfer.engine import ImportResult, KVTransfer
from executor.kv_transfer.layout import (
    ChunkSpec,
    check_run_bounds,
    check_runs,
    expand_runs,
    plan_chunks,
)
from executor.kv_transfer.staging import Chunk, ImportHeader, ImportStaging
from executor.observability.log_limit import RateLimitedLog
from executor.service.access import OWNER_KEY
from executor.service.admission import ByteBudget
from executor.service.auth import TokenFile
from executor.service.codec import tensor_to_proto
from executor.service.device_worker import DeviceWorker
from executor.service.info_codec import layout_to_proto
from executor.service.jobs import RpcEndedError
from executor.service.kv_calls import KVDeadline
from executor.service.kv_codec import (
    chunk_from_proto,
    chunk_to_proto,
    import_header_from_proto,
    runs_from_proto,
)
from executor.service.kv_peers import PeerChannels, PeerList
from executor.service.status import status_for
from executor.service.tenancy import RowTenants
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from ops.checksum import checksum

log = structlog.get_logger(__name__)

READ_AHEAD = 2  # chunk reads queued ahead of the one being sent
DEFAULT_PUSH_TIMEOUT_S = 60.0
PUSH_MARGIN_S = 0.25  # a transfer ends this long before its call's deadline, to answer
PEER_SLOTS = 2**31 - 1  # a push's target slots: the peer checks them against its own cache


@dataclass
class _PushProgress:
    """What a push's request stream did, seen from the thread that waits for the answer."""

    sent: int = 0  # data bytes handed to gRPC
    failure: BaseException | None = None  # why reading the source failed (gRPC only cancels)


def _not_observed(direction: str, nbytes: int, seconds: float, ok: bool) -> None:
    return None


@dataclass
class KVTransferObserver:
    """What the handlers report: `on_transfer(direction, nbytes, seconds, ok)` when a transfer
    ends (the server's metrics; nothing when none is given)."""

    on_transfer: Callable[[str, int, float, bool], None] = _not_observed


class KVService:
    def __init__(
        self,
        worker: Callable[[], DeviceWorker],
        *,
        observer: KVTransferObserver | None = None,
        byte_budget: ByteBudget | None = None,
    ) -> None:
        """`worker`: the device worker now (raises NotServingError while loading or draining).
        `byte_budget`: what an import's staging takes its bytes from (batch_budget_mib)."""
        self._worker = worker
        self.observer = observer or KVTransferObserver()
        self.byte_budget = byte_budget or ByteBudget(0)
        self.channels = PeerChannels(PeerList.parse(""))  # start_server: kv_peers, TLS
        self.token: TokenFile | None = None  # this server's KV token, sent with its pushes
        self.log = RateLimitedLog()  # start_server: the server's refusal log

    # --- ExportKV ---------------------------------------------------------------------------
    def export(
        self, request: pb.KvExportRequest, is_active: Callable[[], bool], caller: str = ""
    ) -> Iterator[pb.KvExportResponse]:
        worker = self._worker()
        kvt: KVTransfer = worker.executor.kv_transfer
        runs = runs_from_proto(request.slots, "slots", kvt.limits)
        check_runs(runs, "slots.runs", kvt.layout, kvt.limits)
        slots = expand_runs(runs)
        t0 = time.perf_counter()
        nbytes, ok = 0, False
        tenants = worker.tenants
        try:
            tokens = worker.run_on_device(
                lambda: _check_and_tokens(kvt, slots, tenants, caller)
            ).result()
            specs = plan_chunks(int(slots.size), kvt.layout, kvt.limits.chunk_bytes)
            yield pb.KvExportResponse(
                header=pb.KvTransferHeader(
                    transfer_id=request.transfer_id,
                    layout=layout_to_proto(kvt.layout, kvt.limits),
                    num_slots=int(slots.size),
                    token_ids=tensor_to_proto(torch.from_numpy(tokens)),
                    num_chunks=len(specs) * kvt.layout.tp_size,
                )
            )
            for chunk in _read_chunks(worker, kvt, slots):
                if not is_active():
                    return
                nbytes += len(chunk.data)
                yield pb.KvExportResponse(chunk=chunk)
            ok = True
        finally:
            self.observer.on_transfer("export", nbytes, time.perf_counter() - t0, ok)

    # --- ImportKV ---------------------------------------------------------------------------
    def import_(
        self,
        requests: Iterator[pb.KvImportRequest],
        is_active: Callable[[], bool],
        owner: str = "",
    ) -> pb.KvImportResponse:
        """`is_active`: the RPC's liveness; an import whose caller left before the device
        reached it is not applied (RpcEndedError), as for a batch. `owner`: the identity the
        row is recorded under."""
        worker = self._worker()
        kvt: KVTransfer = worker.executor.kv_transfer
        t0 = time.perf_counter()
        nbytes, ok = 0, False
        tenants = worker.tenants
        try:
            it = iter(requests)
            header, slots = self._header(kvt, it, worker)
            # The cache's state first (row and slots free, the id new): a refused import or a
            # retry is answered before its bytes are read.
            result: ImportResult | None = worker.run_on_device(
                functools.partial(_precheck, kvt, header, slots, tenants, owner)
            ).result()
            if result is None:
                size = int(slots.size) * kvt.layout.bytes_per_slot * kvt.layout.tp_size
                what = f"ImportKV transfer_id {header.transfer_id}"
                self.byte_budget.take(size, 0, what)  # before the staging is allocated
                try:
                    staging = self._stage(kvt, header, slots, it)
                    result = worker.run_on_device(
                        functools.partial(_apply_if_active, kvt, staging, is_active, tenants, owner)
                    ).result()
                finally:
                    self.byte_budget.give(size)
                nbytes = 0 if result.replayed else staging.nbytes
            ok = True
            return pb.KvImportResponse(
                transfer_id=result.transfer_id,
                num_slots=result.num_slots,
                bytes=result.nbytes,
                replayed=result.replayed,
            )
        finally:
            self.observer.on_transfer("import", nbytes, time.perf_counter() - t0, ok)

    @staticmethod
    def _header(
        kvt: KVTransfer, it: Iterator[pb.KvImportRequest], worker: DeviceWorker
    ) -> tuple[ImportHeader, np.ndarray]:
        first = next(it, None)
        if first is None or first.WhichOneof("item") != "header":
            raise BatchValidationError("header", "the first ImportKV message must be the header")
        header = import_header_from_proto(first.header, kvt.limits)
        limits = worker.executor.limits
        slots = header.check(
            kvt.layout, kvt.limits, limits.max_reqs, limits.max_context_len, limits.vocab_size
        )
        return header, slots

    @staticmethod
    def _stage(
        kvt: KVTransfer, header: ImportHeader, slots: np.ndarray, it: Iterator[pb.KvImportRequest]
    ) -> ImportStaging:
        staging = ImportStaging(header, slots, kvt.layout, kvt.limits)
        expected = staging.expected_chunks
        for msg in it:
            if msg.WhichOneof("item") != "chunk":
                raise BatchValidationError("header", "only the first ImportKV message is a header")
            if staging.chunks >= expected:
                raise BatchTooLargeError("chunk", f"the transfer has {expected} chunks; more came")
            staging.add(chunk_from_proto(msg.chunk))
        staging.check_complete()
        return staging

    # --- PushKV -----------------------------------------------------------------------------
    def push(
        self, request: pb.KvPushRequest, caller: str = "", deadline: KVDeadline | None = None
    ) -> pb.KvPushResponse:
        """`deadline`: the call's; every transfer's timeout fits in what is left of it."""
        worker = self._worker()
        kvt: KVTransfer = worker.executor.kv_transfer
        cap = kvt.limits.max_push_transfers
        if len(request.transfers) > cap:
            raise BatchTooLargeError(
                "transfers",
                f"has {len(request.transfers)} entries; must be <= max_push_transfers ({cap})",
            )
        planned = [self._plan_push(kvt, i, t) for i, t in enumerate(request.transfers)]
        return pb.KvPushResponse(
            results=[
                self._push_one(worker, kvt, t, target, slots, caller, deadline)
                for t, target, slots in planned
            ]
        )

    def _plan_push(
        self, kvt: KVTransfer, i: int, t: pb.KvPushTransfer
    ) -> tuple[pb.KvPushTransfer, str, np.ndarray]:
        """Refuse a malformed transfer, or one to a peer kv_peers does not name, before any
        is run or dialed (the whole call: INVALID_ARGUMENT, PERMISSION_DENIED)."""
        field = f"transfers[{i}]"
        if t.transfer_id == 0:
            raise BatchValidationError(
                f"{field}.transfer_id", "must be nonzero (the peer's exactly-once key)"
            )
        if not t.target:
            raise BatchValidationError(f"{field}.target", "must name the peer executor (host:port)")
        if not (t.timeout_s >= 0 and math.isfinite(t.timeout_s)):
            raise BatchValidationError(
                f"{field}.timeout_s", f"must be a finite number >= 0, got {t.timeout_s}"
            )
        runs = runs_from_proto(t.source_slots, f"{field}.source_slots", kvt.limits)
        check_runs(runs, f"{field}.source_slots.runs", kvt.layout, kvt.limits)
        target = runs_from_proto(t.target_slots, f"{field}.target_slots", kvt.limits)
        n_target = check_run_bounds(target, f"{field}.target_slots.runs", kvt.limits, PEER_SLOTS)
        slots = expand_runs(runs)
        if n_target != slots.size:
            raise BatchValidationError(
                f"{field}.target_slots", f"names {n_target} slots; source_slots names {slots.size}"
            )
        return t, self.channels.peers.admit(t.target, f"{field}.target"), slots

    def _push_one(
        self,
        worker: DeviceWorker,
        kvt: KVTransfer,
        t: pb.KvPushTransfer,
        target: str,
        slots: np.ndarray,
        caller: str,
        deadline: KVDeadline | None,
    ) -> pb.KvTransferResult:
        t0 = time.perf_counter()
        progress = _PushProgress()
        timeout = t.timeout_s or DEFAULT_PUSH_TIMEOUT_S
        if deadline is not None:  # ends before the call's own deadline cancels the call
            timeout = max(0.0, min(timeout, deadline.remaining() - PUSH_MARGIN_S))
        tenants = worker.tenants
        try:
            tokens = worker.run_on_device(
                lambda: _check_and_tokens(kvt, slots, tenants, caller)
            ).result()
            stub = pb_grpc.ModelExecutorStub(self.channels.channel(target))
            answer = stub.ImportKV(
                self._push_messages(worker, kvt, t, slots, tokens, progress),
                timeout=timeout,
                metadata=self._push_metadata(caller),
            )
        except grpc.RpcError as exc:
            if progress.failure is not None:  # reading here failed: gRPC only saw it cancel
                code, message = status_for(progress.failure)
                return self._failed(t, code.name, f"reading the source slots: {message}", t0)
            rpc_code = exc.code()
            message = f"peer {target}: {exc.details()}"
            return self._failed(t, rpc_code.name if rpc_code else "UNKNOWN", message, t0)
        except BaseException as exc:  # refused here (source slots) or failed reading them
            code, message = status_for(exc)
            return self._failed(t, code.name, message, t0)
        seconds = time.perf_counter() - t0
        self.observer.on_transfer("push", progress.sent, seconds, True)
        return pb.KvTransferResult(
            transfer_id=t.transfer_id,
            ok=True,
            code="OK",
            bytes=answer.bytes,
            seconds=seconds,
            replayed=answer.replayed,
        )

    def _push_metadata(self, caller: str) -> list[tuple[str, str]]:
        """This server's KV token (the peer's kv_token_file must hold it) and the row's owner
        (the caller of the push: the peer records the imported row under it)."""
        metadata = []
        if self.token is not None:
            metadata.append(("authorization", f"Bearer {self.token.first().decode()}"))
        if caller:
            metadata.append((OWNER_KEY, caller))
        return metadata

    def _failed(
        self, t: pb.KvPushTransfer, code: str, message: str, t0: float
    ) -> pb.KvTransferResult:
        seconds = time.perf_counter() - t0
        self.log.info(
            f"kv_push:{code}", "kv push failed", transfer_id=t.transfer_id,
            target=t.target[:80], code=code, reason=message[:200],
        )  # fmt: skip
        self.observer.on_transfer("push", 0, seconds, False)
        return pb.KvTransferResult(
            transfer_id=t.transfer_id, ok=False, code=code, message=message, seconds=seconds
        )

    @staticmethod
    def _push_messages(
        worker: DeviceWorker,
        kvt: KVTransfer,
        t: pb.KvPushTransfer,
        slots: np.ndarray,
        tokens: np.ndarray,
        progress: _PushProgress,
    ) -> Iterator[pb.KvImportRequest]:
        yield pb.KvImportRequest(
            header=pb.KvImportHeader(
                transfer_id=t.transfer_id,
                req_pool_index=t.target_req_pool_index,
                slots=t.target_slots,
                token_ids=tensor_to_proto(torch.from_numpy(tokens)),
                layout=layout_to_proto(kvt.layout, kvt.limits),
            )
        )
        try:
            for chunk in _read_chunks(worker, kvt, slots):
                progress.sent += len(chunk.data)
                yield pb.KvImportRequest(chunk=chunk)
        except GeneratorExit:  # gRPC stopped asking (the peer answered or the call ended)
            raise
        except BaseException as exc:
            progress.failure = exc
            raise

    def close(self) -> None:
        self.channels.close()


def _read_chunks(worker: DeviceWorker, kvt: KVTransfer, slots: np.ndarray) -> Iterator[pb.KvChunk]:
    """The transfer's chunks in stream order, each read by one device job (between steps).
    READ_AHEAD reads are queued ahead of the one being sent, so reading overlaps sending while
    at most READ_AHEAD + 1 chunks are held."""
    specs = iter(plan_chunks(int(slots.size), kvt.layout, kvt.limits.chunk_bytes))
    reads: deque[tuple[ChunkSpec, Future[list[bytes]]]] = deque()

    def read_next() -> None:
        spec = next(specs, None)
        if spec is not None:
            reads.append(
                (spec, worker.run_on_device(functools.partial(kvt.read_chunk, slots, spec)))
            )

    for _ in range(READ_AHEAD + 1):
        read_next()
    while reads:
        spec, future = reads.popleft()
        ranks = future.result()
        read_next()
        for rank, data in enumerate(ranks):
            chunk = Chunk(spec.layer, spec.kind, spec.first, spec.count, data, checksum(data), rank)
            yield chunk_to_proto(chunk)


def _precheck(
    kvt: KVTransfer,
    header: ImportHeader,
    slots: np.ndarray,
    tenants: RowTenants | None,
    owner: str,
) -> ImportResult | None:
    """Device thread: refuse a row or slots another caller holds, then the cache's state."""
    if tenants is not None:
        tenants.check_import(header.row, slots, owner)
    return kvt.precheck_import(header, slots)


def _apply_if_active(
    kvt: KVTransfer,
    staging: ImportStaging,
    is_active: Callable[[], bool],
    tenants: RowTenants | None = None,
    owner: str = "",
) -> ImportResult:
    """Device thread: apply the import unless its RPC ended while it waited for the device;
    the row and slots are then `owner`'s."""
    if not is_active():
        raise RpcEndedError(
            f"transfer_id {staging.header.transfer_id} was not applied: its RPC ended (cancelled "
            "or past its deadline) before the device reached it",
            deadline=False,
        )
    if tenants is not None:
        tenants.check_import(staging.header.row, staging.slots, owner)
    result = kvt.apply_import(staging)
    if tenants is not None and not result.replayed:
        tenants.record_import(staging.header.row, staging.slots, owner)
    return result


def _check_and_tokens(
    kvt: KVTransfer, slots: np.ndarray, tenants: RowTenants | None = None, caller: str = ""
) -> np.ndarray:
    """Device thread: refuse slots the caller's requests did not write (first: a slot of
    another caller reads as no slot of its own, live or not), slots no live row holds, then
    read their tokens."""
    if tenants is not None:
        tenants.check_slots(slots, caller, "runs")
    kvt.check_export(slots)
    return kvt.read_tokens(slots)
