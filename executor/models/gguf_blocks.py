"""GGUF's Q4_0, Q4_1 and Q8_0 blocks read as `GroupQuant` values, without dequantizing.

ggml's block layouts (32 weights of one row each, little-endian):
- Q4_0, 18 bytes: fp16 `d`, then 16 bytes whose low nibbles are weights 0..15 and high
  nibbles weights 16..31; `w = d * (q - 8)`.
- Q4_1, 20 bytes: fp16 `d`, fp16 `m`, the same 16 bytes; `w = d * q + m`.
- Q8_0, 34 bytes: fp16 `d`, 32 int8; `w = d * q`.

In `GroupQuant` terms (`w = (q - offset) * scale + zero`): Q4_0 is (d, 0), Q4_1 is
(d, m + 8 d), Q8_0 is 8-bit (d, 0). The values are exactly ggml's; tests compare them with
the `gguf` package's dequantization.
"""

from __future__ import annotations

import numpy as np
import torch

from executor.models.quant_formats import GROUP_SIZE, GroupQuant

BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def read_blocks(data: np.ndarray, fmt: str, rows: int, cols: int) -> GroupQuant:
    """A [rows, cols] weight stored as `fmt` blocks in the raw bytes `data`."""
    if fmt not in _BLOCK_BYTES:
        raise ValueError(f"GGUF block format {fmt!r} is not supported ({', '.join(BLOCK_FORMATS)})")
    if cols % GROUP_SIZE:
        raise ValueError(f"a {fmt} row of {cols} values is not whole blocks of {GROUP_SIZE}")
    groups = cols // GROUP_SIZE
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * groups, _BLOCK_BYTES[fmt])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, groups)
    if fmt == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).astype(np.int16)
        zero = np.zeros_like(d)
        bits = 8
    else:
        q = _nibbles(blocks[:, -16:]).astype(np.int16)
        bits = 4
        if fmt == "Q4_0":
            zero = np.zeros_like(d)
        else:
            m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, groups)
            zero = m + 8 * d
    return GroupQuant(
        q=torch.from_numpy(q.reshape(rows, cols)),
        scale=torch.from_numpy(d),
        zero=torch.from_numpy(zero),
        bits=bits,
        source=fmt,
    )
