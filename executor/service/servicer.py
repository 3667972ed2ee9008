"""The gRPC handlers: proto in, device worker, proto out. Errors map to status codes in one place.

| error                                  | status              |
|----------------------------------------|---------------------|
| BatchTooLargeError, QueueFullError, CapacityError | RESOURCE_EXHAUSTED |
| StreamIdleError, DeferredMaskTimeout   | DEADLINE_EXCEEDED   |
| BatchValidationError, RuntimeConfigError | INVALID_ARGUMENT  |
| UndecodableRequestError (bytes that are not a ForwardRequest) | INVALID_ARGUMENT, a warning line |
| ToggleRefusedError, KVStateError, ModelStateError, LoraStateError | FAILED_PRECONDITION |
| LoraAdapterError (an adapter that does not fit) | INVALID_ARGUMENT |
| LoraNotFoundError / LoraSlotsFullError | NOT_FOUND / RESOURCE_EXHAUSTED |
| KVChecksumError, WeightChunkError (a damaged chunk) | DATA_LOSS |
| UnauthenticatedError                   | UNAUTHENTICATED     |
| not ready / draining, WorkerClosedError | UNAVAILABLE        |
| RpcEndedError (deadline / cancelled)   | DEADLINE_EXCEEDED / CANCELLED (not run) |
| CancelledError (the job was dropped)   | CANCELLED (not run) |
| StreamFailedError                      | ABORTED             |
| anything else (a bug)                  | INTERNAL, logged with its stack trace |

A batch's status message starts with `batch_id N:`. On a stream, the first batch refused or
failed ends the stream with its status; the device worker runs nothing after it. A stream's
deferred vocab masks are routed by its reader as they are read (`deferred_masks.py`).

Whatever the error, a caller that stopped waiting (cancelled, went away, or its deadline
passed) ends the RPC as CANCELLED or DEADLINE_EXCEEDED with an info line: its doing, not a
failure of the executor (the error-ratio alert leaves both out).

Every handler runs inside `Telemetry.rpc` (server span, RPC latency, status-code count). The
KV data plane's handlers (ExportKV, ImportKV, PushKV) delegate to `kv_service.py`, the weight
and memory calls' to `weights_service.py`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import structlog

from executor.core.errors import FaultInjector
from executor.core.outputs import ForwardOutput
from executor.observability.telemetry import RpcScope, Telemetry
from executor.observability.tracing import SpanScope
from executor.service import lora_calls
from executor.service.access import AccessRules, Rule
from executor.service.admission import (
    BatchClaim,
    ByteBudget,
    CallLimit,
    CapacityError,
    StreamIdleError,
)
from executor.service.applied_batches import fingerprint
from executor.service.codec import (
    batch_from_proto,
    info_to_proto,
    response_to_proto,
    runtime_config_to_proto,
    runtime_update_from_proto,
)
from executor.service.deferred_masks import (
    MaskBudgets,
    StreamMasks,
    mask_never_came,
    refuse_on_unary,
    stream_over,
)
from executor.service.device_worker import DeviceWorker
from executor.service.handlers import UndecodableRequest
from executor.service.jobs import Job, StreamState
from executor.service.kv_handlers import KVHandlers
from executor.service.kv_service import KVService
from executor.service.runtime_config import RuntimeControl
from executor.service.status import NotServingError, abort
from executor.service.weights_codec import limits_to_proto
from executor.service.weights_handlers import WeightsHandlers
from executor.service.weights_service import WeightsService
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)


@dataclass
class _StreamStep:
    job: Job
    span: SpanScope  # the batch's `step` span under the stream's


class ExecutorServicer(KVHandlers, WeightsHandlers, pb_grpc.ModelExecutorServicer):
    def __init__(
        self,
        model_spec: str,
        stream_window: int,
        telemetry: Telemetry,
        access: AccessRules | None = None,
        *,
        call_limit: CallLimit | None = None,
        byte_budget: ByteBudget | None = None,
        queue_wait_s: float = 0.0,
        stream_idle_timeout_s: float = 0.0,
        deferred_mask_budget_s: float = 0.0,
        kv_calls: CallLimit | None = None,
        kv_call_timeout_s: float = 120.0,
        kv_chunk_timeout_s: float = 10.0,
        weight_update_timeout_s: float = 600.0,
    ) -> None:
        self.model_spec = model_spec
        self.stream_window = stream_window
        self.call_limit = call_limit
        self.byte_budget = byte_budget or ByteBudget(0)
        self.queue_wait_s = queue_wait_s
        self.stream_idle_timeout_s = stream_idle_timeout_s
        # Each caller's device time for waiting on deferred masks, shared by all its streams.
        self._mask_budgets = MaskBudgets(
            deferred_mask_budget_s, telemetry.metrics.observe_deferred_mask_wait
        )
        self.kv_calls = kv_calls or CallLimit(2, "KV data-plane calls", "max_kv_calls")
        self.kv_call_timeout_s = kv_call_timeout_s
        self.kv_chunk_timeout_s = kv_chunk_timeout_s
        self.telemetry = telemetry
        # The caller's identity (its rows; GetInfo's config); who may call is the interceptor's.
        self.access = access or AccessRules(Rule("call"), Rule("kv"), Rule("operator"))
        self.worker: DeviceWorker | None = None
        self.runtime: RuntimeControl | None = None
        self.draining = threading.Event()
        # Tests only (executor/errors.py): make encoding a chosen answer raise.
        self.faults: FaultInjector | None = None
        # The KV data plane (start_server sets its TLS, peers, limits and tenants).
        self.kv = KVService(self._accepting, byte_budget=self.byte_budget)
        # Weights and memory (start_server sets their settings and metrics).
        self.weights = WeightsService(self._accepting)
        self.weight_update_timeout_s = weight_update_timeout_s

    def attach(self, worker: DeviceWorker, runtime: RuntimeControl) -> None:
        """The model is loaded and warmed up: start taking batches."""
        self.runtime = runtime
        self.worker = worker

    def _accepting(self) -> DeviceWorker:
        if self.draining.is_set():
            raise NotServingError(
                "the executor is draining for shutdown; send new batches elsewhere"
            )
        if self.worker is None:
            raise NotServingError("the executor is still loading its model; wait for readiness")
        return self.worker

    def _loaded(self) -> tuple[DeviceWorker, RuntimeControl]:
        if self.worker is None or self.runtime is None:
            raise NotServingError("the executor is still loading its model; wait for readiness")
        return self.worker, self.runtime

    def _submit(
        self,
        request: pb.ForwardRequest | UndecodableRequest,
        span: SpanScope,
        context: grpc.ServicerContext,
        stream: StreamState | None = None,
        *,
        caller: str = "",
        masks: StreamMasks | None = None,
    ) -> Job:
        """Decode and queue one batch. The device thread runs it only while `context` is
        active and before its deadline, and (on a stream) only if no batch before it failed.
        `caller`: the identity its rows are recorded under; `masks`: its stream's."""
        if isinstance(request, UndecodableRequest):
            raise request.error
        if stream is None:
            refuse_on_unary(request)
        worker = self._accepting()
        # A CPU's background compile and load yield from the batch's arrival to its end.
        claim = BatchClaim(
            self.byte_budget, request.ByteSize, request.batch_id, worker.executor.runner
        )
        try:
            with span.child("decode"):
                batch = batch_from_proto(
                    request.batch, worker.executor.limits, batch_id=request.batch_id
                )
            if masks is not None and batch.deferred_mask is not None:
                batch.deferred_mask.budget = masks.budget  # before the device can reach it
            remaining = context.time_remaining()
            job = worker.submit(
                batch,
                request.batch_id,
                trace_context=span.context,
                stream=stream,
                is_active=context.is_active,
                deadline=None if remaining is None else time.monotonic() + remaining,
                # A retry is answered from memory only to the caller that sent the batch.
                fingerprint=fingerprint(request.batch) + caller.encode()
                if worker.applied.capacity
                else b"",
                caller=caller,
            )
        except BaseException:
            claim.end()
            raise
        if claim.holds:
            job.future.add_done_callback(claim.end)
        return job

    def Forward(
        self, request: pb.ForwardRequest | UndecodableRequest, context: grpc.ServicerContext
    ) -> pb.ForwardResponse:
        """`request` is an `UndecodableRequest` when its bytes did not parse (handlers.py)."""
        with self.telemetry.rpc("Forward", context) as rpc:
            batch_id = None if isinstance(request, UndecodableRequest) else request.batch_id
            try:
                self._enter("Forward")
                try:
                    job = self._submit(request, rpc, context, caller=self.access.identity(context))
                    # A client that goes away frees this thread: its job, not started, never runs.
                    context.add_callback(job.future.cancel)
                    out = self._wait(job)
                finally:
                    self._leave()
            except BaseException as exc:
                abort(context, exc, rpc, batch_id)
                raise  # unreachable: abort raises
            assert batch_id is not None  # a job ran, so the request decoded
            if job.replayed:
                self.telemetry.metrics.count_replay()
            else:
                rpc.record_step(out.stats, batch_id)
            try:
                return self._encode(out, batch_id, rpc)
            except BaseException as exc:
                abort(context, exc, rpc, batch_id)
                raise  # unreachable: abort raises

    def ForwardStream(
        self,
        request_iterator: Iterator[pb.ForwardRequest | UndecodableRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[pb.ForwardResponse]:
        """Responses in request order; up to `stream_window` batches queued or running at once."""
        with self.telemetry.rpc("ForwardStream", context) as rpc:
            try:
                self._enter("ForwardStream")
            except CapacityError as exc:
                abort(context, exc, rpc)
            try:
                yield from self._stream(request_iterator, context, rpc)
            finally:
                self._leave()

    def _enter(self, what: str) -> None:
        if self.call_limit is not None:
            self.call_limit.enter(what)

    def _leave(self) -> None:
        if self.call_limit is not None:
            self.call_limit.leave()

    def _wait(self, job: Job) -> ForwardOutput:
        """The job's output; a job still queued after `queue_wait_s` is dropped (never run)
        and answered RESOURCE_EXHAUSTED: the device is behind."""
        if not self.queue_wait_s:
            return job.future.result()
        try:
            return job.future.result(timeout=self.queue_wait_s)
        except TimeoutError:
            if job.future.cancel():
                raise CapacityError(
                    f"batch_id {job.batch_id} waited {self.queue_wait_s:g} s for the device "
                    "(queue_wait_s) and was not applied: the device is behind; retry later"
                ) from None
            return job.future.result()  # it is running: its answer is coming

    def _stream(
        self,
        request_iterator: Iterator[pb.ForwardRequest | UndecodableRequest],
        context: grpc.ServicerContext,
        rpc: RpcScope,
    ) -> Iterator[pb.ForwardResponse]:
        # The reader's hand-off to this thread: a SimpleQueue (C, no Python Condition).
        pending: queue.SimpleQueue[_StreamStep | tuple[int, BaseException] | None] = (
            queue.SimpleQueue()
        )
        window = threading.Semaphore(self.stream_window)
        failed = threading.Event()
        state = StreamState()  # the device thread runs nothing after a failed batch
        # Jobs submitted, not yet answered (at most the window; a stream may live for ever).
        in_flight: deque[Job] = deque()
        caller = self.access.identity(context)
        # Batches waiting for their deferred vocab mask, and the caller's wait budget.
        masks = StreamMasks(self._mask_budgets.get(caller))

        def cancel_pending() -> None:
            failed.set()
            for job in list(in_flight):
                job.future.cancel()  # only jobs that have not started; running ones finish
            masks.fail_waiting(stream_over)  # a device thread waiting for a mask stops now
            window.release()  # unblock the reader if it waits for room
            if not context.is_active():
                # The RPC is over (cancelled, or its deadline passed): count the caller's
                # leaving now, and wake the handler if it waits for the reader so its thread
                # is freed, even if the reader has not yet seen its request stream end.
                rpc.end_if_caller_gone()
                pending.put(None)

        def read() -> None:
            refused: BaseException | None = None  # the request that stopped the reading
            try:
                for request in request_iterator:
                    if isinstance(request, UndecodableRequest):
                        raise request.error
                    if request.HasField("deferred_mask"):
                        try:  # at read time: the device thread may be blocked waiting for it
                            masks.deliver(request, self._accepting().executor.limits)
                        except BaseException as exc:
                            refused = exc
                            pending.put((request.deferred_mask.batch_id, exc))
                            return
                        continue
                    window.acquire()
                    if failed.is_set():
                        return
                    step = rpc.step(request.batch_id)
                    try:
                        job = self._submit(
                            request, step, context, state, caller=caller, masks=masks
                        )
                    except BaseException as exc:
                        step.span.end()
                        refused = exc
                        pending.put((request.batch_id, exc))
                        return
                    in_flight.append(job)
                    masks.expect(job)
                    pending.put(_StreamStep(job, step))
            except BaseException as exc:  # reading the next request failed
                refused = exc
                pending.put((0, exc))
            finally:  # no mask comes after the last request read
                masks.fail_waiting(mask_never_came(failed.is_set(), refused))
                pending.put(None)

        context.add_callback(cancel_pending)  # the client went away or the RPC ended
        threading.Thread(target=read, name="stream-reader", daemon=True).start()
        idle = self.stream_idle_timeout_s or None
        while True:
            try:  # the idle clock runs only while nothing is in flight
                item = pending.get(timeout=None if in_flight else idle)
            except queue.Empty:
                cancel_pending()
                abort(
                    context,
                    StreamIdleError(
                        f"the stream sent no batch for {idle:g} s (stream_idle_timeout_s) and "
                        "was closed to free its handler thread; open a new one"
                    ),
                    rpc,
                )
                return
            if item is None:
                return
            if isinstance(item, tuple):
                cancel_pending()
                batch_id, exc = item
                abort(context, exc, rpc, batch_id or None)
                return
            step, batch_id, job = item.span, item.job.batch_id, item.job
            try:
                out = item.job.future.result()
            except BaseException as exc:
                cancel_pending()
                step.span.end()
                abort(context, exc, rpc, batch_id, step)
                return
            in_flight.popleft()  # answered in order: it is the oldest
            window.release()
            if job.replayed:
                self.telemetry.metrics.count_replay()
            else:
                step.record_step(out.stats, batch_id)
            try:
                response = self._encode(out, batch_id, step)
            except BaseException as exc:
                cancel_pending()
                step.span.end()
                abort(context, exc, rpc, batch_id, step)
                return
            step.span.end()
            yield response

    def _encode(self, out: ForwardOutput, batch_id: int, span: SpanScope) -> pb.ForwardResponse:
        with span.child("encode"):
            if self.faults is not None:
                self.faults.check("encoder")
            return response_to_proto(out, batch_id)

    def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetInfoResponse:
        with self.telemetry.rpc("GetInfo", context) as rpc:
            try:
                worker, runtime = self._loaded()
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
            # The runtime config only to a caller that could read it with GetRuntimeConfig.
            config = runtime.current() if self.access.may_operate(context) else None
            msg = info_to_proto(worker.executor.info, self.model_spec, config)
            limits = self.weights.limits(worker.executor.weights)
            msg.weight_update_limits.CopyFrom(limits_to_proto(limits))
            return msg

    def GetRuntimeConfig(
        self, request: pb.GetRuntimeConfigRequest, context: grpc.ServicerContext
    ) -> pb.RuntimeConfig:
        with self.telemetry.rpc("GetRuntimeConfig", context) as rpc:
            try:  # the operator rule was checked before (executor.service.access)
                _, runtime = self._loaded()
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
            return runtime_config_to_proto(runtime.current())

    def UpdateRuntimeConfig(
        self, request: pb.UpdateRuntimeConfigRequest, context: grpc.ServicerContext
    ) -> pb.RuntimeConfig:
        """Checked here (token, values), then applied on the device thread between batches."""
        with self.telemetry.rpc("UpdateRuntimeConfig", context) as rpc:
            try:  # the operator rule was checked before (executor.service.access)
                update = runtime_update_from_proto(request.config)
                worker = self._accepting()
                _, runtime = self._loaded()
                config = worker.run_on_device(lambda: runtime.update(update)).result()
            except BaseException as exc:
                abort(context, exc, rpc)
                raise  # unreachable: abort raises
            return runtime_config_to_proto(config)

    def LoadLora(
        self, request: pb.LoadLoraRequest, context: grpc.ServicerContext
    ) -> pb.LoadLoraResponse:
        return lora_calls.load_lora(self, request, context)

    def UnloadLora(
        self, request: pb.UnloadLoraRequest, context: grpc.ServicerContext
    ) -> pb.UnloadLoraResponse:
        return lora_calls.unload_lora(self, request, context)
