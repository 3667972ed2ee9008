"""`WeightsControl`: the model's weights and memory, changed while serving, between two steps.

`ModelExecutor` owns one. Its state: `version` (the weights every step runs on: the step
stamps it on each output), the count of updates, the memory released by tag, whether the
weights await an update, and the KV epoch (how many times the KV cache came back empty).

An update goes through three stages, the same for every transport:
- `plan`: the header checked (names, shapes, dtypes, sizes; what the served model can take;
  the state), nothing read yet;
- `stage_*`: the tensors received or read, cut to this rank's shard, cast and prepared, off
  the device thread while steps keep running;
- `swap`: on the device thread, between two steps, holding the step lock: the staged tensors
  written into the weights' own storage and the version changed, together. A step therefore
  runs on one version, and a refused or failed update changes nothing.

Memory (`release` / `resume`, tags `weights` and `kv_cache`, `executor.weights.memory`) runs on
the device thread too. While any tag is released `check_serving` refuses steps and KV calls;
after `resume` of `weights` the weights are reloaded from the model file, or await an update
naming every tensor; after `resume` of `kv_cache` every row is released (`empty_rows`) and the
KV epoch counts it. On CUDA, graphs captured the memory's addresses: they are dropped at a
release and captured again once nothing is released. On the CPU they stay.

Tensor parallel: rank 0 takes the calls and tells the other ranks (`executor.weights.ranks`),
which stage their own shards and swap when rank 0 swaps, only if every rank staged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from executor.core.errors import ModelStateError
from executor.core.names import GraphMode
from executor.core.toggles import CaptureState, Toggles
from executor.model_runner import ModelRunner
from executor.models.decoder_model import DecoderModel
from executor.models.layers import PackedLinear
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from executor.weights import ranks, writer
from executor.weights.catalog import TensorSpec, UpdatePlan, WeightCatalog
from executor.weights.group import GroupSpec, WeightsGroup
from executor.weights.memory import KV_CACHE, TAGS, WEIGHTS, MemoryReport, TaggedMemory
from executor.weights.staging import StagingArena
from executor.weights.writer import StagedUpdate
from ops.device_scope import on_own_device

log = structlog.get_logger(__name__)

INITIAL_VERSION = "0"  # the model file's weights (start-up, or a reload)


@dataclass(frozen=True)
class SwapResult:
    version: str
    num_tensors: int
    nbytes: int
    stage_seconds: float
    swap_seconds: float


def check_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """The tags asked, in TAGS order (none: every tag); ValueError for an unknown one."""
    asked = tuple(tags)
    unknown = [t for t in asked if t not in TAGS]
    if unknown:
        raise ValueError(f"memory tags are {', '.join(TAGS)}, got {unknown}")
    return tuple(t for t in TAGS if t in asked) if asked else TAGS


class WeightsControl:
    def __init__(
        self,
        *,
        model: DecoderModel,
        memory: TaggedMemory,
        runner: ModelRunner,
        toggles: Toggles,
        comm: TpComm,
        device: torch.device,
        dtype: torch.dtype,
        step_lock: AbstractContextManager[bool],  # the step lock (re-entrant)
        reload: Callable[[], DecoderModel],
        empty_rows: Callable[[], None],
        on_version: Callable[[str], None],
    ) -> None:
        self.model = model
        self.runner = runner
        self.toggles = toggles
        self.comm = comm
        self.device = device
        self.dtype = dtype
        self.step_lock = step_lock
        self._reload = reload
        self._empty_rows = empty_rows
        self._on_version = on_version
        self.memory = memory
        self.leader: TpLeader | None = None  # rank 0 of a group, once it serves
        self.version = INITIAL_VERSION
        self.updates = 0
        self.kv_epoch = 0
        self.awaiting_update = False
        self.group: WeightsGroup | None = None
        self.staging = StagingArena()  # a stream's or a group's tensors land here
        self._catalog: WeightCatalog | None = None
        self.ranks = ranks.RankSide(self)  # a worker rank's side of every command

    @property
    def catalog(self) -> WeightCatalog:
        if self._catalog is None:
            self._catalog = WeightCatalog(self.model.config, self.model.plan)
        return self._catalog

    # --- the state ----------------------------------------------------------------------
    def check_serving(self) -> None:
        """Refuse (ModelStateError) a step or KV call the memory's state forbids now."""
        if not self.memory.any_released and not self.awaiting_update:
            return  # every step asks: the common case costs two attribute reads
        released = self.memory.released
        if released:
            raise ModelStateError(
                f"the executor's memory is released ({', '.join(released)}): batches and KV "
                "calls are refused until ResumeMemory"
            )
        if self.awaiting_update:
            raise ModelStateError(
                "the weights were resumed without content (weights_from_update): batches are "
                "refused until an update naming every tensor of the model is in"
            )

    def report(self, nbytes: int = 0, seconds: float = 0.0) -> MemoryReport:
        return MemoryReport(
            self.memory.released, self.kv_epoch, self.awaiting_update, nbytes, seconds
        )

    # --- an update ----------------------------------------------------------------------
    def plan(self, specs: list[TensorSpec], version: str, *, max_bytes: int) -> UpdatePlan:
        """The header checked (raises; nothing changes)."""
        plan = self.catalog.plan_update(specs, version, max_bytes=max_bytes)
        self._check_update_state(plan)
        writer.check(self.model, self.catalog, plan)
        return plan

    def _check_update_state(self, plan: UpdatePlan) -> None:
        if self.memory.released:
            raise ModelStateError(
                f"the executor's memory is released ({', '.join(self.memory.released)}): "
                "ResumeMemory before updating the weights"
            )
        if self.awaiting_update:
            named = {s.name for s in plan.specs}
            missing = [n for n, e in self.catalog.entries.items() if e.target and n not in named]
            if missing:
                raise ModelStateError(
                    "the weights were resumed without content: this update must name every "
                    f"tensor of the model; missing {len(missing)}, e.g. {missing[0]!r}"
                )

    def stage(self, plan: UpdatePlan, sources: Iterable[Any]) -> StagedUpdate:
        """This rank's staging of `plan` from whole tensors (or lazy slices), in order."""
        return writer.stage(
            self.model,
            self.catalog,
            plan,
            sources,
            dtype=self.dtype,
            pin=self.device.type == "cuda",
        )

    def stage_tensors(self, plan: UpdatePlan, tensors: Iterable[torch.Tensor]) -> StagedUpdate:
        """Stage host tensors (a stream's, each staged as it comes); the other ranks get them
        all from rank 0 once they are in."""
        if self.leader is not None:
            tensors = list(tensors)
            with self.leader.holding():
                ranks.send_stage(self.leader, plan, "payload", payload=ranks.pack(tensors))
        return self._staged_or_drop(lambda: self.stage(plan, tensors))

    def stage_files(self, plan: UpdatePlan, files: list[Path]) -> StagedUpdate:
        """Stage from safetensors files every rank can read: each reads its own shard."""
        if self.leader is not None:
            with self.leader.holding():
                ranks.send_stage(self.leader, plan, "files", files=[str(f) for f in files])
        return self._staged_or_drop(lambda: self.stage(plan, ranks.lazy_sources(plan, files)))

    def stage_group(self, plan: UpdatePlan, src: int) -> StagedUpdate:
        """Receive the tensors from the trainer's `src` over the weights group (the verdict
        first: accepted), every rank its own copy."""
        group = self._group()
        if self.leader is not None:
            with self.leader.holding():
                ranks.send_stage(self.leader, plan, "group", src=src)
        received = ranks.receive(group, plan, src, arena=self.staging)
        return self._staged_or_drop(lambda: self.stage(plan, received))

    def refuse_group(self, src: int) -> None:
        """A refused header: every member takes the verdict (nothing follows)."""
        group = self._group()
        if self.leader is not None:
            with self.leader.holding():
                ranks.send_stage(self.leader, None, "refused", src=src)
        group.verdict(1, group.spec.rank)

    def _staged_or_drop(self, fn: Callable[[], StagedUpdate]) -> StagedUpdate:
        try:
            return fn()
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        """Rank 0's staging failed after the other ranks were told: they discard theirs."""
        if self.leader is not None:
            with self.leader.holding():
                ranks.send(self.leader, {"op": "drop"})

    def swap(self, update: StagedUpdate) -> SwapResult:
        """Write a staged update in, between two steps (the device thread)."""
        t0 = time.perf_counter()
        with self.step_lock:
            try:
                self._check_update_state(update.plan)  # the state may have changed meanwhile
            except BaseException:
                self.drop()
                raise
            if self.leader is not None:
                with self.leader.holding():
                    ranks.send(self.leader, {"op": "swap"})
                    if not ranks.agree(self.comm, ok=True):
                        raise ModelStateError(
                            "a tensor-parallel rank could not stage the update (its log says "
                            "why); nothing was changed"
                        )
            version = self.apply(update)
        seconds = time.perf_counter() - t0
        log.warning(
            "weights updated",
            weight_version=version,
            tensors=len(update.plan.specs),
            bytes=update.nbytes,
            stage_s=round(update.stage_seconds, 4),
            swap_s=round(seconds, 4),
        )
        return SwapResult(
            version, len(update.plan.specs), update.nbytes, update.stage_seconds, seconds
        )

    def apply(self, update: StagedUpdate) -> str:
        """Write and name the new version (every rank, holding the step lock)."""
        writer.write(self.model, update)
        self.updates += 1
        self._set_version(update.plan.version or str(self.updates))
        self.awaiting_update = False
        return self.version

    def _set_version(self, version: str) -> None:
        self.version = version
        self._on_version(version)

    # --- the weights group --------------------------------------------------------------
    def join_group(self, spec: GroupSpec) -> GroupSpec:
        """Join a trainer's group as rank `spec.rank` (the other ranks as the next ones);
        replaces a group joined before. Blocks until every member joined."""
        self.leave_group()
        if self.leader is not None:
            with self.leader.holding():
                ranks.send(self.leader, {"op": "group_init", "spec": ranks.spec_json(spec)})
        self.group = WeightsGroup(spec, self.device)
        return spec

    def leave_group(self) -> None:
        if self.group is None:
            return
        if self.leader is not None:
            with self.leader.holding():
                ranks.send(self.leader, {"op": "group_destroy"})
        group, self.group = self.group, None
        group.close()

    def _group(self) -> WeightsGroup:
        if self.group is None:
            raise ModelStateError("no weights group: call InitWeightsGroup first")
        return self.group

    # --- memory -------------------------------------------------------------------------
    @on_own_device
    def release(self, tags: tuple[str, ...]) -> MemoryReport:
        """Give `tags`' memory back to the system (the device thread, between two steps)."""
        t0 = time.perf_counter()
        with self.step_lock:
            if self.toggles.capture is CaptureState.CAPTURING:
                raise ModelStateError(
                    f"a graph capture is in progress ({self.toggles.graph_capture}); release "
                    "memory once GetRuntimeConfig's graph_capture is no longer 'capturing'"
                )
            for tag in tags:  # checked whole before anything is freed
                if tag not in self.memory.released:
                    self.memory.check(tag)
            if self.leader is not None:
                with self.leader.holding():
                    ranks.send(self.leader, {"op": "release", "tags": list(tags)})
            freed = self.release_local(tags)
            self.staging.drop()  # host memory kept for the next update: let go as well
        return self.report(freed, time.perf_counter() - t0)

    @on_own_device
    def release_local(self, tags: tuple[str, ...]) -> int:
        if self.device.type == "cuda":  # graphs captured these addresses (and hold a pool)
            self.runner.drop_graphs()
        return sum(self.memory.release(tag) for tag in tags)

    @on_own_device
    def resume(self, tags: tuple[str, ...], *, from_update: bool) -> MemoryReport:
        """Take `tags`' memory back (the device thread, between two steps)."""
        t0 = time.perf_counter()
        kv_back = KV_CACHE in tags and KV_CACHE in self.memory.released
        with self.step_lock:
            if self.leader is not None:
                with self.leader.holding():
                    ranks.send(
                        self.leader,
                        {"op": "resume", "tags": list(tags), "from_update": from_update},
                    )
                    taken = self.resume_local(tags, from_update=from_update)
            else:
                taken = self.resume_local(tags, from_update=from_update)
        if kv_back:  # every row released, as a step releases them (on every rank)
            self._empty_rows()
            self.kv_epoch += 1
        return self.report(taken, time.perf_counter() - t0)

    @on_own_device  # a resume captures graphs again: Triton launches need the scope
    def resume_local(self, tags: tuple[str, ...], *, from_update: bool) -> int:
        weights_back = WEIGHTS in tags and WEIGHTS in self.memory.released
        taken = sum(self.memory.resume(tag) for tag in tags)
        if weights_back:
            if from_update:
                self.awaiting_update = True
            else:
                self._reload_weights()
                self._set_version(INITIAL_VERSION)
        if self.device.type == "cuda" and not self.memory.released:
            mode = self.toggles.graph_mode
            if mode is not GraphMode.NONE:  # the memory moved: capture again
                self.runner.enable_graphs(mode, progress=False)
        return taken

    def _reload_weights(self) -> None:
        """The model file's weights, loaded in the served form, copied into the resumed
        storage (packed weights adopted as they are)."""
        fresh = self._reload()
        served = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in fresh.state_dict().items():
                served[name].copy_(tensor)
        for path, module in self.model.named_modules():
            if isinstance(module, PackedLinear):
                source = fresh.get_submodule(path)
                assert isinstance(source, PackedLinear)
                module.packed.restore(source.packed.tensor)
        log.info("weights reloaded from the model file")
