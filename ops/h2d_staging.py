"""One host-to-device copy per step: named host tensors packed into one pinned buffer.

A step's host-side inputs (index fields, sampling parameters, the row-table cells) would
otherwise cross as a dozen small copies, each from pageable memory, which on CUDA is a
stream synchronize apiece. :class:`H2DStaging` packs them into one reusable host buffer
(pinned on CUDA), copies it to a device buffer with one `non_blocking` copy, and hands back
views of the device buffer, one per field in the order given, with the dtype and shape
asked for (the names label the fields of a layout; the caller reads the views by position).

Double-buffered: step N packs into buffer N % 2. Before it writes a buffer, it waits for
the event recorded after that buffer's last copy (step N - 2's), so the host never
overwrites bytes the copy engine may still be reading; the device buffer of a pair is only
overwritten by a copy ordered after every kernel that read it (one stream).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ops import host_kernels
from ops.host_reads import declare_pinned
from ops.host_transfer import to_device

ALIGN = 64  # bytes: every field starts on a cache line, so dtype views are aligned
REASON = "staged_inputs"


class StagedField(NamedTuple):
    """One host tensor to stage: the device view gets `dtype` (converted while packing). A
    NamedTuple: a dozen are built per step, and a frozen dataclass costs several times more."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _capacity(n: int) -> int:
    """Grow to the next power of two (at least 4 KiB) so buffers are rarely re-allocated."""
    cap = 4096
    while cap < n:
        cap *= 2
    return cap


# The shape of one staging call: (name, shape, dtype, source dtype) per field. Steps of one
# batch size repeat it, so its offsets and the buffer views are computed once per pair.
Signature = tuple[tuple[str, tuple[int, ...], torch.dtype, torch.dtype], ...]
_INDEX = (torch.int32, torch.int64)
LAYOUTS_PER_PAIR = 64  # cached layouts per buffer (batch sizes x modes in use); oldest dropped


@dataclass(frozen=True)
class _Layout:
    """Where each field of one signature lives in a pair's buffers, as ready-made views."""

    total: int  # bytes used
    host: tuple[torch.Tensor, ...]  # host views to pack into, one per field, its shape
    device: tuple[torch.Tensor, ...]  # device views with the fields' shapes and dtypes
    used: tuple[torch.Tensor, torch.Tensor]  # the first `total` bytes of both: the one copy
    # For the host kernel's one-call pack (`ops/host_kernels.py`): 4 int64 per field (source
    # element size, offset, element size, count); None when a field needs a conversion the
    # kernel does not make (it copies equal dtypes and converts int32 <-> int64).
    pack: ctypes.Array[ctypes.c_int64] | None


class _Pair:
    """One host buffer, its device twin, the event after their last copy, and the layouts
    (views into both) of the signatures staged through it."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        declare_pinned(self.host)  # the capture rules treat it as pinned on every device
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.event: torch.cuda.Event | None = None
        self.layouts: dict[Signature, _Layout] = {}

    def layout(self, signature: Signature) -> _Layout:
        cached = self.layouts.get(signature)
        if cached is not None:
            return cached
        host: list[torch.Tensor] = []
        device: list[torch.Tensor] = []
        desc: list[int] | None = []
        off = 0
        for _, shape, dtype, source in signature:
            count = math.prod(shape)
            nbytes = count * dtype.itemsize
            host.append(self.host[off : off + nbytes].view(dtype).view(shape))
            device.append(self.device[off : off + nbytes].view(dtype).view(shape))
            if desc is not None and (source is dtype or (source in _INDEX and dtype in _INDEX)):
                desc += [source.itemsize, off, dtype.itemsize, count]
            else:
                desc = None
            off += _aligned(nbytes)
        if len(self.layouts) >= LAYOUTS_PER_PAIR:
            del self.layouts[next(iter(self.layouts))]
        used = (self.host[:off], self.device[:off])
        pack = None if desc is None else (ctypes.c_int64 * len(desc))(*desc)
        layout = self.layouts[signature] = _Layout(off, tuple(host), tuple(device), used, pack)
        return layout


class H2DStaging:
    """Packs named host tensors into one buffer and copies it to `device` once per call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pairs: list[_Pair | None] = [None, None]
        self._next = 0
        self.copies = 0  # calls that copied (for tests)

    def stage(self, fields: Sequence[StagedField]) -> tuple[torch.Tensor, ...]:
        """Device views of `fields`, in their order (same shapes, the asked dtypes), after
        one copy. The views of one call stay valid until the call after next
        (double-buffered)."""
        signature: Signature = tuple(
            [(f.name, f.tensor.shape, f.dtype, f.tensor.dtype) for f in fields]
        )
        pair = self._pairs[self._next]
        layout = pair.layouts.get(signature) if pair is not None else None
        if layout is not None:  # a signature seen on this pair: its buffers are large enough
            self._next ^= 1
        else:
            total = sum(
                _aligned(math.prod(shape) * dtype.itemsize) for _, shape, dtype, _ in signature
            )
            if total == 0:
                return tuple(
                    torch.empty(f.tensor.shape, dtype=f.dtype, device=self.device) for f in fields
                )
            pair = self._pair(total)
        assert pair is not None
        if pair.event is not None:
            pair.event.synchronize()  # step N - 2's copy out of this buffer is done
        if layout is None:
            layout = pair.layout(signature)
        if not self._pack(fields, layout, pair):
            for f, dst in zip(fields, layout.host, strict=True):
                if dst.numel():
                    dst.copy_(f.tensor)
        host, device = layout.used
        to_device(host, device, REASON, non_blocking=True, pinned=True)  # declared at allocation
        if self.device.type == "cuda":
            pair.event = torch.cuda.Event()
            pair.event.record(torch.cuda.current_stream(self.device))
        self.copies += 1
        return layout.device

    @staticmethod
    def _pack(fields: Sequence[StagedField], layout: _Layout, pair: _Pair) -> bool:
        """Pack every field in one host-kernel call; False (nothing written) when there is
        no kernel or a source it cannot read in place (the fields are copied one by one)."""
        k = host_kernels.loaded()
        if k is None or layout.pack is None:
            return False
        addresses = []
        for f in fields:
            t = f.tensor
            if not (t.is_cpu and t.is_contiguous()):
                return False
            addresses.append(t.data_ptr())
        n = len(addresses)
        k.pack(n, (ctypes.c_int64 * n)(*addresses), layout.pack, pair.host.data_ptr())
        return True

    def _pair(self, total: int) -> _Pair:
        i = self._next
        self._next ^= 1
        pair = self._pairs[i]
        if pair is None or pair.host.numel() < total:
            if pair is not None and pair.event is not None:
                pair.event.synchronize()  # the old buffer may still be read by its copy
            pair = _Pair(_capacity(total), self.device)
            self._pairs[i] = pair
        return pair
