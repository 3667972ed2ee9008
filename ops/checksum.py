"""The CRC-32 of a chunk's bytes: the `crc32` fields of the weight-update and KV planes.

zlib's polynomial and value, computed by ISA-L (`isal`, vectorized; docs/performance.md) where
it is installed, else by zlib: the same number either way, so either side of a transfer may use
either. Both release the GIL on large buffers, so chunks are checked on several threads at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

_crc32: Callable[[Any], int]
try:
    from isal import isal_zlib

    _crc32 = isal_zlib.crc32
except ImportError:  # a platform without isal's wheels
    _crc32 = zlib.crc32


def checksum(data: bytes | memoryview) -> int:
    """CRC-32 (zlib's) of `data`, as an unsigned 32-bit int."""
    return _crc32(data) & 0xFFFFFFFF
