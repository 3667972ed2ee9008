"""Host memory in a mapping of its own: zero until written, committed off the caller's path,
given back to the system and taken again in place.

`torch.zeros` of a large CPU tensor faults every page in and then writes it once more, on the
calling thread. A private anonymous mapping reads as zero until written, so nothing needs
writing: `commit` asks the kernel to back every page now (`MADV_POPULATE_WRITE`, Linux 5.14),
which changes no content and so may run on a thread of its own (ctypes lets go of the
interpreter lock) while other threads write into the memory. `release` drops the pages
(`MADV_DONTNEED`): the resident set shrinks before it returns, the addresses stay (views and
the code that holds them stay valid), and the memory reads as zero again; `commit` takes it
back. Where the kernel has no populate advice, pages are backed as they are first written.
`resident_bytes` counts the pages backed now (`mincore`): what a release gives back.

The populate holds the memory-map lock, which a step's allocations and page faults wait for:
a background commit runs inside the caller's `yielding` context (a server's `IdleGate`: its
chunks wait while steps run) in chunks short enough that a step arriving mid-chunk waits little.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; not in Python's mmap module before 3.13
MADV_DONTNEED = 4
COMMIT_CHUNK = 4 << 20  # bytes populated under one hold of the memory-map lock


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc


def _madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) without the interpreter lock; 0 or the errno."""
    if _libc().madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


class HostPages:
    """`nbytes` of anonymous host memory as one uint8 tensor (`bytes`); views of it through
    `view`. `commit(background=True)` backs it on a thread; `release` stops that first."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # The tensor holds the mapping (torch.frombuffer keeps its buffer alive).
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        self.committed = False  # every page backed by the kernel (not only as written)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # `release`: a background commit ends at its next chunk

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.bytes.view(dtype).view(shape)

    def commit(
        self,
        *,
        background: bool = False,
        yielding: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        """Back every page now (its content unchanged), here or on a thread of its own that
        runs inside `yielding()`."""
        self.wait()
        if background:

            def populate() -> None:
                with yielding():
                    self._populate()

            self._thread = threading.Thread(target=populate, name="host-pages", daemon=True)
            self._thread.start()
        else:
            self._populate()

    def _populate(self) -> None:
        # In chunks: the kernel holds the process's memory-map lock while it populates, and
        # any allocation of another thread that maps memory waits for the chunk under way.
        start, end = self.bytes.data_ptr(), self.bytes.data_ptr() + self.nbytes
        for at in range(start, end, COMMIT_CHUNK):
            if self._stop.is_set():
                return
            if _madvise(at, min(COMMIT_CHUNK, end - at), MADV_POPULATE_WRITE):
                return
        self.committed = bool(self.nbytes)

    def resident_bytes(self) -> int:
        """The bytes of the mapping backed by memory now (`mincore`); `nbytes` where the
        kernel cannot say."""
        if not self.nbytes:
            return 0
        pages = -(-self.nbytes // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        if _libc().mincore(self.bytes.data_ptr(), self.nbytes, vec.ctypes.data) != 0:
            return self.nbytes
        return min(self.nbytes, int(np.count_nonzero(vec & 1)) * mmap.PAGESIZE)

    def wait(self) -> None:
        """Until a background commit has ended."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def release(self) -> int:
        """Give every page back to the system now; the memory reads as zero after. A
        background commit under way stops at its next chunk (what it backed is given back
        too), not committing pages only to drop them. The bytes given back: those resident
        just before."""
        self._stop.set()
        try:
            self.wait()
        finally:
            self._stop.clear()
        resident = self.resident_bytes()
        if self.nbytes and _madvise(self.bytes.data_ptr(), self.nbytes, MADV_DONTNEED):
            self.bytes.zero_()  # no advice: at least the content is what a release leaves
            resident = 0  # and nothing was given back
        self.committed = False
        return resident
