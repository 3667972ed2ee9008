"""`KVTransfer`: reads a request's K/V out of the slot pool and writes an import into it.

Runs on the thread that owns the device, between two steps (the server queues each call as a
device job; `lock` is the step lock, so a background graph capture never interleaves). An
import is checked whole before it writes (the row is free, every slot in range and held by
no live row, the transfer id new) and then written as an EXTEND of those tokens would have
left the cache: K/V at the slots, `req_to_token[row, :n]`, the row's resident length, the
slot owners and each slot's token. A failure while writing restores what it had changed.

Tensor parallel: rank 0 (the one with the RPCs) checks and remembers; each chunk is read
by every rank from its own heads and gathered on rank 0 (`kv_read`), and a checked import
is broadcast with every rank's bytes and each rank writes its own heads (`kv_write`), the
way a step is broadcast (`executor.parallel.broadcast`).

Imports are exactly-once by `transfer_id`: the last `limits.transfer_memory` applied ids are kept with what
they wrote; a retry of the same import is answered `replayed` and applies nothing; an id
reused for a different import is refused.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from executor.controls.slot_tokens import UNKNOWN, SlotTokens
from executor.core.errors import BatchValidationError, KVStateError
from executor.kv_cache import KVPool, ReqToTokenPool
from executor.kv_transfer.layout import ChunkSpec, KVLayout, KVTransferLimits
from executor.kv_transfer.staging import ImportHeader, ImportStaging
from executor.parallel import broadcast
from executor.parallel.broadcast import Command
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from ops.device_scope import device_scope
from ops.host_transfer import to_device, to_host


@dataclass(frozen=True)
class ImportResult:
    transfer_id: int
    row: int
    num_slots: int
    nbytes: int
    replayed: bool = False  # a retry of an import already applied: nothing written


def import_fingerprint(header: ImportHeader, slots: np.ndarray) -> bytes:
    """What an import writes (row, slots, tokens): tells a retry from a reused id."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.int64(header.row).tobytes())
    h.update(slots.tobytes())
    if header.token_ids is not None:
        h.update(header.token_ids.astype(np.int64).tobytes())
    return h.digest()


class KVTransfer:
    def __init__(
        self,
        pool: ReqToTokenPool,
        kv: KVPool,
        slot_tokens: SlotTokens,
        layout: KVLayout,
        limits: KVTransferLimits,
        lock: threading.RLock,
        *,
        comm: TpComm | None = None,
    ) -> None:
        self.pool = pool
        self.kv = kv
        self.slot_tokens = slot_tokens
        self.layout = layout
        self.limits = limits
        self.lock = lock
        self.comm = comm or TpComm()
        self.rank = self.comm.rank
        self.leader: TpLeader | None = None  # rank 0 of a group, once it serves
        # Raises when the cache may not be read or written now (its memory is released).
        self.guard: Callable[[], None] = lambda: None
        self._applied: OrderedDict[int, tuple[bytes, ImportResult]] = OrderedDict()

    # --- export -----------------------------------------------------------------------------
    def check_export(self, slots: np.ndarray) -> None:
        """Refuse exporting a slot no live row holds (its bytes mean nothing)."""
        self.guard()
        owners = self.pool.owners
        if owners is None:
            return
        free = owners.refs[slots] == 0
        if free.any():
            i = int(np.flatnonzero(free)[0])
            raise KVStateError(
                f"runs: transfer slot {i} is held by no live row; export only slots of a "
                "request the executor holds"
            )

    def read_tokens(self, slots: np.ndarray) -> np.ndarray:
        """The token recorded at each slot (-1: unknown). Device thread."""
        with self.lock, device_scope(self.kv.device):
            idx = to_device(torch.from_numpy(slots), self.slot_tokens.tokens.device, "kv_export")
            return to_host(self.slot_tokens.tokens[idx], "kv_export").numpy()

    def read_chunk(self, slots: np.ndarray, spec: ChunkSpec) -> list[bytes]:
        """One chunk's bytes on every rank (`[count, kv_heads, head_dim]` each, rank order).
        Device thread (rank 0)."""
        part = slots[spec.first : spec.first + spec.count]
        with self.lock, device_scope(self.kv.device):
            self.guard()
            if self.leader is None:
                local = self._read_local(part, spec.layer, spec.kind)
                return [to_host(local, "kv_export").numpy().tobytes()]
            with self.leader.holding():
                kv = {"slots": part.tolist(), "layer": spec.layer, "kind": spec.kind}
                self.leader.send(Command(broadcast.KV_READ, kv=kv))
                return self._gather(self._read_local(part, spec.layer, spec.kind))

    def serve_read(self, kv: dict[str, object]) -> None:
        """A worker rank: its part of rank 0's `kv_read`."""
        part = np.asarray(kv["slots"], dtype=np.int64)
        with device_scope(self.kv.device):
            self._gather(self._read_local(part, int(kv["layer"]), int(kv["kind"])))  # type: ignore[call-overload]

    def _read_local(self, part: np.ndarray, layer: int, kind: int) -> torch.Tensor:
        """This rank's heads of `part` in one (layer, kind), as flat bytes on the device."""
        cache = self.kv.k if kind == 0 else self.kv.v
        idx = to_device(torch.from_numpy(part), cache.device, "kv_export")
        return cache[layer].index_select(0, idx).contiguous().view(-1).view(torch.uint8)

    def _gather(self, local: torch.Tensor) -> list[bytes]:
        """Every rank's bytes on rank 0 (one all-gather; the same shape on every rank)."""
        everyone = self.comm.all_gather_last(local)  # [tp * nbytes]
        host = to_host(everyone, "kv_export").numpy()
        n = local.numel()
        return [host[r * n : (r + 1) * n].tobytes() for r in range(self.comm.size)]

    # --- import -----------------------------------------------------------------------------
    def precheck_import(self, header: ImportHeader, slots: np.ndarray) -> ImportResult | None:
        """`check_import` as soon as the header arrives, before any byte is staged: a refusal
        or a retry is answered without reading the chunks. Device thread."""
        with self.lock:
            return self.check_import(header, slots)

    def check_import(self, header: ImportHeader, slots: np.ndarray) -> ImportResult | None:
        """The stored result when this is a retry of an applied import; raises when the cache's
        state forbids it. Changes nothing."""
        self.guard()
        seen = self._applied.get(header.transfer_id)
        if seen is not None:
            fp, result = seen
            if fp != import_fingerprint(header, slots):
                raise BatchValidationError(
                    "header.transfer_id",
                    f"{header.transfer_id} was applied to a different import; use a fresh id per transfer",
                )
            return ImportResult(
                result.transfer_id, result.row, result.num_slots, result.nbytes, True
            )
        held = int(self.pool.resident_lens[header.row])
        if held:
            raise KVStateError(
                f"header.req_pool_index: row {header.row} holds a live request; import into a "
                "free row (release it first)"
            )
        owners = self.pool.owners
        if owners is not None:
            busy = owners.refs[slots] > 0
            if busy.any():
                i = int(np.flatnonzero(busy)[0])
                raise KVStateError(
                    f"header.runs: position {i} names a slot that holds the KV of a live "
                    "request; import into free slots only"
                )
        return None

    def apply_import(self, staging: ImportStaging) -> ImportResult:
        """Check, then write the import all-or-nothing. Device thread."""
        with self.lock:
            replay = self.check_import(staging.header, staging.slots)
            if replay is not None:
                return replay
            header = staging.header
            with device_scope(self.kv.device):
                if self.leader is not None:
                    with self.leader.holding():
                        kv = {
                            "row": header.row,
                            "slots": staging.slots.tolist(),
                            "tokens": None
                            if header.token_ids is None
                            else header.token_ids.tolist(),
                        }
                        payload = torch.stack([staging.k, staging.v], 1)  # [tp, 2, L, n, Hk, D]
                        self.leader.send(
                            Command(broadcast.KV_WRITE, kv=kv, payload=_bytes(payload))
                        )
                        self._write(
                            header.row, staging.slots, header.token_ids, staging.k[0], staging.v[0]
                        )
                        self.comm.ping()  # every rank wrote its heads
                else:
                    self._write(
                        header.row, staging.slots, header.token_ids, staging.k[0], staging.v[0]
                    )
            result = ImportResult(
                header.transfer_id, header.row, int(staging.slots.size), staging.nbytes
            )
            self._applied[header.transfer_id] = (import_fingerprint(header, staging.slots), result)
            while len(self._applied) > self.limits.transfer_memory:
                self._applied.popitem(last=False)
            return result

    def serve_write(self, kv: dict[str, object], payload: torch.Tensor) -> None:
        """A worker rank: write its heads of an import rank 0 checked and broadcast."""
        slots = np.asarray(kv["slots"], dtype=np.int64)
        tokens = None if kv["tokens"] is None else np.asarray(kv["tokens"], dtype=np.int64)
        lay = self.layout
        shape = (lay.tp_size, 2, lay.num_layers, slots.size, lay.kv_heads, lay.head_dim)
        staged = payload.view(lay.dtype).view(shape)[self.rank]
        with device_scope(self.kv.device):
            self._write(int(kv["row"]), slots, tokens, staged[0], staged[1])  # type: ignore[call-overload]
        self.comm.ping()

    def _write(
        self,
        row: int,
        slots: np.ndarray,
        token_ids: np.ndarray | None,
        k_host: torch.Tensor,
        v_host: torch.Tensor,
    ) -> None:
        """`k_host`/`v_host`: this rank's heads, [L, n, Hk, D] on the host."""
        n, device = int(slots.size), self.kv.device
        idx = to_device(torch.from_numpy(slots), device, "kv_import")
        table = self.pool.req_to_token
        k_new = to_device(k_host, device, "kv_import")  # [L, n, Hk, D]
        v_new = to_device(v_host, device, "kv_import")
        tokens = (
            torch.from_numpy(token_ids.astype(np.int64))
            if token_ids is not None
            else torch.full((n,), UNKNOWN, dtype=torch.int64)
        )
        # The old values of everything written, to restore on a failure part-way.
        old_k = self.kv.k[:, idx].clone()
        old_v = self.kv.v[:, idx].clone()
        old_row = table[row, :n].clone()
        old_tokens = self.slot_tokens.tokens[idx].clone()
        try:
            self.kv.k[:, idx] = k_new
            self.kv.v[:, idx] = v_new
            table[row, :n] = idx.to(torch.int32)
            self.slot_tokens.tokens[idx] = to_device(tokens, device, "kv_import")
        except BaseException:  # a device write failed part-way: put back what it changed
            self.kv.k[:, idx] = old_k
            self.kv.v[:, idx] = old_v
            table[row, :n] = old_row
            self.slot_tokens.tokens[idx] = old_tokens
            raise
        # NOTE: host bookkeeping last: numpy on indices checked above, it cannot fail half-way.
        owners = self.pool.owners
        if owners is not None:
            owners.table[row, :n] = slots
            np.add.at(owners.refs, slots, 1)
        self.pool.resident_lens[row] = n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A host tensor's bytes, flat (uint8): how the payload of a broadcast travels."""
    return t.contiguous().view(-1).view(torch.uint8)
