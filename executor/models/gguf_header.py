"""A bounded walk over a GGUF file's header before any parser allocates for it.

A GGUF header declares counts and lengths (tensors, metadata entries, string lengths, array
counts, tensor dimensions and offsets) that a reader trusts to size its allocations: a
45-byte file can claim 2**63 tensors. `check_gguf_header` reads the header with every claim
checked against the bytes the file actually has, in O(header) time and memory, and raises
ValueError naming the first impossible one. The loader calls it before `gguf.GGUFReader`.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
MAX_KEY = 1 << 16  # bytes of a metadata key
MAX_DIMS = 8
# Scalar value types: their sizes (GGUF spec: u8 i8 u16 i16 u32 i32 f32 bool . . u64 i64 f64).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# Fewer bits than this per element no tensor type has (the smallest ggml types use ~1.5).
_MIN_BITS_PER_ELEMENT = 1


class _Cursor:
    def __init__(self, data: memoryview, size: int) -> None:
        self.data, self.at, self.size = data, 0, size

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise ValueError(
                f"GGUF header: {what} needs {n} bytes at offset {self.at}; the file has {self.size}"
            )
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack("<Q", self.take(8, what))[0])

    def string(self, what: str, cap: int | None = None) -> str:
        n = self.u64(what + " length")
        if cap is not None and n > cap:
            raise ValueError(f"GGUF header: {what} is {n} bytes long; at most {cap}")
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")


def open_gguf(path: Path) -> Any:
    """`gguf.GGUFReader` on `path`, once its header passed `check_gguf_header`."""
    import gguf

    check_gguf_header(path)
    return gguf.GGUFReader(str(path))


def check_gguf_header(path: Path) -> None:
    """Raise ValueError when the header of `path` claims more than the file holds (the file
    is mapped, not read: only the header's pages are touched)."""
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path}: {size} bytes is too short for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        data = memoryview(m)
        try:
            _walk(_Cursor(data, size), path)
        finally:
            data.release()


def _walk(c: _Cursor, path: Path) -> None:
    size = c.size
    if bytes(c.take(4, "magic")) != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic)")
    version = c.u32("version")
    if version not in (2, 3):
        raise ValueError(f"GGUF header: version {version} is not supported (2 or 3)")
    n_tensors = c.u64("tensor count")
    n_kv = c.u64("metadata count")
    # Each entry takes at least 8 (key length) + 4 (type) + 1 bytes, each tensor info at
    # least 8 + 4 + 4 + 8: counts beyond what the file could hold are impossible.
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise ValueError(
            f"GGUF header: {n_kv} metadata entries and {n_tensors} tensors cannot fit in "
            f"{size} bytes"
        )
    for i in range(n_kv):
        key = c.string(f"metadata key {i}", MAX_KEY)
        _skip_value(c, c.u32(f"type of {key}"), key, depth=0)
    for i in range(n_tensors):
        name = c.string(f"tensor {i} name", MAX_KEY)
        n_dims = c.u32(f"dimensions of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"GGUF header: tensor {name} has {n_dims} dimensions")
        elements = 1
        for d in range(n_dims):
            elements *= c.u64(f"dimension {d} of {name}")
        c.u32(f"type of {name}")
        offset = c.u64(f"offset of {name}")
        if elements * _MIN_BITS_PER_ELEMENT > size * 8 or offset > size:
            raise ValueError(
                f"GGUF header: tensor {name} ({elements} elements at offset {offset}) does not "
                f"fit in a {size}-byte file"
            )


def _skip_value(c: _Cursor, kind: int, key: str, depth: int) -> None:
    if kind in _SCALAR:
        c.take(_SCALAR[kind], key)
    elif kind == _STRING:
        c.string(key)
    elif kind == _ARRAY and depth == 0:
        item = c.u32(f"{key} item type")
        count = c.u64(f"{key} item count")
        least = _SCALAR.get(item, 8)  # a string item holds at least its 8-byte length
        if count * least > c.size:
            raise ValueError(
                f"GGUF header: {key} claims {count} items; the file has {c.size} bytes"
            )
        if item in _SCALAR:
            c.take(count * _SCALAR[item], key)
        else:
            for _ in range(count):
                _skip_value(c, item, key, depth + 1)
    else:
        raise ValueError(f"GGUF header: {key} has value type {kind}, which GGUF does not define")
