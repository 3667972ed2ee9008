"""A typed Python client for a remote executor: what a scheduler uses to drive it.

    with ExecutorClient("127.0.0.1:50051") as client:
        client.wait_ready(timeout=120)
        info = client.info()
        out = client.forward(batch)            # one step, unary
        for out in client.stream(batches): ... # many steps, pipelined over one stream
        client.update_runtime_config(RuntimeConfigUpdate(eager_input_no_copy=True))
        client.weights.update(model.named_parameters(), version="step-100")

Batches are the same `ForwardBatch` objects the in-process executor takes, and results the
same `ForwardOutput`s, so a scheduler runs unchanged in-process or remote. Tensors travel
as raw little-endian bytes (one `tobytes()` per field, no per-element loops).
"""

from __future__ import annotations

import functools
import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor.client.allocator import FutureSlotAllocator
from executor.client.kv_client import KVClient
from executor.client.scoring import TextScore, embed_tokens, score_tokens
from executor.client.weights_client import WeightsClient
from executor.core.controls_types import VocabMask
from executor.core.extras_types import Pooling
from executor.core.forward_batch import ForwardBatch
from executor.core.lora_types import LoadedAdapter
from executor.core.outputs import ForwardOutput
from executor.info import ExecutorInfo
from executor.service.codec import (
    batch_to_proto,
    info_from_proto,
    response_from_proto,
    runtime_config_from_proto,
    runtime_update_to_proto,
    tensor_to_proto,
)
from executor.service.lora_codec import adapter_from_proto
from executor.service.runtime_config import RuntimeConfig, RuntimeConfigUpdate
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc

# Codes after which the batch may or may not have been applied, or was not: safe to resend
# under the same batch_id (the executor's retry memory answers one it already applied).
RETRYABLE = frozenset(
    {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
READINESS_SERVICE = pb.DESCRIPTOR.services_by_name["ModelExecutor"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
# The channel's reconnect backoff, first and longest (gRPC's own: 1 s and 120 s): a client
# started beside its executor, or one that outlives an executor's restart, finds it listening
# within a tenth of a second, then within a few seconds at most.
RECONNECT_BACKOFF_MS = (100, 5000)


@dataclass(frozen=True)
class RemoteInfo:
    info: ExecutorInfo
    model_spec: str  # what the server's --model was: load the same tokenizer with it
    runtime_config: RuntimeConfig | None = None  # the runtime toggles when GetInfo answered


class ExecutorClient:
    """`token`: the server's bearer token (call_token_file, or the runtime-config secret, which
    passes both checks); sent on every call, health checks included. `kv_token`: the KV data
    plane's (kv_token_file), sent on KV calls in place of `token` (None: `token`).
    `credentials`: TLS for a server with tls_cert_file (`executor.service.tls.channel_credentials`);
    None = plaintext."""

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        kv_token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target = target
        self._auth = [("authorization", f"Bearer {token}")] if token else []
        self._kv_auth = [("authorization", f"Bearer {kv_token}")] if kv_token else self._auth
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ]
        self.channel = (
            grpc.insecure_channel(target, options=options)
            if credentials is None
            else grpc.secure_channel(target, credentials, options=options)
        )
        self.stub = pb_grpc.ModelExecutorStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        # Batch ids from a random 62-bit start: the executor remembers applied ids across all
        # its callers (exactly-once retries), so two clients must not count from the same place.
        self._ids = itertools.count(secrets.randbits(62) + 1)
        self._ids_lock = threading.Lock()

    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def health(self, service: str = READINESS_SERVICE, timeout: float = 5.0) -> str:
        """SERVING / NOT_SERVING / ... for `service` ("" is liveness)."""
        resp = self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self._auth
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def watch_health(
        self, service: str = READINESS_SERVICE, timeout: float | None = None
    ) -> Iterator[str]:
        """Each status of `service` as the server pushes it (health Watch): the first at once,
        then every change, until the stream ends (an RpcError) or `timeout` passes."""
        request = health_pb2.HealthCheckRequest(service=service)
        for resp in self.health_stub.Watch(request, timeout=timeout, metadata=self._auth):
            yield str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def wait_ready(self, timeout: float = 120.0, interval: float = 0.2) -> None:
        """Block until readiness reports SERVING (the model is loaded and warmed up): the
        server pushes the change (health Watch); one not listening yet is tried again every
        `interval`, at most, and the channel's reconnect backoff stays short
        (`RECONNECT_BACKOFF_MS`)."""
        deadline = time.monotonic() + timeout
        last: str | Exception = "no answer"
        request = health_pb2.HealthCheckRequest(service=READINESS_SERVICE)
        while (left := deadline - time.monotonic()) > 0:
            call = self.health_stub.Watch(request, timeout=left, metadata=self._auth)
            try:
                for resp in call:
                    last = str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
                    if last == "SERVING":
                        return
            except grpc.RpcError as exc:  # not listening, or gone; the deadline: the status
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    last = exc
            finally:
                call.cancel()
            time.sleep(max(0.0, min(interval, deadline - time.monotonic())))
        raise TimeoutError(f"{self.target} not ready after {timeout} s (last: {last})")

    def info(self, timeout: float | None = 30.0) -> RemoteInfo:
        msg = self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout, metadata=self._auth)
        info, spec = info_from_proto(msg)
        runtime = (
            runtime_config_from_proto(msg.runtime_config)
            if msg.HasField("runtime_config")
            else None
        )
        return RemoteInfo(info, spec, runtime)

    def get_runtime_config(self, timeout: float | None = 30.0) -> RuntimeConfig:
        """The server's runtime toggles now."""
        msg = self.stub.GetRuntimeConfig(
            pb.GetRuntimeConfigRequest(), timeout=timeout, metadata=self._auth
        )
        return runtime_config_from_proto(msg)

    def load_lora(self, name: str, path: str, timeout: float | None = 300.0) -> LoadedAdapter:
        """Load the PEFT adapter directory `path` (on the executor's filesystem) as `name`; an
        operator call (the runtime-config token). A refusal raises grpc.RpcError."""
        msg = self.stub.LoadLora(
            pb.LoadLoraRequest(name=name, path=path), timeout=timeout, metadata=self._auth
        )
        return adapter_from_proto(msg.adapter)

    def unload_lora(self, name: str, timeout: float | None = 60.0) -> LoadedAdapter:
        """Unload adapter `name` (refused while live rows use it); an operator call."""
        msg = self.stub.UnloadLora(
            pb.UnloadLoraRequest(name=name), timeout=timeout, metadata=self._auth
        )
        return adapter_from_proto(msg.adapter)

    def update_runtime_config(
        self, update: RuntimeConfigUpdate, timeout: float | None = 60.0
    ) -> RuntimeConfig:
        """Change the toggles `update` sets (all or none); the effective config. A refusal
        raises grpc.RpcError (FAILED_PRECONDITION, INVALID_ARGUMENT, UNAUTHENTICATED)."""
        request = pb.UpdateRuntimeConfigRequest(config=runtime_update_to_proto(update))
        msg = self.stub.UpdateRuntimeConfig(request, timeout=timeout, metadata=self._auth)
        return runtime_config_from_proto(msg)

    def forward(
        self,
        batch: ForwardBatch,
        *,
        batch_id: int | None = None,
        timeout: float | None = None,
        attempts: int = 1,
        backoff_s: float = 0.05,
    ) -> ForwardOutput:
        """One step. With `attempts` > 1, a call that ended DEADLINE_EXCEEDED, UNAVAILABLE or
        RESOURCE_EXHAUSTED is sent again with the same batch_id: the executor answers a
        batch it already applied from its memory, so a retry never applies it twice."""
        request = pb.ForwardRequest(
            batch_id=batch_id or self._next_id(), batch=batch_to_proto(batch)
        )
        for attempt in range(attempts):
            try:
                return response_from_proto(
                    self.stub.Forward(request, timeout=timeout, metadata=self._auth)
                )
            except grpc.RpcError as exc:
                if attempt + 1 == attempts or exc.code() not in RETRYABLE:
                    raise
                time.sleep(backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def retrying(
        self, *, timeout: float | None = None, attempts: int = 5, backoff_s: float = 0.05
    ) -> Callable[[ForwardBatch], ForwardOutput]:
        """`forward` with retries under one batch_id per batch: what a scheduler drives."""
        return functools.partial(
            self.forward, timeout=timeout, attempts=attempts, backoff_s=backoff_s
        )

    def stream(
        self, batches: Iterable[ForwardBatch], *, timeout: float | None = None
    ) -> Iterator[ForwardOutput]:
        """Send batches over one ForwardStream; results come back in order. The batches
        iterable is consumed as the server accepts them, so it may be produced lazily."""
        requests = (
            pb.ForwardRequest(batch_id=self._next_id(), batch=batch_to_proto(b)) for b in batches
        )
        for response in self.stub.ForwardStream(requests, timeout=timeout, metadata=self._auth):
            yield response_from_proto(response)

    def open_stream(self) -> ForwardSession:
        """An interactive stream: `send` steps ahead, `recv` results in order (pipelining).
        It is the pipe of an overlapping `ReferenceScheduler(..., overlap=True, pipe=...)`."""
        return ForwardSession(self)

    def future_slots(self, timeout: float | None = 30.0) -> FutureSlotAllocator:
        """A free list of the executor's future-token slots (1..GetInfo.future_slots).

        For a scheduler that overlaps steps: `alloc` one slot per request of a step (its
        `future_token_slots`), feed the token to the next step as input id `-slot`, then
        `release` the slot once that step is built; `take_released` gives the next batch's
        `released_future_slots`."""
        return FutureSlotAllocator(self.info(timeout).info.limits.future_slots)

    def score(self, tokens: list[int]) -> TextScore:
        """The text's per-token logprobs, mean NLL and perplexity (executor.client.scoring):
        it holds row 1 while it runs."""
        return score_tokens(self.retrying(), self.info().info.limits, tokens)

    def embed(
        self, tokens: list[int], *, pooling: Pooling = Pooling.MEAN, layer: int | None = None
    ) -> list[float]:
        """The text's pooled hidden state (executor.client.scoring): it holds row 1."""
        return embed_tokens(
            self.retrying(), self.info().info.limits, tokens, pooling=pooling, layer=layer
        )

    @property
    def weights(self) -> WeightsClient:
        """Weight updates and memory calls (`executor.client.weights_client`): operator
        calls, which need the runtime-config token as `token`."""
        return WeightsClient(self.channel, self.stub, self._auth)

    @property
    def kv(self) -> KVClient:
        """The KV data plane: export, import and push KV (`executor.client.kv_client`)."""
        return KVClient(self.stub, self._kv_auth)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ForwardSession:
    """One ForwardStream driven step by step: send batch N+1 before receiving result N.

    A batch sent with `deferred_mask` set (any `DeferredMask`: on the wire it is the flag
    `vocab_mask_deferred`) waits on the executor, at sampling, for `send_mask` with its
    batch_id: compute the grammar mask while the forward runs. Send the mask before more
    than the server's stream window of later batches, or it sits behind them."""

    _END = object()

    def __init__(self, client: ExecutorClient) -> None:
        self._outbox: queue.Queue[object] = queue.Queue()
        self._client = client
        self._responses = client.stub.ForwardStream(self._requests(), metadata=client._auth)

    def _requests(self) -> Iterator[pb.ForwardRequest]:
        while True:
            item = self._outbox.get()
            if item is self._END:
                return
            assert isinstance(item, pb.ForwardRequest)
            yield item

    def send(self, batch: ForwardBatch, *, batch_id: int | None = None) -> int:
        bid = batch_id or self._client._next_id()
        self._outbox.put(pb.ForwardRequest(batch_id=bid, batch=batch_to_proto(batch)))
        return bid

    def send_mask(self, batch_id: int, mask: VocabMask) -> None:
        """The vocab mask of `batch_id`, sent earlier on this stream with a deferred mask.
        It gets no answer of its own; a mask for a batch that does not wait is ignored."""
        msg = pb.DeferredMask(
            batch_id=batch_id, vocab_mask=tensor_to_proto(mask.words.to(torch.int32))
        )
        if mask.rows is not None:
            msg.vocab_mask_rows.CopyFrom(tensor_to_proto(mask.rows))
        self._outbox.put(pb.ForwardRequest(deferred_mask=msg))

    def recv(self) -> ForwardOutput:
        return response_from_proto(next(self._responses))

    def cancel(self) -> None:
        """End the stream now: batches not yet run are not applied, and one waiting for its
        deferred mask stops waiting."""
        self._responses.cancel()

    def close(self) -> None:
        self._outbox.put(self._END)
        for _ in self._responses:  # drain whatever the server still answers
            pass
