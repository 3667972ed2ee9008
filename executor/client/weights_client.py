"""A trainer's side of weight updates and memory calls (`ExecutorClient.weights`).

    weights = client.weights
    weights.update(model.named_parameters(), version="step-100")   # stream (gRPC)
    weights.update_from_path("ckpt/step-100", version="step-100")  # the executor reads it
    with weights.open_group("10.0.0.5", 29500, world_size=1 + tp_size) as group:
        group.update(model.state_dict().items(), version="step-100")  # torch.distributed
    weights.release(["weights", "kv_cache"]); ...; weights.resume(["weights"], from_update=True)

Tensors are `(name, tensor)` pairs under the checkpoint's names (a Hugging Face model's
`named_parameters()` or `state_dict()`), whole (unsharded), in float32, bfloat16 or float16.
Every call needs the runtime-config token (`ExecutorClient(token=...)`). A refusal raises
grpc.RpcError with the status and why; nothing changed on the executor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import torch

from executor.service.weights_codec import (
    CHUNK_BYTES,
    chunk_requests,
    memory_from_proto,
    spec_to_proto,
    swap_from_proto,
    tensor_spec,
)
from executor.weights.control import SwapResult
from executor.weights.group import DEFAULT_TIMEOUT_S, GroupSpec, WeightsGroup
from executor.weights.memory import MemoryReport
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc

Named = Iterable[tuple[str, torch.Tensor]]


def _pairs(tensors: Named) -> list[tuple[str, torch.Tensor]]:
    pairs = [(name, t.detach()) for name, t in tensors]
    if not pairs:
        raise ValueError("an update names at least one tensor")
    return pairs


class WeightsClient:
    def __init__(
        self,
        channel: grpc.Channel,
        stub: pb_grpc.ModelExecutorStub,
        metadata: list[tuple[str, str]],
    ) -> None:
        self.stub = stub
        self.metadata = metadata
        # UpdateWeights with requests serialized here (`weights_codec.chunk_requests`).
        self._update = channel.stream_unary(
            "/model_executor.v1.ModelExecutor/UpdateWeights",
            request_serializer=None,
            response_deserializer=pb.WeightUpdateResponse.FromString,
        )

    def update(
        self,
        tensors: Named,
        *,
        version: str = "",
        chunk_bytes: int = CHUNK_BYTES,
        timeout: float | None = None,
    ) -> SwapResult:
        """Stream `(name, tensor)` pairs over UpdateWeights; the executor swaps them in
        between two steps, all or none. `version`: what the weights are called then."""
        pairs = _pairs(tensors)
        header = pb.WeightUpdateHeader(
            weight_version=version,
            tensors=[spec_to_proto(tensor_spec(n, t)) for n, t in pairs],
        )

        def requests() -> Iterator[bytes]:
            yield pb.WeightUpdateRequest(header=header).SerializeToString()
            yield from chunk_requests([t for _, t in pairs], chunk_bytes)

        msg = self._update(requests(), timeout=timeout, metadata=self.metadata)
        return swap_from_proto(msg)

    def update_from_file(
        self, path: str | Path, *, version: str = "", timeout: float | None = None
    ) -> SwapResult:
        """Stream a local safetensors file, or a directory of them, over UpdateWeights (each
        tensor read as it is sent)."""
        from safetensors import safe_open

        from executor.models.hf_loader import safetensors_files

        handles = [safe_open(str(f), framework="pt") for f in safetensors_files(Path(path))]

        class _Lazy:
            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                for handle in handles:
                    for name in handle.keys():  # noqa: SIM118 (a safetensors handle)
                        yield name, handle.get_tensor(name)

        return self.update(_Lazy(), version=version, timeout=timeout)

    def update_from_path(
        self, path: str, *, version: str = "", timeout: float | None = None
    ) -> SwapResult:
        """The executor reads `path` (under its weight_update_root) itself."""
        request = pb.UpdateWeightsFromPathRequest(path=path, weight_version=version)
        msg = self.stub.UpdateWeightsFromPath(request, timeout=timeout, metadata=self.metadata)
        return swap_from_proto(msg)

    def open_group(
        self,
        master_address: str,
        master_port: int,
        *,
        world_size: int,
        backend: str = "",
        device: torch.device | None = None,
        group_name: str = "weights",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> TrainerGroup:
        """Form a weights group with the executor: this process is rank 0 and serves the
        rendezvous at master_address:master_port; the executor's ranks join as 1..; returns
        once everyone joined. `world_size`: 1 + the executor's tp_size."""
        device = device or torch.device("cpu")
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        request = pb.InitWeightsGroupRequest(
            master_address=master_address,
            master_port=master_port,
            rank_offset=1,
            world_size=world_size,
            backend=backend,
            group_name=group_name,
            timeout_s=timeout_s,
        )
        joined = self.stub.InitWeightsGroup.future(request, metadata=self.metadata)
        spec = GroupSpec(master_address, master_port, 0, world_size, backend, group_name, timeout_s)
        group = _join_while(joined, lambda: WeightsGroup(spec, device))
        joined.result()
        return TrainerGroup(self, group)

    def release(self, tags: Iterable[str] = (), *, timeout: float | None = None) -> MemoryReport:
        """Give the tags' memory (weights, kv_cache; none: both) back; answered once free."""
        request = pb.ReleaseMemoryRequest(tags=list(tags))
        return memory_from_proto(
            self.stub.ReleaseMemory(request, timeout=timeout, metadata=self.metadata)
        )

    def resume(
        self,
        tags: Iterable[str] = (),
        *,
        from_update: bool = False,
        timeout: float | None = None,
    ) -> MemoryReport:
        """Take the tags' memory back. `from_update`: the weights wait for an update naming
        every tensor instead of being reloaded from the model file."""
        request = pb.ResumeMemoryRequest(tags=list(tags), weights_from_update=from_update)
        return memory_from_proto(
            self.stub.ResumeMemory(request, timeout=timeout, metadata=self.metadata)
        )


def _join_while(call: Any, join: Any) -> WeightsGroup:
    """`join()` (which blocks until every member joined); an RPC that fails meanwhile is
    raised instead of waiting for the group's timeout."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(join())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while thread.is_alive():
        if call.done() and call.exception() is not None:
            raise call.exception()
        thread.join(0.01)
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


class TrainerGroup:
    """The trainer's rank 0 of a weights group formed with one executor."""

    def __init__(self, client: WeightsClient, group: WeightsGroup) -> None:
        self.client = client
        self.group = group

    def update(
        self, tensors: Named, *, version: str = "", timeout: float | None = None
    ) -> SwapResult:
        """Broadcast `(name, tensor)` pairs to the executor's ranks; it swaps them in between
        two steps. A refused header raises before any tensor is sent."""
        pairs = _pairs(tensors)
        request = pb.UpdateWeightsFromGroupRequest(
            weight_version=version,
            tensors=[spec_to_proto(tensor_spec(n, t)) for n, t in pairs],
            src_rank=0,
        )
        call = self.client.stub.UpdateWeightsFromGroup.future(
            request, timeout=timeout, metadata=self.client.metadata
        )
        group, device = self.group, self.group.tensor_device
        verdict = _join_while(call, lambda: group.verdict(0, 1))
        if verdict != 0:
            call.result()  # raises the refusal
            raise RuntimeError("the executor refused the update")  # pragma: no cover
        group.send((t.to(device).contiguous() for _, t in pairs), 0)
        return swap_from_proto(call.result())

    def close(self) -> None:
        """Leave the group, on both sides."""
        with contextlib.suppress(grpc.RpcError):
            self.client.stub.DestroyWeightsGroup(
                pb.DestroyWeightsGroupRequest(), metadata=self.client.metadata
            )
        self.group.close()

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
