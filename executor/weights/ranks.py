"""Weight updates and memory calls across a tensor-parallel group: what rank 0 sends, and
what the other ranks do with it (`RankSide.serve`, from `executor.tp_worker`).

Rank 0 sends each call as a `weights` command (`executor.parallel.broadcast`), a JSON header
with `op`:
- `stage`: stage this update's header (names, dtypes, shapes, version) from `kind`:
  `payload` (a stream's tensors, forwarded by rank 0 in the command's payload), `files`
  (safetensors files every rank reads, each its own shard) or `group` (the trainer's
  broadcast over the weights group; `refused`: only the verdict). Files and group stage on a
  thread of their own, so the rank keeps running steps meanwhile, as rank 0 does;
- `swap`: every rank says whether it staged (one all-gather on the CPU group); if every rank
  did, every rank writes its shard, else none does; `drop`: discard the staged update;
- `release` / `resume`: the memory calls, on this rank's memory;
- `group_init` / `group_destroy`: join (on a thread: joining waits for every member) or leave
  the trainer's weights group, as rank `rank_offset + tp rank`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch

from executor.models.hf_loader import lazy_safetensors
from executor.parallel import broadcast
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from executor.weights.catalog import TensorSpec, UpdatePlan
from executor.weights.group import GroupSpec, WeightsGroup
from executor.weights.staging import StagingArena
from executor.weights.writer import StagedUpdate

if TYPE_CHECKING:
    from executor.weights.control import WeightsControl

log = structlog.get_logger(__name__)

_ALIGN = 8  # each tensor's bytes start at a multiple of this in a payload
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def send(leader: TpLeader, header: dict[str, Any], payload: torch.Tensor | None = None) -> None:
    """Broadcast one weights command (call inside `leader.holding()`)."""
    leader.send(broadcast.Command(broadcast.WEIGHTS, weights=header, payload=payload))


def send_stage(
    leader: TpLeader,
    plan: UpdatePlan | None,
    kind: str,
    *,
    payload: torch.Tensor | None = None,
    **extra: Any,
) -> None:
    specs = (
        []
        if plan is None
        else [[s.name, str(s.dtype).removeprefix("torch."), list(s.shape)] for s in plan.specs]
    )
    version = "" if plan is None else plan.version
    send(
        leader, {"op": "stage", "kind": kind, "specs": specs, "version": version, **extra}, payload
    )


def agree(comm: TpComm, *, ok: bool) -> bool:
    """Whether every rank is ok (one all-gather on the CPU group; every rank calls it)."""
    rows = comm.all_gather_host(torch.tensor([0 if ok else 1], dtype=torch.int8))
    return all(int(r[0]) == 0 for r in rows)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Host tensors as one uint8 payload, each starting on an `_ALIGN` boundary."""
    parts = []
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        if raw.numel() % _ALIGN:
            parts.append(torch.zeros(_ALIGN - raw.numel() % _ALIGN, dtype=torch.uint8))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def unpack(payload: torch.Tensor, specs: tuple[TensorSpec, ...]) -> list[torch.Tensor]:
    out, offset = [], 0
    for spec in specs:
        n = spec.nbytes
        out.append(payload[offset : offset + n].view(spec.dtype).reshape(spec.shape))
        offset += -(-n // _ALIGN) * _ALIGN
    return out


def lazy_sources(plan: UpdatePlan, files: list[Path]) -> Iterator[Any]:
    """Each tensor of `plan` as a lazy slice of the files (a rank reads only its shard)."""
    slices = lazy_safetensors(files)
    for spec in plan.specs:
        yield slices[spec.name]


def receive(
    group: WeightsGroup,
    plan: UpdatePlan,
    src: int,
    verdict_rank: int | None = None,
    arena: StagingArena | None = None,
) -> Iterator[torch.Tensor]:
    """The verdict (accepted), then each tensor of `plan` as `src` broadcasts it (into
    `arena` when given: `WeightsGroup.receive`)."""
    group.verdict(0, group.spec.rank if verdict_rank is None else verdict_rank)
    yield from group.receive([(s.shape, s.dtype) for s in plan.specs], src, arena)


def spec_json(spec: GroupSpec) -> dict[str, Any]:
    return {
        "master_address": spec.master_address,
        "master_port": spec.master_port,
        "rank": spec.rank,
        "world_size": spec.world_size,
        "backend": spec.backend,
        "name": spec.name,
        "timeout_s": spec.timeout_s,
    }


class RankSide:
    """A worker rank's side of the weights commands (one per `WeightsControl`)."""

    def __init__(self, control: WeightsControl) -> None:
        self.control = control
        self._pending: Future[StagedUpdate | None] | None = None
        self._joining: Future[WeightsGroup] | None = None
        self._verdict_rank = 0

    def serve(self, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        op = header["op"]
        control = self.control
        if op == "stage":
            self._stage(header, payload)
        elif op == "swap":
            staged = self._take()
            if agree(control.comm, ok=staged is not None) and staged is not None:
                control.apply(staged)
        elif op == "drop":
            self._take()
        elif op == "release":
            control.release_local(tuple(header["tags"]))
        elif op == "resume":
            control.resume_local(tuple(header["tags"]), from_update=bool(header["from_update"]))
        elif op == "group_init":
            self._leave()
            fields = dict(header["spec"])
            self._verdict_rank = int(fields["rank"])
            fields["rank"] = int(fields["rank"]) + control.comm.rank
            spec = GroupSpec(**fields)
            self._joining = _on_thread(lambda: WeightsGroup(spec, control.device))
        elif op == "group_destroy":
            self._leave()
        else:
            raise ValueError(f"unknown weights command {op!r}")

    def _stage(self, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        self._take()  # nothing left from an update rank 0 gave up on
        kind = header["kind"]
        if kind == "refused":
            group = self._group()
            self._pending = _on_thread(lambda: _refused(group, self._verdict_rank))
            return
        specs = [TensorSpec(n, _DTYPES[d], tuple(s)) for n, d, s in header["specs"]]
        control = self.control
        # Rank 0 checked this header; the same checks pass here.
        plan = control.catalog.plan_update(specs, header["version"], max_bytes=sys.maxsize)
        if kind == "payload":
            assert payload is not None
            done: Future[StagedUpdate | None] = Future()
            done.set_result(control.stage(plan, unpack(payload, plan.specs)))
            self._pending = done
        elif kind == "files":
            files = [Path(f) for f in header["files"]]
            self._pending = _on_thread(lambda: control.stage(plan, lazy_sources(plan, files)))
        else:
            group, src, verdict = self._group(), int(header["src"]), self._verdict_rank
            received = receive(group, plan, src, verdict, control.staging)
            self._pending = _on_thread(lambda: control.stage(plan, received))

    def _take(self) -> StagedUpdate | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except BaseException as exc:
            log.warning("weight update staging failed on this rank", error=str(exc))
            return None

    def _group(self) -> WeightsGroup:
        if self._joining is None:
            raise RuntimeError("no weights group on this rank")
        return self._joining.result()

    def _leave(self) -> None:
        joining, self._joining = self._joining, None
        if joining is not None:
            try:
                joining.result().close()
            except BaseException as exc:
                log.warning("leaving the weights group", error=str(exc))


def _refused(group: WeightsGroup, verdict_rank: int) -> None:
    group.verdict(1, verdict_rank)
    return None


def _on_thread(fn: Any) -> Future[Any]:
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="weights-rank", daemon=True).start()
    return future
