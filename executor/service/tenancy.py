"""Which caller each row and slot belongs to, so that callers who differ in identity (named
tokens, client certificates: `AccessRules.tenants`) cannot read or change each other's requests.

- A row is owned by the identity whose batch (or import) started it, until it is released.
  A batch that runs or releases a row another identity owns is refused PERMISSION_DENIED;
  so is an export, push or import that names one.
- A slot remembers the identity that last wrote K/V into it. A batch may read a prefix
  (`prefix_cache_loc`) only from slots its own identity wrote, and an export or push only
  sends such slots: a freed slot of another caller's request reads the same as a held one.

Everything runs on the device thread (the only writer of rows and slots), on host numpy:
a check is a few array lookups per batch, and nothing runs when callers are not told apart.
"""

from __future__ import annotations

import numpy as np
import torch

from executor.core.forward_batch import ForwardBatch
from executor.kv_cache import ReqToTokenPool
from executor.service.access import PermissionDeniedError

_NONE = 0  # no owner / no writer


def _ints(t: torch.Tensor | None) -> np.ndarray:
    """A host index tensor as int64 (an empty array for None or a non-integer tensor: the
    batch's validation refuses those)."""
    if t is None or t.dtype.is_floating_point or t.dtype.is_complex or t.device.type != "cpu":
        return np.zeros(0, dtype=np.int64)
    return t.reshape(-1).numpy().astype(np.int64, copy=False)


class RowTenants:
    def __init__(self, pool: ReqToTokenPool, kv_slots: int) -> None:
        self.pool = pool
        self.owner = np.zeros(pool.max_reqs + 1, dtype=np.int32)  # per row
        self.writer = np.zeros(kv_slots + 1, dtype=np.int32)  # per slot
        self._ids: dict[str, int] = {}

    def id_of(self, identity: str) -> int:
        found = self._ids.get(identity)
        if found is None:
            found = self._ids[identity] = len(self._ids) + 1
        return found

    def _rows(self, t: torch.Tensor | None) -> np.ndarray:
        rows = _ints(t)
        return rows[(rows >= 1) & (rows < self.owner.size)]

    def _slots(self, t: torch.Tensor | None) -> np.ndarray:
        slots = _ints(t)
        return slots[(slots >= 1) & (slots < self.writer.size)]

    # --- Forward -------------------------------------------------------------------------
    def check_batch(self, batch: ForwardBatch, identity: str) -> None:
        """Refuse a batch that runs or releases another identity's row, or reads a prefix
        another identity wrote. Changes nothing."""
        who = self.id_of(identity)
        for name, rows in (
            ("req_pool_indices", self._rows(batch.req_pool_indices)),
            ("released_req_pool_indices", self._rows(batch.released_req_pool_indices)),
        ):
            owners = self.owner[rows]
            foreign = (self.pool.resident_lens[rows] > 0) & (owners != _NONE) & (owners != who)
            if foreign.any():
                raise PermissionDeniedError(
                    f"{name}: row {int(rows[np.flatnonzero(foreign)[0]])} holds a request "
                    "another caller started; a caller runs and releases only its own rows"
                )
        prefix = self._slots(batch.prefix_cache_loc)
        if prefix.size:
            writers = self.writer[prefix]
            if ((writers != _NONE) & (writers != who)).any():
                raise PermissionDeniedError(
                    "prefix_cache_loc: names a slot whose K/V another caller wrote; a prefix is "
                    "read only from slots this caller's own requests wrote"
                )

    def record_batch(self, batch: ForwardBatch, identity: str) -> None:
        """After an applied batch: its live rows are the caller's, released ones nobody's,
        its new tokens' slots written by the caller."""
        who = self.id_of(identity)
        rows = np.concatenate(
            [self._rows(batch.req_pool_indices), self._rows(batch.released_req_pool_indices)]
        )
        self.owner[rows] = np.where(self.pool.resident_lens[rows] > 0, who, _NONE)
        self.writer[self._slots(batch.out_cache_loc)] = who

    # --- the KV data plane ---------------------------------------------------------------
    def check_slots(self, slots: np.ndarray, identity: str, field: str) -> None:
        """Refuse reading (export, push) a slot the caller's requests did not write."""
        who = self.id_of(identity)
        mine = self.writer[slots] == who
        if not mine.all():
            i = int(np.flatnonzero(~mine)[0])
            raise PermissionDeniedError(
                f"{field}: transfer slot {i} holds no K/V of this caller's requests; export "
                "and push only slots of requests this caller started"
            )

    def check_import(self, row: int, slots: np.ndarray, identity: str) -> None:
        """Refuse an import into a row, or slots, another identity's live requests hold."""
        who = self.id_of(identity)
        owner = int(self.owner[row])
        if self.pool.resident_lens[row] > 0 and owner not in (_NONE, who):
            raise PermissionDeniedError(
                f"header.req_pool_index: row {row} holds a request another caller started"
            )
        owners = self.pool.owners
        if owners is None:
            return
        writers = self.writer[slots]
        foreign = (owners.refs[slots] > 0) & (writers != _NONE) & (writers != who)
        if foreign.any():
            raise PermissionDeniedError(
                f"header.runs: position {int(np.flatnonzero(foreign)[0])} names a slot a "
                "request of another caller holds"
            )

    def record_import(self, row: int, slots: np.ndarray, identity: str) -> None:
        who = self.id_of(identity)
        self.owner[row] = who
        self.writer[slots] = who
