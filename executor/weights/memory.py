"""`TaggedMemory`: the model's weights and the KV cache given back to the system by tag, and
taken back.

A release keeps every tensor object and shrinks its storage to nothing
(`untyped_storage().resize_(0)`); a resume grows it back to its size and zeroes it. Views,
the modules that hold the tensors and the code that reads them (eager steps, the CPU graph
backends, which read the parameters at each replay) are untouched; the memory's address may
change, so CUDA graphs, which captured addresses, are captured again after a resume (the
caller's: `executor.weights.control`). oneDNN-packed weights, which have no storage, are
dropped from their table and packed again (`PackedWeight.release` / `restore`). The CPU's KV
cache, a mapping of its own (`ops.host_pages`), is given back and taken again in place. A
release's figure is what it gave back: the KV mapping counts its resident pages (it is backed
in the server's idle time); a resume's is all the tag takes.

"Back to the system" is checked, not assumed: on CUDA the caching allocator's free blocks
are returned (`empty_cache`) so `mem_get_info` counts them free; on the CPU glibc is asked to
return freed heap pages (`malloc_trim`), since a freed block below its mmap threshold would
otherwise stay in the resident set. `resident_bytes` and `device_free_bytes` are the figures
the tests and benchmarks read.

On CUDA each tag's memory lives in a memory pool of its own (`torch.cuda.MemPool`): the caching
allocator returns a segment to the driver only when every block in it is free, and a weight
that shared a segment with anything else (activations, another executor's blocks) would keep
that segment mapped. `own_pools` moves each tag into its pool once, before any graph captures
the addresses; a release frees the pool's every block and retires the pool, a resume allocates
into a new one. The pools are held by `ops.allocator.POOLS`, which never destroys one (a
pool's destructor can abort the process): a retired pool's segments go back at the next
`empty_cache`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from torch import nn

from executor.core.errors import ModelStateError
from executor.kv_cache import KVPool
from executor.models.layers import PackedLinear
from ops.allocator import POOLS
from ops.device_scope import resolve_index
from ops.host_pages import HostPages

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)

log = structlog.get_logger(__name__)

Allocating = Callable[[], AbstractContextManager[Any]]  # allocations made inside go to a pool


def resident_bytes() -> int:
    """This process's resident set (Linux: /proc/self/statm), in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_free_bytes(device: torch.device) -> int:
    """Free device memory as the driver counts it (CUDA); on a CPU, minus the resident set
    (so that "more free" means the same on both)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return -resident_bytes()


def host_bytes(nbytes: int) -> torch.Tensor:
    """A fresh uint8 host buffer, written once (a staging buffer): a bytearray's zeroed pages,
    which fill faster on first touch than a large `torch.empty` block
    (benchmarks/weight_update.py)."""
    return (
        torch.frombuffer(bytearray(nbytes), dtype=torch.uint8)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def give_back(device: torch.device) -> None:
    """Return freed memory to the system now (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def new_pool(device: torch.device) -> Any:
    """A memory pool of its own on CUDA (`torch.cuda.MemPool`); None elsewhere."""
    return torch.cuda.MemPool() if device.type == "cuda" else None


def allocating_in(pool: Any) -> Allocating:
    """What routes this thread's allocations into `pool` (None: the default allocator)."""
    if pool is None:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def routed() -> Iterator[None]:
        with torch.cuda.use_mem_pool(pool):
            yield

    return routed


def move_storages(
    storages: list[tuple[torch.Tensor, int]], allocating: Allocating, *, keep: bool
) -> None:
    """Give each storage a new allocation made inside `allocating`, in place: the storage
    objects (and so every tensor and view over them) stay, their contents are copied across
    (`keep`) or zeroed. One storage at a time, so the extra memory is the largest one's."""
    with torch.no_grad():
        for t, nbytes in storages:
            storage = t.untyped_storage()
            old = _bytes(storage).clone() if keep else None
            storage.resize_(0)
            with allocating():
                storage.resize_(nbytes)
            new = _bytes(storage)
            if old is None:
                new.zero_()
            else:
                new.copy_(old)


@dataclass(frozen=True)
class MemoryReport:
    """Which memory is released now, the KV epoch, and what a call freed or took back."""

    released: tuple[str, ...]
    kv_epoch: int
    awaiting_update: bool
    nbytes: int = 0  # what the call freed or took back (this rank)
    seconds: float = 0.0


@dataclass
class _Held:
    """The storages of one tag while released: one tensor per storage and its size."""

    storages: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    packed: list[PackedLinear] = field(default_factory=list)
    pages: HostPages | None = None  # the CPU's KV cache: a mapping given back in place
    freed: int = 0  # released: the bytes its release gave back

    @property
    def allocator_bytes(self) -> int:
        """The storages' and packed weights' bytes (resident whenever held)."""
        return sum(n for _, n in self.storages) + sum(m.packed.nbytes for m in self.packed)

    @property
    def allocated(self) -> int:
        """What the tag's memory takes when it is all backed (a resume's figure)."""
        return self.allocator_bytes + (self.pages.nbytes if self.pages is not None else 0)

    @property
    def resident(self) -> int:
        """What it holds now: the KV mapping counts only its backed pages (it is committed in
        the server's idle time, and pages a step wrote are backed before)."""
        pages = self.pages.resident_bytes() if self.pages is not None else 0
        return self.allocator_bytes + pages


class TaggedMemory:
    """Releases and resumes the memory of `weights` (every tensor of the model's state, and
    its packed weights) and `kv_cache` (the K and V pools). Runs between two steps."""

    def __init__(self, model: nn.Module, kv_pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self._held: dict[str, _Held] = {}
        self._pools: dict[str, int] = {}  # CUDA: each tag's own memory pool (its key in POOLS)

    def own_pools(self) -> None:
        """On CUDA, move each tag's memory into a pool of its own (weights copied, the KV
        cache zeroed); nothing elsewhere. Before any graph captures the addresses. A tag whose
        memory cannot be released stays where it is (its release will say why)."""
        if self.device.type != "cuda":
            return
        POOLS.reap()  # the pools of executors gone since: their segments go back below
        for tag in TAGS:
            try:
                held = self._collect(tag)
            except ModelStateError as e:
                log.warning("memory stays in the shared allocator pool", tag=tag, why=str(e))
                continue
            pool = new_pool(self.device)
            move_storages(held.storages, allocating_in(pool), keep=tag == WEIGHTS)
            self._pools[tag] = POOLS.keep(pool, self, self._index)
            give_back(self.device)  # the storages' old segments

    @property
    def _index(self) -> int:
        """The CUDA device's index (its pools are the allocator's of that device)."""
        return resolve_index(self.device).index or 0

    @property
    def any_released(self) -> bool:
        return bool(self._held)

    @property
    def released(self) -> tuple[str, ...]:
        return tuple(t for t in TAGS if t in self._held)

    def _tensors(self, tag: str) -> list[tuple[str, torch.Tensor]]:
        if tag == KV_CACHE:
            return [("k", self.kv_pool.k), ("v", self.kv_pool.v)]
        return list(self.model.state_dict(keep_vars=True).items())

    def nbytes(self, tag: str) -> int:
        """Bytes the tag holds in memory now (released: what its release gave back)."""
        if tag in self._held:
            return self._held[tag].freed
        return self._collect(tag).resident

    def check(self, tag: str) -> None:
        """Raise what `release(tag)` would raise before it frees anything."""
        self._collect(tag)

    def _collect(self, tag: str) -> _Held:
        if tag == KV_CACHE and self.kv_pool.pages is not None:
            return _Held(pages=self.kv_pool.pages)
        held = _Held()
        seen: set[int] = set()
        for name, t in self._tensors(tag):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or storage.nbytes() == 0:
                continue
            seen.add(ptr)
            if not storage.resizable():
                raise ModelStateError(
                    f"{tag}: {name}'s memory cannot be released (its storage is not "
                    "resizable: memory-mapped or borrowed)"
                )
            held.storages.append((t, storage.nbytes()))
        if tag == WEIGHTS:
            held.packed = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        return held

    def release(self, tag: str) -> int:
        """Give `tag`'s memory back to the system; the bytes freed (what was resident).
        Checked whole first."""
        if tag in self._held:
            return 0
        held = self._collect(tag)  # raises before anything is freed
        held.freed = held.allocator_bytes
        for t, _ in held.storages:
            t.untyped_storage().resize_(0)
        for m in held.packed:
            m.packed.release()
        if held.pages is not None:
            held.freed += held.pages.release()  # its resident pages
        self._held[tag] = held
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        key = self._pools.pop(tag, None)
        if key is not None:
            POOLS.discard(key)  # retired: its segments, every block free, go back below
        give_back(self.device)
        return held.freed

    def resume(self, tag: str) -> int:
        """Take `tag`'s memory back, zeroed (packed weights: packed zeros); the bytes."""
        held = self._held.pop(tag, None)
        if held is None:
            return 0
        pool = new_pool(self.device)
        move_storages(held.storages, allocating_in(pool), keep=False)
        if pool is not None:
            self._pools[tag] = POOLS.keep(pool, self, self._index)
        if held.pages is not None:
            held.pages.commit()  # the same addresses, zero since the release
        with torch.no_grad():
            for m in held.packed:
                zeros = torch.zeros(m.out_features, m.in_features)
                m.packed.restore(m.packed.pack(zeros))
        return held.allocated
