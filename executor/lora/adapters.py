"""`LoraAdapters`: which adapter is in which slot, and the one place that loads and unloads.

A load is two halves: `read` (any thread: the files read and checked against the model and
the caps, this rank's cut prepared; nothing changes) and `install` (the device thread, between
two steps: a free slot taken, its buffers written, the name registered). `unload` (the device
thread) refuses an adapter that live rows use, naming them, and clears its slot. Every refusal
leaves every slot, name and row as it was.

Tensor parallel: rank 0 decides (names, slot, checks) and broadcasts the load or unload
(`executor.parallel.broadcast.LORA`); every rank reads its own cut of the files and writes its
own sites (`serve`, on the workers), then the ranks agree: when any rank failed, every rank
clears the slot and rank 0 refuses the load.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import structlog
import torch

from executor.core.errors import (
    LoraAdapterError,
    LoraNotFoundError,
    LoraSlotsFullError,
    LoraStateError,
)
from executor.core.lora_types import (
    MAX_PATH_BYTES,
    LoadedAdapter,
    LoraInfo,
    check_adapter_name,
)
from executor.lora.adapter_file import AdapterFile, read_adapter
from executor.lora.rows import LoraRows, RowSlots
from executor.lora.weights import LoraWeights
from executor.models.decoder_model import DecoderModel
from executor.parallel import broadcast
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader

log = structlog.get_logger(__name__)


class LoraAdapters:
    def __init__(
        self,
        model: DecoderModel,
        *,
        slots: int,
        max_rank: int,
        max_reqs: int,
        comm: TpComm,
        lock: AbstractContextManager[bool],
    ) -> None:
        """Attach `slots` adapter slots of rank `max_rank` to `model`. `lock`: the step lock
        (held while slots are written, so no step or background capture reads them half
        written)."""
        self.weights = LoraWeights(model, slots, max_rank)
        self.max_rank = max_rank
        self.comm = comm
        self.lock = lock
        self.leader: TpLeader | None = None  # rank 0 of a group, once it serves
        self.loaded: dict[int, LoadedAdapter] = {}  # slot -> adapter
        self.names: dict[str, int] = {}  # name -> slot (the rows feature reads it)
        self.table = RowSlots(max_reqs)
        self.rows = LoraRows(self.table, self.names)
        # Outcomes since start-up (metrics read them at scrape time).
        self.counts = {"loaded": 0, "load_refused": 0, "unloaded": 0, "unload_refused": 0}

    @property
    def slots(self) -> int:
        return self.weights.slots

    def info(self) -> LoraInfo:
        return LoraInfo(
            adapters=tuple(self.loaded[s] for s in sorted(self.loaded)),
            max_loras=self.slots,
            max_lora_rank=self.max_rank,
            target_modules=self.weights.targets,
        )

    def running_rows(self) -> dict[str, int]:
        """Live rows per loaded adapter (released rows hold none)."""
        per_slot = self.table.running(self.slots)
        return {a.name: int(per_slot[s]) for s, a in sorted(self.loaded.items())}

    # --- load ------------------------------------------------------------------------------
    def check_load(self, name: str, path: str) -> None:
        """The refusals a load can get before its files are read (any thread)."""
        try:
            check_adapter_name("name", name)
        except ValueError as exc:
            raise LoraAdapterError(str(exc)) from None
        if not path or len(path.encode()) > MAX_PATH_BYTES:
            raise LoraAdapterError(f"path: must be 1 to {MAX_PATH_BYTES} bytes")
        if name in self.names:
            raise LoraStateError(f"an adapter named {name!r} is loaded already: unload it first")
        if len(self.loaded) >= self.slots:
            raise LoraSlotsFullError(
                f"every adapter slot is taken (max_loras {self.slots}): unload one first"
            )

    def read(self, name: str, path: str) -> AdapterFile:
        """The adapter's files read and checked against the model (any thread; nothing
        changes). LoraAdapterError: it does not fit; LoraStateError: the name or slots."""
        try:
            self.check_load(name, path)
            return read_adapter(Path(path), self.weights.projections, self.max_rank)
        except (LoraAdapterError, LoraStateError) as exc:
            self.counts["load_refused"] += 1
            log.warning("lora adapter refused", adapter=name, path=path, reason=str(exc))
            raise

    def install(self, name: str, adapter: AdapterFile, started: float) -> LoadedAdapter:
        """Put a read adapter in a free slot (the device thread, between two steps);
        `started`: when its load began (time.perf_counter)."""
        try:
            self.check_load(name, adapter.path)
        except LoraStateError:
            self.counts["load_refused"] += 1
            raise
        slot = min(set(range(1, self.slots + 1)) - set(self.loaded))
        with self.lock:
            if self.leader is not None:
                with self.leader.holding():
                    self._send("load", name=name, path=adapter.path, slot=slot)
                    self._write_agreed(slot, adapter)
            else:
                self.weights.write(slot, adapter.modules)
        loaded = LoadedAdapter(
            name=name,
            path=adapter.path,
            slot=slot,
            rank=adapter.rank,
            target_modules=adapter.targets,
            load_seconds=time.perf_counter() - started,
        )
        self.loaded[slot] = loaded
        self.names[name] = slot
        self.counts["loaded"] += 1
        log.info(
            "lora adapter loaded",
            adapter=name,
            path=adapter.path,
            slot=slot,
            rank=adapter.rank,
            targets=",".join(adapter.targets),
            seconds=round(loaded.load_seconds, 4),
        )
        return loaded

    def load(self, name: str, path: str) -> LoadedAdapter:
        """`read` then `install`, on the calling thread (start-up, in-process use)."""
        started = time.perf_counter()
        return self.install(name, self.read(name, path), started)

    def _write_agreed(self, slot: int, adapter: AdapterFile) -> None:
        """Every rank writes its cut; then the group agrees (a failed rank: all clear)."""
        ok = True
        try:
            self.weights.write(slot, adapter.modules)
        except Exception:
            log.exception("lora adapter write failed", slot=slot)
            ok = False
        failed = self._agree(ok)
        if failed:
            self.weights.clear(slot)
            raise LoraAdapterError(
                f"adapter {adapter.path}: tensor-parallel rank(s) {failed} could not load "
                "it (their logs say why); nothing was loaded"
            )

    def _agree(self, ok: bool) -> list[int]:
        """The ranks that failed (every rank calls it, in the same order)."""
        rows = self.comm.all_gather_host(torch.tensor([int(ok)], dtype=torch.int8))
        return [r for r, row in enumerate(rows) if not int(row[0])]

    # --- unload ----------------------------------------------------------------------------
    def unload(self, name: str) -> LoadedAdapter:
        """Free the adapter's slot (the device thread, between two steps). Refused, nothing
        changed: an unknown name (LoraNotFoundError), rows using it (LoraStateError)."""
        slot = self.names.get(name)
        if slot is None:
            self.counts["unload_refused"] += 1
            known = ", ".join(sorted(self.names)) or "none"
            raise LoraNotFoundError(f"no adapter named {name!r} is loaded (loaded: {known})")
        rows = self.table.rows_using(slot)
        if rows:
            self.counts["unload_refused"] += 1
            shown = ", ".join(map(str, rows[:16])) + (", ..." if len(rows) > 16 else "")
            raise LoraStateError(
                f"adapter {name!r} is used by {len(rows)} live row(s): {shown}; release "
                "them (released_req_pool_indices) or set their adapter first"
            )
        with self.lock:
            if self.leader is not None:
                with self.leader.holding():
                    self._send("unload", name=name, slot=slot)
                    self.weights.clear(slot)
            else:
                self.weights.clear(slot)
        adapter = self.loaded.pop(slot)
        del self.names[name]
        self.counts["unloaded"] += 1
        log.info("lora adapter unloaded", adapter=name, slot=slot)
        return adapter

    # --- tensor parallel -------------------------------------------------------------------
    def _send(self, op: str, **fields: Any) -> None:
        assert self.leader is not None
        self.leader.send(broadcast.Command(broadcast.LORA, lora={"op": op, **fields}))

    def serve(self, command: dict[str, Any]) -> None:
        """A worker rank: rank 0's load or unload (`_send`)."""
        slot = int(command["slot"])
        if command["op"] == "unload":
            self.weights.clear(slot)
            return
        ok = True
        try:
            adapter = read_adapter(Path(command["path"]), self.weights.projections, self.max_rank)
            with self.lock:
                self.weights.write(slot, adapter.modules)
        except Exception:
            log.exception("lora adapter load failed on this rank", path=command["path"])
            ok = False
        if self._agree(ok):
            self.weights.clear(slot)
