"""The gRPC handlers: proto in, device worker, proto out. Errors map to status codes in one place.

| error                                  | status              |
|----------------------------------------|---------------------|
| BatchTooLargeError, QueueFullError     | RESOURCE_EXHAUSTED  |
| BatchValidationError                   | INVALID_ARGUMENT    |
| not ready / draining                   | UNAVAILABLE         |
| anything else (a bug)                  | INTERNAL, logged with its stack trace |
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator

import grpc
import structlog

from executor.codec import batch_from_proto, info_to_proto, response_to_proto
from executor.device_worker import DeviceWorker, Job, QueueFullError
from executor.errors import BatchTooLargeError, BatchValidationError
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)


class NotServingError(RuntimeError):
    """The executor is still loading, or is draining before shutdown."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, BatchTooLargeError | QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, BatchValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotServingError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def abort(context: grpc.ServicerContext, exc: BaseException, batch_id: int | None = None) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("batch failed", batch_id=batch_id, code=code.name, exc_info=exc)
    else:
        log.info("batch refused", batch_id=batch_id, code=code.name, reason=message)
    context.abort(code, message)


class ExecutorServicer(pb_grpc.ModelExecutorServicer):
    def __init__(self, model_spec: str, stream_window: int) -> None:
        self.model_spec = model_spec
        self.stream_window = stream_window
        self.worker: DeviceWorker | None = None
        self.draining = threading.Event()

    def attach(self, worker: DeviceWorker) -> None:
        """The model is loaded and warmed up: start taking batches."""
        self.worker = worker

    def _accepting(self) -> DeviceWorker:
        if self.draining.is_set():
            raise NotServingError(
                "the executor is draining for shutdown; send new batches elsewhere"
            )
        if self.worker is None:
            raise NotServingError("the executor is still loading its model; wait for readiness")
        return self.worker

    def _submit(self, request: pb.ForwardRequest) -> Job:
        worker = self._accepting()
        return worker.submit(batch_from_proto(request.batch), request.batch_id)

    def Forward(
        self, request: pb.ForwardRequest, context: grpc.ServicerContext
    ) -> pb.ForwardResponse:
        try:
            out = self._submit(request).future.result()
        except BaseException as exc:
            abort(context, exc, request.batch_id)
            raise  # unreachable: abort raises
        return response_to_proto(out, request.batch_id)

    def ForwardStream(
        self, request_iterator: Iterator[pb.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ForwardResponse]:
        """Responses in request order; up to `stream_window` batches queued or running at once."""
        pending: queue.Queue[Job | BaseException | None] = queue.Queue()
        window = threading.Semaphore(self.stream_window)
        failed = threading.Event()
        # Jobs submitted but not yet answered (at most the window); a stream may live for
        # millions of steps, so answered jobs must not be kept.
        in_flight: deque[Job] = deque()

        def cancel_pending() -> None:
            failed.set()
            for job in list(in_flight):
                job.future.cancel()  # only jobs that have not started; running ones finish
            window.release()  # unblock the reader if it waits for room

        def read() -> None:
            try:
                for request in request_iterator:
                    window.acquire()
                    if failed.is_set():
                        return
                    job = self._submit(request)
                    in_flight.append(job)
                    pending.put(job)
            except BaseException as exc:
                pending.put(exc)
            finally:
                pending.put(None)

        context.add_callback(cancel_pending)  # the client went away or the RPC ended
        threading.Thread(target=read, name="stream-reader", daemon=True).start()
        while True:
            item = pending.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                cancel_pending()
                abort(context, item)
                return
            try:
                out = item.future.result()
            except BaseException as exc:
                cancel_pending()
                abort(context, exc, item.batch_id)
                return
            in_flight.popleft()  # answered in order: it is the oldest
            window.release()
            yield response_to_proto(out, item.batch_id)

    def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetInfoResponse:
        if self.worker is None:
            abort(
                context,
                NotServingError("the executor is still loading its model; wait for readiness"),
            )
        assert self.worker is not None
        return info_to_proto(self.worker.executor.info, self.model_spec)
