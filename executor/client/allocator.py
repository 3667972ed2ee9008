"""Free lists of request rows and KV slots, as a scheduler keeps them.

The executor never allocates; a scheduler does, within the ranges `GetInfo` reports
(rows 1..max_reqs, slots 1..kv_slots; 0 is reserved for padding in both).
"""

from __future__ import annotations


class OutOfCapacityError(RuntimeError):
    """No free row, or fewer free slots than asked for."""


class KVAllocator:
    def __init__(self, max_reqs: int, kv_slots: int) -> None:
        # Popped from the end: the lowest numbers go first.
        self._free_rows = list(range(max_reqs, 0, -1))
        self._free_slots = list(range(kv_slots, 0, -1))
        self.max_reqs = max_reqs
        self.kv_slots = kv_slots

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def can_admit(self, num_slots: int) -> bool:
        return bool(self._free_rows) and len(self._free_slots) >= num_slots

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise OutOfCapacityError("no free request row")
        return self._free_rows.pop()

    def alloc_slots(self, n: int) -> list[int]:
        if n > len(self._free_slots):
            raise OutOfCapacityError(f"asked for {n} KV slots, {len(self._free_slots)} free")
        if n == 0:
            return []
        taken = self._free_slots[-n:]
        del self._free_slots[-n:]
        taken.reverse()
        return taken

    def free(self, row: int, slots: list[int]) -> None:
        self._free_rows.append(row)
        self._free_slots.extend(reversed(slots))
