"""A bounded walk over a GGUF file's header, and the file read through it.

A GGUF header declares counts and lengths (tensors, metadata entries, string lengths, array
counts, tensor dimensions and offsets) that a reader trusts to size its allocations: a
45-byte file can claim 2**63 tensors. `check_gguf_header` reads the header with every claim
checked against the bytes the file actually has, in O(header) time and memory, and raises
ValueError naming the first impossible one.

`open_gguf` reads the file through the same walk: metadata values and tensor infos, with each
tensor's bytes a view of the mapped file (`GGUFFile`: the `fields` / `tensors` surface of
`gguf.GGUFReader` the loader and tokenizer use). The `gguf` package's reader builds numpy
views for every part of every metadata entry, tens of seconds for a 49k-token vocabulary on a
small CPU; this walk takes under a second (`tests/test_gguf_header.py` compares the two).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


@dataclass(frozen=True)
class GGUFField:
    """One metadata entry: `contents()` is its value (a list for an array), as gguf's."""

    value: Any

    def contents(self) -> Any:
        return self.value

    @property
    def data(self) -> Any:
        return self.value


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: np.ndarray  # GGUF's order: the row length first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file: floats, or [..., row bytes] of blocks


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensor]


def open_gguf(path: Path) -> GGUFFile:
    """Metadata and tensors of `path`, read through the bounded walk (a hostile header is
    refused before anything is allocated for it)."""
    import gguf

    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path}: {size} bytes is too short for a GGUF header")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    c = _Cursor(memoryview(mapped.data), size)
    fields: dict[str, GGUFField] = {}
    infos = _walk(c, path, fields)
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else 32
    start = -(-c.at // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has unknown type {type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        if ggml_type.name in _FLOAT_TYPES:
            dtype = np.dtype(_FLOAT_TYPES[ggml_type.name])
            count = elements
        else:
            dtype, count = np.dtype(np.uint8), elements * type_size // block
            shape = (*shape[:-1], shape[-1] * type_size // block)
        begin = start + offset
        if begin + count * dtype.itemsize > size:
            raise ValueError(f"GGUF tensor {name!r} runs past the end of the {size}-byte file")
        data = mapped[begin : begin + count * dtype.itemsize].view(dtype).reshape(shape)
        tensors.append(GGUFTensor(name, np.array(dims, dtype=np.uint64), ggml_type, data))
    return GGUFFile(fields, tensors)


_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


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


def _walk(
    c: _Cursor, path: Path, fields: dict[str, GGUFField] | None = None
) -> list[tuple[str, list[int], int, int]]:
    """Check the header; with `fields`, collect the metadata values into it. The tensor infos
    (name, dimensions, type, offset in the data section)."""
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
        kind = c.u32(f"type of {key}")
        if fields is None:
            _skip_value(c, kind, key, depth=0)
        else:
            fields[key] = GGUFField(_read_value(c, kind, key, depth=0))
    infos = []
    for i in range(n_tensors):
        name = c.string(f"tensor {i} name", MAX_KEY)
        n_dims = c.u32(f"dimensions of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"GGUF header: tensor {name} has {n_dims} dimensions")
        dims = [c.u64(f"dimension {d} of {name}") for d in range(n_dims)]
        elements = 1
        for d in dims:
            elements *= d
        type_id = c.u32(f"type of {name}")
        offset = c.u64(f"offset of {name}")
        if elements * _MIN_BITS_PER_ELEMENT > size * 8 or offset > size:
            raise ValueError(
                f"GGUF header: tensor {name} ({elements} elements at offset {offset}) does not "
                f"fit in a {size}-byte file"
            )
        infos.append((name, dims, type_id, offset))
    return infos


_STRUCT = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


def _read_value(c: _Cursor, kind: int, key: str, depth: int) -> Any:
    """A metadata value (bounded as `_skip_value`): a scalar, a str, or a list of them."""
    if kind in _SCALAR:
        return struct.unpack(_STRUCT[kind], c.take(_SCALAR[kind], key))[0]
    if kind == _STRING:
        return c.string(key)
    if kind == _ARRAY and depth == 0:
        item = c.u32(f"{key} item type")
        count = c.u64(f"{key} item count")
        least = _SCALAR.get(item, 8)
        if count * least > c.size:
            raise ValueError(
                f"GGUF header: {key} claims {count} items; the file has {c.size} bytes"
            )
        if item in _SCALAR:
            raw = c.take(count * _SCALAR[item], key)
            return np.frombuffer(raw, dtype=_NUMPY[item]).tolist()
        return [_read_value(c, item, key, depth + 1) for _ in range(count)]
    raise ValueError(f"GGUF header: {key} has value type {kind}, which GGUF does not define")


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
