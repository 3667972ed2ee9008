"""Free lists of request rows and KV slots, as a scheduler keeps them.

The executor never allocates; a scheduler does, within the ranges `GetInfo` reports
(rows 1..max_reqs, slots 1..kv_slots; 0 is reserved for padding in both).
"""

from __future__ import annotations


class OutOfCapacityError(RuntimeError):
    """No free row, or fewer free slots than asked for."""


def _take(free: list[int], n: int) -> list[int]:
    """The last `n` entries of a free list (popped from the end), lowest number first."""
    if n == 0:
        return []
    taken = free[-n:]
    del free[-n:]
    taken.reverse()
    return taken


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
        return _take(self._free_slots, n)

    def free(self, row: int, slots: list[int]) -> None:
        self._free_rows.append(row)
        self._free_slots.extend(reversed(slots))


class FutureSlotAllocator:
    """The free list of future-token slots (1..future_slots from `GetInfo`; 0 is reserved).

    A scheduler that overlaps steps takes one slot per request per step (the batch's
    `future_token_slots`); the next step refers to the token as input id `-slot`. Give a
    slot back with `release` once the batch that reads it has been built: the next batch
    sends it in `released_future_slots` (`take_released`), which the executor applies before
    that batch runs, so the slot may be assigned again in that very batch.
    """

    def __init__(self, future_slots: int) -> None:
        if future_slots < 1:
            raise ValueError(
                f"the executor has no future-token slots (future_slots = {future_slots})"
            )
        self.future_slots = future_slots
        self._free = list(range(future_slots, 0, -1))
        self._released: list[int] = []

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def has_released(self) -> bool:
        """Slots released since the last batch (the next one must carry them)."""
        return bool(self._released)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfCapacityError(
                f"asked for {n} future slots, {len(self._free)} free (the executor's "
                f"future_slots is {self.future_slots}; raise --future-slots)"
            )
        return _take(self._free, n)

    def release(self, slots: list[int]) -> None:
        """Slots no batch built from now on reads: sent with the next batch."""
        self._released.extend(slots)

    def take_released(self) -> list[int]:
        """The slots the next batch releases; they are free for that batch to assign."""
        released, self._released = self._released, []
        self._free.extend(reversed(released))
        return released
