"""The weight and memory calls' work: UpdateWeights (a stream), UpdateWeightsFromPath,
InitWeightsGroup / UpdateWeightsFromGroup / DestroyWeightsGroup, ReleaseMemory and
ResumeMemory.

Each update is checked from its header first (`WeightsControl.plan`: every refusal that
needs no tensor byte), then staged on the calling thread while steps keep running (a
stream's chunks verified as they arrive: order, size, CRC-32), then swapped in by a device job
(`DeviceWorker.run_on_device`) between two steps. Memory calls are device jobs. One call of
this kind runs at a time (another is FAILED_PRECONDITION); who may call was checked before
(`access.py`: they are operator calls).

Paths are confined to `weight_update_root` (symlinks resolved, each file too), and a group's
rendezvous to the hosts `weight_group_addresses` allows.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from executor.core.errors import BatchValidationError, ModelStateError, WeightChunkError
from executor.models.hf_loader import safetensors_files
from executor.observability.weight_metrics import WeightState
from executor.service.access import PermissionDeniedError
from executor.service.device_worker import DeviceWorker
from executor.service.handlers import UndecodableRequest
from executor.service.weights_codec import (
    CHUNK_BYTES,
    RawChunk,
    WeightLimits,
    specs_from_proto,
)
from executor.weights.catalog import FLOAT_DTYPES, TensorSpec, UpdatePlan, check_version
from executor.weights.control import SwapResult, WeightsControl, check_tags
from executor.weights.group import BACKENDS, DEFAULT_TIMEOUT_S, GroupSpec
from executor.weights.memory import MemoryReport
from executor.weights.staging import StagingArena
from executor.weights.writer import StagedUpdate
from model_executor.v1 import executor_pb2 as pb
from ops.checksum import checksum

if TYPE_CHECKING:
    from executor.observability.metrics import ExecutorMetrics
    from executor.service.server_config import ServerConfig
    from executor.service.servicer import ExecutorServicer

log = structlog.get_logger(__name__)

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # as the loader: entries that are no weights


@dataclass(frozen=True)
class WeightSettings:
    """The server's settings of these calls."""

    update_root: str = ""  # weight_update_root: '' = no path updates
    max_update_mib: int = 0  # max_weight_update_mib: 0 = the model's own size
    group_addresses: str = ""  # weight_group_addresses: '' = no weights group
    max_group_timeout_s: float = 600.0  # weight_update_timeout_s: a group's collective bound


def _not_observed(transport: str, nbytes: int, seconds: float, swap: float | None) -> None:
    return None


class WeightsService:
    def __init__(
        self,
        worker: Callable[[], DeviceWorker],
        settings: WeightSettings | None = None,
        *,
        on_update: Callable[[str, int, float, float | None], None] = _not_observed,
    ) -> None:
        """`worker`: the device worker now (raises NotServingError while loading or draining);
        `on_update(transport, nbytes, seconds, swap_seconds or None)`: the server's metrics."""
        self._worker = worker
        self.settings = settings or WeightSettings()
        self.on_update = on_update
        self._busy = threading.Lock()
        root = self.settings.update_root
        self.root = Path(root).resolve() if root else None
        self.group_patterns = tuple(
            p.strip() for p in self.settings.group_addresses.split(",") if p.strip()
        )

    def limits(self, control: WeightsControl) -> WeightLimits:
        cap = control.catalog.max_bytes
        if self.settings.max_update_mib:
            cap = min(cap, self.settings.max_update_mib << 20)
        return WeightLimits(
            cap,
            control.catalog.max_tensors,
            self.root is not None,
            bool(self.group_patterns),
            self.settings.max_group_timeout_s,
        )

    def _one_at_a_time(self) -> threading.Lock:
        if not self._busy.acquire(blocking=False):
            raise ModelStateError(
                "another weight or memory call is in progress; retry when it has answered"
            )
        return self._busy

    def _update(
        self, transport: str, stage: Callable[[DeviceWorker, WeightsControl], StagedUpdate]
    ) -> SwapResult:
        """Stage (this thread), then swap (a device job); counted either way."""
        t0, nbytes, swap = time.perf_counter(), 0, None
        lock = self._one_at_a_time()
        try:
            worker = self._worker()
            control = worker.executor.weights
            staged = stage(worker, control)
            nbytes = staged.nbytes
            result: SwapResult = worker.run_on_device(lambda: control.swap(staged)).result()
            swap = result.swap_seconds
            return result
        finally:
            lock.release()
            self.on_update(transport, nbytes, time.perf_counter() - t0, swap)

    def state(self) -> WeightState | None:
        """The weights' version, released memory and KV epoch now (None while loading)."""
        try:
            control = self._worker().executor.weights
        except Exception:
            return None
        return WeightState(control.version, control.memory.released, control.kv_epoch)

    def _plan(self, control: WeightsControl, specs: list[TensorSpec], version: str) -> UpdatePlan:
        return control.plan(specs, version, max_bytes=self.limits(control).max_update_bytes)

    # --- UpdateWeights ------------------------------------------------------------------
    def update_stream(
        self, requests: Iterator[pb.WeightUpdateRequest | RawChunk | UndecodableRequest]
    ) -> SwapResult:
        def stage(worker: DeviceWorker, control: WeightsControl) -> StagedUpdate:
            first = next(requests, None)
            if isinstance(first, UndecodableRequest):
                raise first.error
            if (
                not isinstance(first, pb.WeightUpdateRequest)
                or first.WhichOneof("item") != "header"
            ):
                raise BatchValidationError(
                    "header", "an UpdateWeights stream starts with its header"
                )
            header = first.header
            specs = specs_from_proto(list(header.tensors), control.catalog.max_tensors)
            plan = self._plan(control, specs, header.weight_version)
            return control.stage_tensors(plan, _receive(requests, plan, control.staging))

        return self._update("stream", stage)

    # --- UpdateWeightsFromPath ----------------------------------------------------------
    def update_path(self, request: pb.UpdateWeightsFromPathRequest) -> SwapResult:
        def stage(worker: DeviceWorker, control: WeightsControl) -> StagedUpdate:
            check_version(request.weight_version)
            files = self._files(request.path)
            specs = _file_specs(files, control.catalog.max_tensors)
            plan = self._plan(control, specs, request.weight_version)
            return control.stage_files(plan, files)

        return self._update("path", stage)

    def _files(self, path: str) -> list[Path]:
        if self.root is None:
            raise ModelStateError(
                "UpdateWeightsFromPath is off: the server has no weight_update_root"
            )
        if not path:
            raise BatchValidationError("path", "a safetensors file or directory")
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root):
            raise PermissionDeniedError(f"path {path!r} is outside weight_update_root")
        if not target.exists():
            raise BatchValidationError("path", f"{path!r}: no such file or directory")
        try:
            files = safetensors_files(target)
        except ValueError as exc:
            raise BatchValidationError("path", str(exc)) from None
        for file in files:
            if not file.resolve().is_relative_to(self.root):
                raise PermissionDeniedError(f"{file.name} links outside weight_update_root")
        return [f.resolve() for f in files]

    # --- the weights group --------------------------------------------------------------
    def init_group(self, request: pb.InitWeightsGroupRequest) -> GroupSpec:
        lock = self._one_at_a_time()
        try:
            control = self._worker().executor.weights
            spec = self._group_spec(request, control)
            return control.join_group(spec)
        finally:
            lock.release()

    def _group_spec(
        self, request: pb.InitWeightsGroupRequest, control: WeightsControl
    ) -> GroupSpec:
        if not self.group_patterns:
            raise ModelStateError(
                "InitWeightsGroup is off: the server has no weight_group_addresses"
            )
        address = request.master_address
        if not any(fnmatch.fnmatchcase(address, p) for p in self.group_patterns):
            raise PermissionDeniedError(
                f"master_address {address!r} is not one weight_group_addresses allows"
            )
        tp = control.comm.size
        backend = request.backend or ("nccl" if control.device.type == "cuda" else "gloo")
        if backend not in BACKENDS:
            raise BatchValidationError("backend", f"one of {', '.join(BACKENDS)}, got {backend!r}")
        if request.rank_offset < 1:
            raise BatchValidationError("rank_offset", "the trainer holds rank 0: >= 1")
        if request.world_size < request.rank_offset + tp:
            raise BatchValidationError(
                "world_size", f"at least rank_offset + tp_size ({request.rank_offset + tp})"
            )
        if not 0 < request.master_port < 65536:
            raise BatchValidationError("master_port", "in 1..65535")
        cap = self.settings.max_group_timeout_s
        if not 0 <= request.timeout_s <= cap:
            raise BatchValidationError(
                "timeout_s",
                f"0..{cap:g} s (weight_update_limits.max_group_timeout_s, the server's "
                f"weight_update_timeout_s), got {request.timeout_s:g}",
            )
        return GroupSpec(
            address,
            request.master_port,
            request.rank_offset,
            request.world_size,
            backend,
            request.group_name or "weights",
            request.timeout_s or min(DEFAULT_TIMEOUT_S, cap),
        )

    def update_group(self, request: pb.UpdateWeightsFromGroupRequest) -> SwapResult:
        def stage(worker: DeviceWorker, control: WeightsControl) -> StagedUpdate:
            group = control.group
            if group is None:
                raise ModelStateError("no weights group: call InitWeightsGroup first")
            src = request.src_rank
            if not 0 <= src < group.spec.rank:
                raise BatchValidationError("src_rank", f"a trainer rank, 0..{group.spec.rank - 1}")
            try:
                specs = specs_from_proto(list(request.tensors), control.catalog.max_tensors)
                plan = self._plan(control, specs, request.weight_version)
            except BaseException:
                control.refuse_group(src)  # the trainer learns it before sending anything
                raise
            return control.stage_group(plan, src)

        return self._update("group", stage)

    def destroy_group(self) -> None:
        lock = self._one_at_a_time()
        try:
            self._worker().executor.weights.leave_group()
        finally:
            lock.release()

    # --- memory -------------------------------------------------------------------------
    def release(self, request: pb.ReleaseMemoryRequest) -> MemoryReport:
        tags = _tags(request.tags)
        return self._memory("memory released", tags, lambda c: c.release(tags))

    def resume(self, request: pb.ResumeMemoryRequest) -> MemoryReport:
        tags, from_update = _tags(request.tags), request.weights_from_update
        return self._memory(
            "memory resumed", tags, lambda c: c.resume(tags, from_update=from_update)
        )

    def _memory(
        self, event: str, tags: tuple[str, ...], call: Callable[[WeightsControl], MemoryReport]
    ) -> MemoryReport:
        """A memory call as a device job, one at a time, logged."""
        lock = self._one_at_a_time()
        try:
            worker = self._worker()
            control = worker.executor.weights
            report: MemoryReport = worker.run_on_device(lambda: call(control)).result()
        finally:
            lock.release()
        log.warning(
            event,
            tags=list(tags),
            bytes=report.nbytes,
            seconds=round(report.seconds, 3),
            kv_epoch=report.kv_epoch,
            weights_await_update=report.awaiting_update,
        )
        return report


def weights_service(
    servicer: ExecutorServicer, config: ServerConfig, metrics: ExecutorMetrics
) -> WeightsService:
    """The server's: its settings, and its metrics told of every update and memory call."""
    service = WeightsService(
        servicer._accepting,
        WeightSettings(
            config.weight_update_root,
            config.max_weight_update_mib,
            config.weight_group_addresses,
            config.weight_update_timeout_s,
        ),
        on_update=metrics.weights.observe_update,
    )
    metrics.weights.bind(service.state)
    return service


def _tags(tags: list[str]) -> tuple[str, ...]:
    try:
        return check_tags(tags)
    except ValueError as exc:
        raise BatchValidationError("tags", str(exc)) from None


_VERIFY_THREADS = 4  # chunks checked and copied at once (the CRC-32 releases the GIL)
_VERIFY_AHEAD = 8  # chunks read ahead of the oldest still being checked (memory: 8 x 4 MiB)


def _receive(
    requests: Iterator[pb.WeightUpdateRequest | RawChunk | UndecodableRequest],
    plan: UpdatePlan,
    arena: StagingArena,
) -> Iterator[torch.Tensor]:
    """Every tensor of `plan` from its chunks, in order, each yielded as soon as its last chunk
    is in (the staging casts and packs it while the next chunks arrive), each copied once into
    `arena` and verified (DATA_LOSS: a chunk out of place, too large, or whose CRC-32 does not
    match; a stream that ends early or runs past the last tensor). The place of a chunk is
    checked as it arrives; its CRC and its copy run on a few threads while the next chunks
    are read."""
    specs = plan.specs
    index, offset = 0, 0
    arena.begin([spec.nbytes for spec in specs])
    buffer, view = torch.empty(0, dtype=torch.uint8), memoryview(b"")
    pending: deque[Future[None]] = deque()
    with ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="weights-verify") as pool:
        for n, request in enumerate(requests):
            if isinstance(request, UndecodableRequest):
                raise request.error
            chunk = request if isinstance(request, RawChunk) else _raw(request)
            size = len(chunk.data)
            where = f"chunk {n} (tensor {chunk.tensor}, offset {chunk.offset})"
            if index == len(specs):
                raise WeightChunkError(f"{where}: the header's {len(specs)} tensors are complete")
            if chunk.tensor != index or chunk.offset != offset:
                raise WeightChunkError(
                    f"{where}: expected tensor {index} at offset {offset} (chunks come in order)"
                )
            if not 0 < size <= CHUNK_BYTES or offset + size > specs[index].nbytes:
                raise WeightChunkError(
                    f"{where}: {size} bytes do not fit (at most {CHUNK_BYTES} a chunk, "
                    f"{specs[index].nbytes - offset} left of the tensor)"
                )
            if offset == 0:  # a tensor's first chunk: its place in the arena
                buffer = arena.take(specs[index].nbytes)
                view = buffer.numpy().data
            pending.append(pool.submit(_verify_copy, chunk, view[offset : offset + size], where))
            while len(pending) > _VERIFY_AHEAD:
                pending.popleft().result()
            offset += size
            if offset == specs[index].nbytes:  # (every dimension >= 1: no empty tensor)
                while pending:  # this tensor's chunks, all verified and copied
                    pending.popleft().result()
                yield buffer.view(specs[index].dtype).reshape(specs[index].shape)
                index, offset = index + 1, 0
    if index < len(specs):
        raise WeightChunkError(
            f"the stream ended after {offset} of tensor {index}'s {specs[index].nbytes} bytes"
        )


def _verify_copy(chunk: RawChunk, target: memoryview, where: str) -> None:
    if checksum(chunk.data) != chunk.crc32:
        raise WeightChunkError(f"{where}: the CRC-32 of its data does not match")
    target[:] = chunk.data


def _raw(request: pb.WeightUpdateRequest) -> RawChunk:
    if request.WhichOneof("item") != "chunk":
        raise BatchValidationError("header", "an UpdateWeights stream has one header, first")
    c = request.chunk
    return RawChunk(c.tensor, c.offset, memoryview(c.data), c.crc32)


def _file_specs(files: list[Path], max_tensors: int) -> list[TensorSpec]:
    """The tensors of safetensors files, from their (checked) headers."""
    from safetensors import safe_open

    specs: list[TensorSpec] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                piece = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None or dtype not in FLOAT_DTYPES:
                    raise BatchValidationError(
                        "path", f"{file.name}: {name} is {piece.get_dtype()}, not F32, BF16 or F16"
                    )
                specs.append(TensorSpec(name, dtype, tuple(piece.get_shape())))
                if len(specs) > max_tensors:
                    raise BatchValidationError(
                        "path", f"more than the model's {max_tensors} tensors"
                    )
    return specs
