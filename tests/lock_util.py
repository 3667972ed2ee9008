"""`is_held`: whether any thread holds a lock, for a plain Lock or a re-entrant RLock (which
has no `locked()` before Python 3.14, and whose own holder could acquire it again)."""

from __future__ import annotations

import threading
from typing import Any


def is_held(lock: Any) -> bool:
    """Try the lock from a fresh thread, without blocking; release it there if it was free."""
    got: list[bool] = []

    def probe() -> None:
        acquired = lock.acquire(blocking=False)
        if acquired:
            lock.release()
        got.append(acquired)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return not got[0]
