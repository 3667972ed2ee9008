"""`KVTransfer`: reads a request's K/V out of the slot pool and writes an import into it.

Runs on the thread that owns the device, between two steps (the server queues each call as a
device job; `lock` is the step lock, so a background graph capture never interleaves). An
import is checked whole before it writes (the row is free, every slot in range and held by
no live row, the transfer id new) and then written as an EXTEND of those tokens would have
left the cache: K/V at the slots, `req_to_token[row, :n]`, the row's resident length, the
slot owners and each slot's token. A failure while writing restores what it had changed.

Imports are exactly-once by `transfer_id`: the last `memory` applied ids are kept with what
they wrote; a retry of the same import is answered `replayed` and applies nothing; an id
reused for a different import is refused.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from executor.controls.slot_tokens import UNKNOWN, SlotTokens
from executor.errors import BatchValidationError, KVStateError
from executor.kv_cache import KVPool, ReqToTokenPool
from executor.kv_transfer.layout import ChunkSpec, KVLayout, KVTransferLimits
from executor.kv_transfer.staging import ImportStaging
from ops.host_transfer import to_device, to_host


@dataclass(frozen=True)
class ImportResult:
    transfer_id: int
    row: int
    num_slots: int
    nbytes: int
    replayed: bool = False  # a retry of an import already applied: nothing written


def import_fingerprint(staging: ImportStaging) -> bytes:
    """What an import writes (row, slots, tokens): tells a retry from a reused id."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.int64(staging.header.row).tobytes())
    h.update(staging.slots.tobytes())
    if staging.header.token_ids is not None:
        h.update(staging.header.token_ids.astype(np.int64).tobytes())
    return h.digest()


class KVTransfer:
    def __init__(
        self,
        pool: ReqToTokenPool,
        kv: KVPool,
        slot_tokens: SlotTokens,
        layout: KVLayout,
        limits: KVTransferLimits,
        lock: threading.Lock,
        *,
        rank: int = 0,
        memory: int = 1024,
    ) -> None:
        self.pool = pool
        self.kv = kv
        self.slot_tokens = slot_tokens
        self.layout = layout
        self.limits = limits
        self.lock = lock
        self.rank = rank
        self.memory = memory
        self._applied: OrderedDict[int, tuple[bytes, ImportResult]] = OrderedDict()

    # --- export -----------------------------------------------------------------------------
    def check_export(self, slots: np.ndarray) -> None:
        """Refuse exporting a slot no live row holds (its bytes mean nothing)."""
        owners = self.pool.owners
        if owners is None:
            return
        free = owners.refs[slots] == 0
        if free.any():
            i = int(np.flatnonzero(free)[0])
            raise KVStateError(
                f"runs: slot {int(slots[i])} (transfer slot {i}) is held by no live row; export "
                "only slots of a request the executor holds"
            )

    def read_tokens(self, slots: np.ndarray) -> np.ndarray:
        """The token recorded at each slot (-1: unknown). Device thread."""
        with self.lock:
            idx = torch.from_numpy(slots).to(self.slot_tokens.tokens.device)
            return to_host(self.slot_tokens.tokens[idx], "kv_export").numpy()

    def read_chunk(self, slots: np.ndarray, spec: ChunkSpec) -> bytes:
        """One chunk's bytes (`[count, kv_heads, head_dim]` of this rank). Device thread."""
        with self.lock:
            cache = self.kv.k if spec.kind == 0 else self.kv.v
            part = slots[spec.first : spec.first + spec.count]
            idx = torch.from_numpy(part).to(cache.device)
            values = cache[spec.layer].index_select(0, idx)  # [count, Hk, D]
            return to_host(values, "kv_export").view(torch.uint8).numpy().tobytes()

    # --- import -----------------------------------------------------------------------------
    def check_import(self, staging: ImportStaging) -> ImportResult | None:
        """The stored result when this is a retry of an applied import; raises when the cache's
        state forbids it. Changes nothing."""
        header, slots = staging.header, staging.slots
        seen = self._applied.get(header.transfer_id)
        if seen is not None:
            fp, result = seen
            if fp != import_fingerprint(staging):
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
                f"header.req_pool_index: row {header.row} holds {held} tokens of a live request; "
                "import into a free row (release it first)"
            )
        owners = self.pool.owners
        if owners is not None:
            busy = owners.refs[slots] > 0
            if busy.any():
                i = int(np.flatnonzero(busy)[0])
                raise KVStateError(
                    f"header.runs: slot {int(slots[i])} (position {i}) holds the KV of a live "
                    "request; import into free slots only"
                )
        return None

    def apply_import(self, staging: ImportStaging) -> ImportResult:
        """Check, then write the import all-or-nothing. Device thread."""
        with self.lock:
            replay = self.check_import(staging)
            if replay is not None:
                return replay
            self._write(staging)
            header = staging.header
            result = ImportResult(
                header.transfer_id, header.row, int(staging.slots.size), staging.nbytes
            )
            self._applied[header.transfer_id] = (import_fingerprint(staging), result)
            while len(self._applied) > self.memory:
                self._applied.popitem(last=False)
            return result

    def _write(self, staging: ImportStaging) -> None:
        header, slots = staging.header, staging.slots
        n, row, device = int(slots.size), header.row, self.kv.device
        idx = torch.from_numpy(slots).to(device)
        table = self.pool.req_to_token
        k_new = to_device(staging.k[self.rank], device, "kv_import")  # [L, n, Hk, D]
        v_new = to_device(staging.v[self.rank], device, "kv_import")
        tokens = (
            torch.from_numpy(header.token_ids.astype(np.int64))
            if header.token_ids is not None
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
            self.slot_tokens.tokens[idx] = tokens.to(device)
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
