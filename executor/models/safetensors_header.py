"""A bounded check of a safetensors file's header before any reader allocates for it.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON (tensor
name -> dtype, shape, data offsets; plus an optional `__metadata__` of strings), then the
tensor bytes. A reader trusts the length to size a buffer, the shapes to size tensors and the
offsets to slice the file. `check_safetensors_header` checks every claim against the file's
real size before anything else reads it, in O(header) time and memory, and raises ValueError
naming the file and the first rule broken:

- the header length fits the file and `MAX_HEADER_BYTES`;
- the JSON is an object of at most `MAX_TENSORS` entries;
- each tensor has a known dtype, at most `MAX_DIMS` non-negative dimensions, and offsets
  `[begin, end]` inside the data section with `end - begin` = elements x dtype size;
- tensors do not overlap.
(GGUF files get the same treatment in `gguf_header.py`.)
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 32 << 20  # real headers are kilobytes to a few MiB
MAX_TENSORS = 1 << 20
MAX_DIMS = 8
# Bytes per element of each safetensors dtype (sub-byte types are not written by torch).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _refuse(path: Path, rule: str) -> ValueError:
    return ValueError(f"safetensors file {path.name}: {rule}")


def check_safetensors_header(path: Path) -> int:
    """Check `path`'s header (see the module doc); the number of tensors it declares."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _refuse(path, f"{size} bytes is too short for the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise _refuse(path, f"header length {length} exceeds {MAX_HEADER_BYTES} bytes")
        if 8 + length > size:
            raise _refuse(path, f"header length {length} runs past the file's {size} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refuse(path, f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _refuse(path, "header is not a JSON object")
    data_bytes = size - 8 - length
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(path, entry)
            continue
        if len(spans) >= MAX_TENSORS:
            raise _refuse(path, f"more than {MAX_TENSORS} tensors")
        spans.append(_check_tensor(path, name, entry, data_bytes))
    spans.sort()
    for (_, end, name), (begin, _, following) in itertools.pairwise(spans):
        if begin < end:
            raise _refuse(path, f"tensors {name!r} and {following!r} overlap")
    return len(spans)


def _check_metadata(path: Path, entry: Any) -> None:
    if not isinstance(entry, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
    ):
        raise _refuse(path, "__metadata__ must map strings to strings")


def _check_tensor(path: Path, name: str, entry: Any, data_bytes: int) -> tuple[int, int, str]:
    if not isinstance(entry, dict):
        raise _refuse(path, f"tensor {name!r} is not an object")
    dtype = entry.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise _refuse(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    shape = entry.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise _refuse(
            path, f"tensor {name!r} shape must be at most {MAX_DIMS} non-negative integers"
        )
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise _refuse(path, f"tensor {name!r} data_offsets must be [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise _refuse(
            path,
            f"tensor {name!r} data_offsets [{begin}, {end}] are outside the "
            f"{data_bytes}-byte data section",
        )
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != nbytes:
        raise _refuse(
            path,
            f"tensor {name!r} spans {end - begin} bytes but its shape {shape} of {dtype} "
            f"needs {nbytes}",
        )
    return begin, end, name
