"""A child process that exits when its parent is gone (a tensor-parallel worker, the compile
worker): nothing is left running, holding memory or burning CPU, after its server died."""

from __future__ import annotations

import os
import threading
import time

PARENT_POLL_S = 0.5  # how often the child checks its parent is still there


def die_with_parent(poll_s: float = PARENT_POLL_S) -> None:
    """Exit (code 1) as soon as the parent is gone: a thread watches the parent pid.

    Not PR_SET_PDEATHSIG: it fires when the parent *thread* that forked exits (for a tp
    worker the server's model-loader thread, for the compile worker its capture thread), not
    the parent process."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
